"""Keras's `train_function` / `test_function` / `predict_function`
contract, for the executors' steps.

Keras's TensorFlow trainer calls `train_function(iterator)` and
`test_function(iterator)` for up to `steps_per_execution` batches (raising
`StopIteration` when the iterator had none) and `predict_function(batches)`
for a list of batches whose outputs it concatenates.
"""

from collections.abc import Callable
from typing import Any

import tensorflow as tf
from keras import tree

from flexflow_keras.runtime import fresh_state


def keras_function(
    model: Any,
    kind: str,
    run: Callable[[str, Any], Any],
    failed: Callable[[str, Exception, Any, Any], Any],
    unfed: Callable[[], None] | None = None,
) -> Callable[[Any], Any]:
    """The `kind` function of `model`, one batch at a time through `run`.

    Args:
        model: The Keras model (for `steps_per_execution`).
        kind: `train`, `test` or `predict`.
        run: `run(kind, batch)`: the outputs (logs) of one batch.
        failed: `failed(kind, error, batches, batch)` when `run` raised:
            what the function returns instead, the batches of this call
            redone some other way (it re-raises what it cannot handle).
        unfed: For `train`, what Keras's own function changes when it is
            called one step at a time on an iterator with no batch left
            (`unfed_step`).
    """
    if kind == "predict":

        @_between_steps
        def predict_function(batches):
            outputs = None
            for batch in batches:
                try:
                    out = run(kind, batch)
                except Exception as error:  # noqa: BLE001 - `failed` sorts
                    return failed(kind, error, batches, batch)
                outputs = out if outputs is None else tree.map_structure(
                    lambda a, b: tf.concat([a, b], 0), outputs, out
                )
            return outputs

        return predict_function

    @_between_steps
    def function(iterator):
        logs = None
        for _ in range(model.steps_per_execution):
            try:
                batch = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if logs is None:
                    if unfed is not None and model.steps_per_execution == 1:
                        unfed()
                    raise StopIteration
                break
            try:
                logs = run(kind, batch)
            except Exception as error:  # noqa: BLE001 - `failed` sorts
                return failed(kind, error, _alone(iterator, batch), batch)
        return logs

    return function


def _alone(iterator: Any, batch: Any) -> Any:
    """An iterator of `batch` alone, of `iterator`'s type: a `tf.data`
    iterator of the same element spec where `iterator` is one.

    Why: `failed` may hand the batch to Keras's own function, which
    Keras then goes on calling with `iterator`. Keras traces that
    function once per argument type; on a Python iterator of a batch of
    static shape it traced another one than for the dataset's iterator,
    so the next batch started a second trace, whose `tf.random` kernels
    drew their streams from the start again (an evaluate of a masked
    autoencoder after a failed first step: its loss and MAE 0.2% to 0.8%
    off plain Keras's, the first batch's masks drawn again for the
    second).
    """
    if not isinstance(iterator, tf.data.Iterator):
        return iter([batch])
    try:
        return iter(tf.data.Dataset.from_generator(
            lambda: iter([batch]), output_signature=iterator.element_spec))
    except (TypeError, ValueError):  # a structure it cannot carry
        return iter([batch])


def _between_steps(function: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`function` after the Keras values a callback wrote since the last
    step went in, its own variable reads and writes not watched
    (`fresh_state`)."""

    def run(arg):
        fresh_state.settle()
        with fresh_state.quiet():
            return function(arg)

    return run
