"""What flexflow_keras keeps on a Keras model, in one object.

Why one object: the settings `compile()` resolved, the plans made per
batch size, the executor fit() runs, the traced graph of a subclassed
model and the reasons a model trains as plain Keras are read and written
by `models.py`, `keras_graph.py` and `runtime/trainer.py`; as loose
attributes their names and defaults drifted apart. It is set with
`object.__setattr__`, past Keras's attribute tracking, so that nothing
in it (a traced functional model, say) becomes a tracked sublayer of the
model: no extra weights, nothing saved.
"""

import dataclasses
from typing import Any

ATTRIBUTE = "_flexflow_state"


@dataclasses.dataclass
class ModelState:
    """One model's parallelization state.

    Args:
        settings: The `settings.Settings` compile() resolved; None while
            the model was not compiled through flexflow_keras.
        plans: Global batch size -> its `planner.Plan`.
        plan: The plan attached to the runtime now, or None.
        executor: The runtime's executor fit() runs now, or None (plain
            Keras).
        traced_function: The functional model traced from a subclassed
            model's `call` (`keras_graph.trace_call`), or None.
        traced_batch: The batch size `traced_function` was traced on
            where the call needs a static one, else None (any batch).
        traced_at: Batch size -> the trace on it, for such a call.
        trace_inputs: The symbolic inputs (any batch) such a call is
            traced again from, for another batch size.
        traced_whole: Whether `traced_function` is the model called as
            one op (its `call()` runs on no symbolic tensors).
        traced_lengths: Per input (flattened), the dims beyond the batch
            fit()'s data had where the model was traced on them (None:
            unknown, varying); None where it was not.
        trace_failure: Why that trace failed, or None.
        runtime_failure: Why the strategy stopped running on TensorFlow
            (later fits stay plain Keras), or None.
        warned_plain: Whether the user was told the model trains as plain
            Keras (told once).
    """

    settings: Any = None
    plans: dict[int, Any] = dataclasses.field(default_factory=dict)
    plan: Any = None
    executor: Any = None
    traced_function: Any = None
    traced_batch: int | None = None
    traced_at: dict[int, Any] = dataclasses.field(default_factory=dict)
    trace_inputs: Any = None
    traced_whole: bool = False
    traced_lengths: list | None = None
    trace_failure: str | None = None
    runtime_failure: str | None = None
    warned_plain: bool = False


def state_of(model: Any) -> ModelState:
    """`model`'s state, made (empty) on first use."""
    state = vars(model).get(ATTRIBUTE)
    if state is None:
        state = ModelState()
        object.__setattr__(model, ATTRIBUTE, state)
    return state
