"""Recurrent loops that DTensor can lay out: a while loop over plain
tensors, with a backward loop of its own.

Why: Keras's rolled loop keeps its steps in TensorLists, and so does
TensorFlow's gradient of any `tf.while_loop` (its accumulators); DTensor
has no layout rule for them. Unrolled, a 200-step Bidirectional LSTM is
tens of thousands of ops that DTensor expands one by one (keras.io's
IMDB script: minutes to its first step on 4 virtual CPUs, against about
4 s for this loop). Here the forward loop writes each step's output and
the states it started from into tensors (`tensor_scatter_nd_update`),
and a `tf.custom_gradient` runs a second loop, last step first, that
computes each step again from its stored states under a tape: the same
arithmetic as Keras's rolled loop, in the same order.

What DTensor needs (TF 2.21, measured): static shapes inside the loop
(the step is traced with its batch size written in: `rolls`), no strided
slice that adds an axis in the body (`x[None]` crashed the process:
`tf.expand_dims` instead), the last output taken from the loop's carries
(`rolled_rnn`), and only Keras's own cells, whose bodies are known to
keep to that; other cells run unrolled (`unroll.py`). DTensor may name a
loop's functions as an earlier expansion's (`name_clash`): the step's
first run is then traced again and redone (`RedoneOnNameClash`).
"""

import itertools
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from keras import tree
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.common.variables import AutocastScope
from keras.src.layers.rnn.gru import GRUCell
from keras.src.layers.rnn.lstm import LSTMCell
from keras.src.layers.rnn.simple_rnn import SimpleRNNCell
from keras.src.layers.rnn.stacked_rnn_cells import StackedRNNCells

# Cells whose step bodies are known to run inside a DTensor while loop.
_KERAS_CELLS = (SimpleRNNCell, LSTMCell, GRUCell)
# The dropout masks a cell keeps for one call (`DropoutRNNCell`).
_MASK_ATTRIBUTES = ("_dropout_mask", "_recurrent_dropout_mask")


# How many times a step DTensor refused for a loop function's name
# (`name_clash`) is traced again and redone.
MAX_NAME_CLASHES = 8


# Counters each loop carries beyond its own; `vary` adds one.
_SPARE_CARRIES = [0]


def vary() -> None:
    """Loops traced from now on carry one counter more.

    Why: a loop's node gets the name of an earlier expansion's loop when
    it lands at the address that loop had (`name_clash`), and traced
    again with the same carries it tends to land there again (measured:
    the same name refused 8 times in a row). A loop with one carry more
    is an op of another size, allocated elsewhere.
    """
    _SPARE_CARRIES[0] += 1


def _spare_carries() -> list:
    return [tf.constant(0) for _ in range(_SPARE_CARRIES[0])]


def name_clash(error: Exception) -> bool:
    """Whether DTensor refused a function it outlined from a loop
    because another of that name exists.

    DTensor names such a function after the loop's node, through a name
    cache keyed by the address of an op it has since freed, and the
    functions of earlier expansions stay in the eager context: a later
    expansion's loop can get an earlier loop's name (measured:
    'rnn_loop_3520_cond' of the train step, in the test step's
    expansion). The refusal comes before anything runs, so the caller
    traces the step again and redoes it (`RedoneOnNameClash`)."""
    return (isinstance(error, tf.errors.InvalidArgumentError)
            and "a different function with the same name already exists"
            in str(error))


class RedoneOnNameClash:
    """`make()`'s function (`function`), made again and called again
    while DTensor refuses its first call for a loop function's name
    (`name_clash`), at most `MAX_NAME_CLASHES` times: the refusal comes
    before anything runs. Each redo's loops carry one counter more
    (`vary`): redone unchanged, a loop tends to land where it was and be
    refused under the same name again.

    The one place a refused first call is redone: both executors' step
    functions and `realized.record`'s recording step are made through
    it. `redos` counts the calls redone.
    """

    def __init__(self, make: Any):
        self._make = make
        self.function = make()
        self._ran = False
        self.redos = 0

    def __call__(self, *args: Any) -> Any:
        for attempt in itertools.count(1):
            try:
                result = self.function(*args)
                if not self._ran:
                    # DTensor runs functions asynchronously: a refusal
                    # could surface at a later op, past this reach.
                    context.async_wait()
            except tf.errors.InvalidArgumentError as error:
                if (self._ran or not name_clash(error)
                        or attempt == MAX_NAME_CLASHES):
                    raise
                context.async_clear_error()
                vary()
                self.redos += 1
                self.function = self._make()
                continue
            self._ran = True
            return result


