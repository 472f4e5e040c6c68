"""Recurrent layers as loops DTensor can lay out while a step is traced:
rolled (`rolled_rnn`) or unrolled."""

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from keras import tree
from keras.src import backend as keras_backend

from flexflow_keras.op_specs_sequence import recurrent
from flexflow_keras.runtime import rolled_rnn


@contextlib.contextmanager
def unrolled(layer: Any, rolled: bool = False) -> Iterator[None]:
    """Recurrent layers run as loops DTensor can lay out, without cuDNN,
    while traced.

    Why: DTensor has no layout propagation for the while-loop TensorLists
    (`tf.TensorListStack`) of Keras's rolled RNN, nor for cuDNN RNN
    kernels. With `rolled`, a layer of Keras's own cells runs
    `rolled_rnn`'s loop when its time and batch sizes are known while
    traced; any other (a user's cell, a user's `unroll=True`) runs
    Keras's unrolled loop, plain ops with the same arithmetic. Keras's
    unrolled loop zeroes a backward layer's masked outputs at the wrong
    steps (`_masked_steps_zeroed`), so its masking is redone here.
    """
    saved = []
    rnns = [
        rnn for rnn in [layer] + [
            getattr(layer, name, None) for name in ("forward_layer",
                                                    "backward_layer")
        ]  # a Bidirectional wrapper runs two RNN layers
        if rnn is not None and hasattr(rnn, "cell")
    ]
    cells = [] if rolled else None
    for rnn in rnns if rolled else ():
        found = rolled_rnn.cells_of(rnn.cell)
        if found is None or getattr(rnn, "unroll", False):
            cells = None
            break
        cells += found
    for rnn in rnns:
        for name, value in (("unroll", cells is None), ("use_cudnn", False)):
            if hasattr(rnn, name):
                saved.append((rnn, name, getattr(rnn, name)))
                setattr(rnn, name, value)
    keras_rnn = keras_backend.rnn
    keras_backend.rnn = _as_dtensor_loop(keras_rnn, cells)
    try:
        yield
    finally:
        keras_backend.rnn = keras_rnn
        for rnn, name, value in saved:
            setattr(rnn, name, value)


class Loops:
    """How an executor runs its plans' recurrent layers: rolled
    (`rolled_rnn`) until DTensor refuses a step's first run, unrolled
    from then on (as before `rolled_rnn`: slower to trace and expand,
    but plain ops). The rule both executors keep.

    Args:
        plans: The executor's op plans (each with `.op.layer`).
    """

    def __init__(self, plans: Any):
        # Whether any layer runs a loop: a rolled loop is laid out only on
        # static shapes, so such steps are traced with their batch size.
        self.recurrent = any(recurrent(plan.op.layer) for plan in plans)
        self.rolled = True

    def running(self, layer: Any) -> Any:
        """The context `layer` is called in while a step is traced."""
        return unrolled(layer, self.rolled)

    def unroll_instead(self) -> bool:
        """After a first run DTensor refused (nothing took the step):
        whether the loops run unrolled from now on, so the step is to be
        traced again and redone; False if there is nothing left to try
        (no loops, or unrolled already)."""
        if not (self.recurrent and self.rolled):
            return False
        self.rolled = False
        return True


def _as_dtensor_loop(keras_rnn: Any, cells: list | None) -> Any:
    """Keras's `backend.rnn` as a loop DTensor lays out: `rolled_rnn`'s
    for the layer's `cells` (Keras's own) when it `rolls`, else Keras's
    unrolled loop with its masking mended."""
    unrolled_rnn = _masked_steps_zeroed(keras_rnn)

    def rnn(step_function, inputs, initial_states, go_backwards=False,
            mask=None, constants=None, unroll=False, input_length=None,
            time_major=False, zero_output_for_mask=False,
            return_all_outputs=True):
        if cells is not None and rolled_rnn.rolls(inputs, mask,
                                                  input_length, time_major):
            return rolled_rnn.rolled_rnn(
                step_function, inputs, initial_states, cells,
                go_backwards=go_backwards, mask=mask, constants=constants,
                time_major=time_major,
                zero_output_for_mask=zero_output_for_mask,
                return_all_outputs=return_all_outputs,
            )
        return unrolled_rnn(
            step_function, inputs, initial_states,
            go_backwards=go_backwards, mask=mask, constants=constants,
            unroll=True, input_length=input_length, time_major=time_major,
            zero_output_for_mask=zero_output_for_mask,
            return_all_outputs=return_all_outputs,
        )

    return rnn


def _masked_steps_zeroed(keras_rnn: Any) -> Any:
    """Keras's `backend.rnn`, with an unrolled backward loop's masked
    outputs zeroed at the steps the rolled loop zeroes.

    Keras 3's TensorFlow `rnn(unroll=True, go_backwards=True,
    zero_output_for_mask=True)` zeroes its outputs (in processing order,
    last time step first) with the mask in time order: a valid step's
    output is zeroed and a padded one kept. `Bidirectional` with
    `return_sequences=True` sets `zero_output_for_mask` on its backward
    layer, so every masked bidirectional sequence model met it (measured:
    outputs 0.57 off Keras's rolled loop for an LSTM; a masked
    Embedding -> Bidirectional LSTM model's accuracy 0.0625 off plain
    Keras in two epochs). Here the loop runs without `zero_output_for_mask` (masked
    steps carry the previous output, as the rolled loop's states do) and
    the outputs are zeroed with the mask in processing order, which is
    what the rolled loop computes.
    """

    def rnn(step_function, inputs, initial_states, go_backwards=False,
            mask=None, constants=None, unroll=False, input_length=None,
            time_major=False, zero_output_for_mask=False,
            return_all_outputs=True):
        buggy = (unroll and go_backwards and zero_output_for_mask
                 and mask is not None)
        last, outputs, states = keras_rnn(
            step_function, inputs, initial_states,
            go_backwards=go_backwards, mask=mask, constants=constants,
            unroll=unroll, input_length=input_length, time_major=time_major,
            zero_output_for_mask=zero_output_for_mask and not buggy,
            return_all_outputs=return_all_outputs,
        )
        if not buggy:
            return last, outputs, states
        keep = tf.cast(mask, tf.bool)
        if keep.shape.rank > 2:
            keep = keep[..., 0]
        if time_major:  # the mask comes as (time, batch) then
            keep = tf.transpose(keep)
        # (batch, time) in processing order; a gather, not `tf.reverse`
        # (DTensor has no rule for ReverseV2)
        steps = keep.shape[1]
        keep = tf.gather(keep, list(range(steps - 1, -1, -1)), axis=1)
        if not return_all_outputs:
            keep = keep[:, -1:]

        def zeroed(value, step_keep):
            for _ in range(value.shape.rank - step_keep.shape.rank):
                step_keep = tf.expand_dims(step_keep, -1)
            return tf.where(step_keep, value, tf.zeros_like(value))

        sequence_keep = tf.transpose(keep) if time_major else keep
        outputs = tree.map_structure(
            lambda v: zeroed(v, sequence_keep), outputs
        )
        last = tree.map_structure(lambda v: zeroed(v, keep[:, -1]), last)
        return last, outputs, states

    return rnn
