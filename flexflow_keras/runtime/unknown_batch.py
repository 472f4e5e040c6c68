"""Keras code that reads the traced batch dim behaves as on Keras's trace.

Keras traces its steps on a dataset's element spec, whose batch dim is
unknown wherever the last batch may be partial (arrays, a `tf.data`
pipeline batched without `drop_remainder`). The runtime traces some
steps with the batch size written in: rolled recurrent loops need it,
and so do ops DTensor expands only on static shapes
(`ModelStepExecutor._failed`). Keras code that branches on the static
batch dim then takes the other branch.

The one such branch that changes a result: `CompileLoss` updates each
output's loss tracker (`dense_loss`, `seq_loss`, ..., logged by a model
with several outputs) with `sample_weight=y_pred.shape[0]`. On Keras's
trace that is None and each batch counts once; on a static trace it is
the batch size and a partial last batch counts less. A two-output model
with an LSTM logged `seq_loss` 73.29 against plain Keras's 70.30, with
the total loss, the metrics and every weight equal.

Counting each batch once is right whatever Keras traced on: where its
batch dim was known, every batch of the dataset has that size, and equal
weights give the unweighted mean.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from keras.src.metrics.reduction_metrics import Mean


@contextlib.contextmanager
def loss_trackers_unweighted(model: Any) -> Iterator[None]:
    """While a step of `model` is traced with a static batch dim: its
    per-output loss trackers count each batch once, as on Keras's trace
    with the batch dim unknown. Other `Mean`s are left as they are."""
    own = vars(Mean).get("update_state")
    inherited = Mean.update_state

    def update_state(tracker, values, sample_weight=None):
        if isinstance(sample_weight, int) and _per_output_tracker(
                model, tracker):
            sample_weight = None
        return inherited(tracker, values, sample_weight=sample_weight)

    Mean.update_state = update_state
    try:
        yield
    finally:
        if own is None:
            del Mean.update_state
        else:
            Mean.update_state = own


def _per_output_tracker(model: Any, tracker: Any) -> bool:
    """Whether `tracker` is one of `model`'s per-output loss trackers
    (made when `CompileLoss` is built, at the step's first call)."""
    compile_loss = getattr(model, "_compile_loss", None)
    trackers = getattr(compile_loss, "metrics", None) or []
    return any(tracker is each for each in trackers)