def cells_of(cell: Any) -> list | None:
    """The cells a layer's cell holds, or None when one is not Keras's
    own (a user's cell runs unrolled)."""
    if isinstance(cell, StackedRNNCells):
        found = []
        for inner in cell.cells:
            inner_cells = cells_of(inner)
            if inner_cells is None:
                return None
            found += inner_cells
        return found
    return [cell] if type(cell) in _KERAS_CELLS else None


def rolls(inputs: Any, mask: Any, input_length: Any,
          time_major: bool) -> bool:
    """Whether `rolled_rnn` can run this loop: time and batch sizes
    known while traced, no per-sample lengths without a mask."""
    if isinstance(input_length, tf.Tensor) and mask is None:
        return False
    for value in tree.flatten(inputs):
        shape = value.shape
        if shape.rank is None or shape.rank < 3 or None in shape[:2]:
            return False
    return True


def rolled_rnn(step_function: Any, inputs: Any, initial_states: Any,
               cells: list, go_backwards: bool = False, mask: Any = None,
               constants: Any = None, time_major: bool = False,
               zero_output_for_mask: bool = False,
               return_all_outputs: bool = True) -> tuple:
    """Keras's `backend.rnn` (TensorFlow, rolled), as a loop DTensor lays
    out; same arguments and results. `cells`: the layer's cells, whose
    dropout masks the backward loop puts back (`RNN.call` clears them
    before the gradient runs)."""
    flat_inputs = tree.flatten(inputs)
    if not time_major:
        flat_inputs = [_swap(x) for x in flat_inputs]
    steps = flat_inputs[0].shape[0]
    constants = list(constants or [])
    if mask is not None:
        mask = tf.cast(mask, tf.bool)
        if mask.shape.rank == 2:
            mask = tf.expand_dims(mask, -1)
        if not time_major:
            mask = _swap(mask)
    if go_backwards:
        order = list(range(steps - 1, -1, -1))  # a gather: DTensor has
        flat_inputs = [tf.gather(x, order) for x in flat_inputs]  # no
        if mask is not None:  # rule for ReverseV2
            mask = tf.gather(mask, order)
    state_structure = tuple(initial_states)
    flat_states = tree.flatten(state_structure)

    # The cells' weights go into the loops as inputs, and each step reads
    # them there (a StatelessScope): their gradients come out as the
    # loop's input gradients, wherever the step got the weights from (a
    # variable, or the layer-by-layer executor's scope of read values,
    # which no longer holds when the gradient runs).
    weights = list({id(w): w for cell in cells for w in cell.weights}
                   .values())
    n_const = len(tree.flatten(constants))

    def step(flat_x, flat_s, flat_c):
        x = tree.pack_sequence_as(inputs, list(flat_x))
        s = tree.pack_sequence_as(state_structure, list(flat_s))
        c = tree.pack_sequence_as(constants, list(flat_c[:n_const]))
        with StatelessScope(list(zip(weights, flat_c[n_const:])),
                            initialize_variables=False):
            output, new_states = step_function(x, tuple(s) + tuple(c))
        return tree.flatten(output), tree.flatten(new_states), output

    weight_values = [_stored(w) for w in weights]

    # The first step once outside the loop, as Keras's rolled loop runs
    # it: it gives the output's structure and draws the cells' dropout
    # masks (their seed generators advance here, once per call).
    first_output, _, output_structure = step(
        [tf.gather(x, 0) for x in flat_inputs], flat_states,
        tree.flatten(constants) + weight_values,
    )
    dropout_masks = [(cell, name, getattr(cell, name, None))
                     for cell in cells for name in _MASK_ATTRIBUTES]
    keep_previous = mask is not None and not zero_output_for_mask
    n_in, n_st = len(flat_inputs), len(flat_states)
    n_out = len(first_output)

    def masked(t, flat_out, flat_new, flat_prev, flat_s):
        """One step's outputs and states with the mask applied."""
        if mask is None:
            return flat_out, flat_new
        keep = tf.gather(mask, t)
        fill = flat_prev if keep_previous else [
            tf.zeros_like(o) for o in flat_out
        ]
        return ([tf.where(_tiled(keep, o), o, f)
                 for o, f in zip(flat_out, fill)],
                [tf.where(_tiled(keep, n), n, s)
                 for n, s in zip(flat_new, flat_s)])

    @tf.custom_gradient
    def loop(*args):
        xs = list(args[:n_in])
        s0 = list(args[n_in:n_in + n_st])
        cs = list(args[n_in + n_st:])
        zero_out = [tf.zeros_like(o) for o in first_output]

        def body(t, prev, states, outs, kept_states, kept_prev, spare):
            kept_states = [_written(b, t, s)
                           for b, s in zip(kept_states, states)]
            if keep_previous:
                kept_prev = [_written(b, t, p)
                             for b, p in zip(kept_prev, prev)]
            out, new, _ = step([tf.gather(x, t) for x in xs], states, cs)
            out, new = masked(t, out, new, prev, states)
            outs = [_written(b, t, o) for b, o in zip(outs, out)]
            return (t + 1, out, new, outs, kept_states, kept_prev,
                    [c + 1 for c in spare])

        start = (
            tf.constant(0), zero_out, s0,
            [_buffer(steps, o) for o in first_output],
            [_buffer(steps, s) for s in s0],
            [_buffer(steps, o) for o in first_output] if keep_previous
            else [],
            _spare_carries(),
        )
        ended = tf.while_loop(
            lambda t, *_: t < steps, body, start, maximum_iterations=steps,
            name=_unique_name("rnn_loop"),
        )
        _, last_out, last_states, outs, kept_states, kept_prev, _ = ended

        def grad(*upstream, variables=None):
            variables = list(variables or [])
            d_outs = [_zero_if_none(g, o)
                      for g, o in zip(upstream[:n_out], outs)]
            d_last = [_zero_if_none(g, s) for g, s in zip(
                upstream[n_out:n_out + n_st], last_states)]
            d_last_out = [_zero_if_none(g, o) for g, o in zip(
                upstream[n_out + n_st:], last_out)]
            restored = [(cell, name, getattr(cell, name, None))
                        for cell, name, _ in dropout_masks]

            def back(t, d_states, d_prev, d_xs, d_cs, d_vars, spare):
                t_now = steps - 1 - t
                x_t = [tf.gather(x, t_now) for x in xs]
                s_t = [tf.gather(b, t_now) for b in kept_states]
                p_t = ([tf.gather(b, t_now) for b in kept_prev]
                       if keep_previous else [])
                with tf.GradientTape(watch_accessed_variables=False) as tape:
                    tape.watch(x_t + s_t + p_t + cs)
                    for variable in variables:
                        tape.watch(variable)
                    out, new, _ = step(x_t, s_t, cs)
                    out, new = masked(t_now, out, new, p_t, s_t)
                d_out = [tf.gather(g, t_now) + p
                         for g, p in zip(d_outs, d_prev)]
                sources = x_t + s_t + p_t + cs + variables
                grads = tape.gradient(
                    out + new, sources, output_gradients=d_out + d_states,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
                g_x = grads[:n_in]
                g_s = grads[n_in:n_in + n_st]
                g_p = grads[n_in + n_st:n_in + n_st + len(p_t)]
                rest = grads[n_in + n_st + len(p_t):]
                g_c, g_v = rest[:len(cs)], rest[len(cs):]
                d_xs = [_written(b, t_now, g) for b, g in zip(d_xs, g_x)]
                d_cs = [a + g for a, g in zip(d_cs, g_c)]
                d_vars = [a + g for a, g in zip(d_vars, g_v)]
                if not keep_previous:
                    g_p = [tf.zeros_like(p) for p in d_prev]
                return (t + 1, list(g_s), list(g_p), d_xs, d_cs, d_vars,
                        [c + 1 for c in spare])

            for cell, name, value in dropout_masks:
                setattr(cell, name, value)
            try:
                start = (
                    tf.constant(0), d_last, d_last_out,
                    [tf.zeros_like(x) for x in xs],
                    [tf.zeros_like(c) for c in cs],
                    [tf.zeros_like(v) for v in variables],
                    _spare_carries(),
                )
                _, d_s0, _, d_xs, d_cs, d_vars, _ = tf.while_loop(
                    lambda t, *_: t < steps, back, start,
                    maximum_iterations=steps,
                    name=_unique_name("rnn_loop_grad"),
                )
            finally:
                for cell, name, value in restored:
                    setattr(cell, name, value)
            d_args = list(d_xs) + list(d_s0) + list(d_cs)
            if not variables:  # TensorFlow asks for weights' gradients
                return d_args  # only when the loop read weights
            return d_args, list(d_vars)

        return list(outs) + list(last_states) + list(last_out), grad

    results = loop(*flat_inputs, *flat_states, *tree.flatten(constants),
                   *weight_values)
    outs = results[:n_out]
    last_states = results[n_out:n_out + n_st]
    # The last step's output as the loop carries it, not a slice of
    # `outs`: a slice's gradient (a scatter into all steps) made DTensor
    # fail on a consumer that wants it replicated ("operand #0 does not
    # dominate this use").
    last_output = results[n_out + n_st:]
    if not return_all_outputs:
        outs = [tf.expand_dims(o, 0) for o in last_output]
    if not time_major:
        outs = [_swap(o) for o in outs]
    return (tree.pack_sequence_as(output_structure, list(last_output)),
            tree.pack_sequence_as(output_structure, list(outs)),
            tree.pack_sequence_as(state_structure, list(last_states)))


def _unique_name(prefix: str) -> str:
    """A loop name no other traced function has.

    Why: DTensor names the functions it outlines from a loop after the
    loop's node ("while_cond") and adds them to the eager context, where
    another function's loop of the same name but other contents is an
    error ("Cannot add function 'while_cond' because a different
    function with the same name already exists"): two masked LSTM
    models in one process met it.
    """
    return f"{prefix}_{ops.uid()}"


def _stored(weight: Any) -> Any:
    """A Keras weight's value in the step, in its own dtype (not cast to
    a mixed-precision compute dtype: the step casts it on reading)."""
    with AutocastScope(None):
        return tf.convert_to_tensor(weight.value)


def _swap(value: Any) -> Any:
    """Batch and time dims swapped."""
    axes = list(range(value.shape.rank))
    axes[0], axes[1] = 1, 0
    return tf.transpose(value, axes)


def _tiled(keep: Any, value: Any) -> Any:
    """A (batch, 1) step mask broadcast to `value`'s shape, as Keras's
    loop does (`tf.where` wants equal shapes)."""
    for _ in range(value.shape.rank - keep.shape.rank):
        keep = tf.expand_dims(keep, -1)
    multiples = [1] * keep.shape.rank
    for axis in range(1, value.shape.rank):
        if keep.shape[axis] == 1:
            multiples[axis] = value.shape[axis]
    return tf.tile(keep, multiples)


def _buffer(steps: int, value: Any) -> Any:
    """Zeros for `steps` values shaped like `value`."""
    return tf.zeros([steps] + value.shape.as_list(), value.dtype)


def _written(buffer: Any, t: Any, value: Any) -> Any:
    """`buffer` with `value` at step `t` (no strided slice adding an axis:
    DTensor crashes on one inside a loop)."""
    return tf.tensor_scatter_nd_update(
        buffer, tf.reshape(t, [1, 1]), tf.expand_dims(value, 0)
    )


def _zero_if_none(gradient: Any, like: Any) -> Any:
    return tf.zeros_like(like) if gradient is None else gradient
