"""The search's progress as a Keras progress bar.

Why: FlexFlow's `iter(100) cur(11.16) next(15.23) best(11.16)` lines
mean little to a Keras user; `compile()`'s search shows what `fit()`
shows, a `keras.utils.Progbar`, over the budget's iterations with the
best simulated step time and its speed-up over data parallelism.
`search_verbose=2` keeps FlexFlow's lines instead (`search.search`).
"""

from typing import Any


def progress_bar(budget: int) -> Any:
    """A `search.Progress` drawing a Keras `Progbar` of `budget`
    iterations (a search may end early: interrupted, or no proposal
    left)."""
    from keras.utils import Progbar

    bar = Progbar(max(budget, 1), stateful_metrics=("best_ms", "speedup"),
                  unit_name="iteration")

    def show(iterations: int, best_ms: float, data_parallel_ms: float,
             done: bool) -> None:
        if not done and iterations >= budget:
            return  # the last call draws the full bar, once
        values = [("best_ms", best_ms)]
        if best_ms > 0:
            values.append(("speedup", data_parallel_ms / best_ms))
        bar.update(min(iterations, budget), values=values,
                   finalize=done or None)

    return show
