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
arithmetic as Keras's rolled loop, in the same order, but for the
weights' gradients, which come from one call over all steps after that
loop (`weight_gradients`: summed in another order, equal within float
rounding). Each loop iteration runs a block of up to 8 steps
(`_block_size`).

Measured on keras.io's IMDB Bidirectional LSTM (200 steps, batch 32),
data parallel over 2 virtual CPUs, steady step time and first step, two
runs each (`bench/rnn_loop_bench.py`'s model): one step an
iteration, weights' gradients in the loop: 505-613 ms, 3.6-4.6 s; blocks
of 8, in the loop: 390-407 ms, 8.7-9.0 s; blocks of 8, after the loop:
268-279 ms, 8.6-8.7 s; one step an iteration, after the loop: 689-728
ms (three more buffers written each step). Plain Keras on one device:
about 120 ms.

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
from tensorflow.python.eager import context, record
from tensorflow.python.framework import ops
from tensorflow.python.ops import array_ops
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


# Counters each loop carries beyond its own; `vary` adds one, up to
# MAX_NAME_CLASHES - 1, then starts again from none.
_SPARE_CARRIES = [0]


def vary() -> None:
    """Loops traced from now on carry one counter more, or none after
    MAX_NAME_CLASHES - 1.

    Why: a loop's node gets the name of an earlier expansion's loop when
    it lands at the address that loop had (`name_clash`), and traced
    again with the same carries it tends to land there again (measured:
    the same name refused 8 times in a row). A loop with one carry more
    is an op of another size, allocated elsewhere. The count cycles so
    that the redos of one step (`RedoneOnNameClash`, at most
    MAX_NAME_CLASHES) each get a size of their own, while a process that
    builds many steps does not trace ever wider loops: every step
    function built varies once, and a count that only grew reached 223
    after three of the test suite's files, where an RNN test then took
    38 s against 16 s in a fresh process.
    """
    _SPARE_CARRIES[0] = (_SPARE_CARRIES[0] + 1) % MAX_NAME_CLASHES


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
    while DTensor refuses a call for a loop function's name
    (`name_clash`), at most `MAX_NAME_CLASHES` times a call: the refusal
    comes before anything runs. Each redo's loops carry one counter more
    (`vary`): redone unchanged, a loop tends to land where it was and be
    refused under the same name again.

    The one place a refused first call is redone: both executors' step
    functions and `realized.record`'s recording step are made through
    it. `redos` counts the calls redone. Each is varied before its first
    trace too: the test step traced after the train step was refused
    twice in each of 3 runs of `examples/bidirectional_lstm.py`, and
    not at all once varied first.
    """

    def __init__(self, make: Any):
        self._make = make
        vary()  # loops of a size no earlier expansion's had
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
                # Later calls too: DTensor expands a function again when
                # its cache misses it, and that expansion can be refused
                # the same way (keras.io's IMDB LSTM: the last partial
                # batch's backward of epoch 1, expanded again in epoch 2,
                # refused for 'rnn_loop_grad_9198_cond'; redone only at
                # the step level, by unrolling every loop, each later
                # trace took 7-24 s). Nothing ran then either.
                if not name_clash(error) or attempt == MAX_NAME_CLASHES:
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
    # The inputs whose gradient some tape will use: one that no open
    # tape watches (an input computed from the batch alone, by layers
    # without weights: a one-hot encoding of token ids) gets none, and
    # the backward loop neither computes nor stores it.
    need_input_grads = [record.should_record_backprop([x])
                        for x in flat_inputs]
    n_dx = sum(need_input_grads)

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
        return kept(tf.gather(mask, t), flat_out, flat_new, flat_prev,
                    flat_s)

    def kept(keep, flat_out, flat_new, flat_prev, flat_s):
        """Outputs and states where `keep` (rows, 1) holds, the previous
        output (or zeros) and states where it does not."""
        fill = flat_prev if keep_previous else [
            tf.zeros_like(o) for o in flat_out
        ]
        return ([tf.where(_tiled(keep, o), o, f)
                 for o, f in zip(flat_out, fill)],
                [tf.where(_tiled(keep, n), n, s)
                 for n, s in zip(flat_new, flat_s)])

    # Steps run `block` at a time in each loop iteration, and each
    # iteration writes its block into the buffers at once (`_blocks`):
    # a write copies its whole buffer, so writing each step costs time
    # in the square of the sequence's length. The steps past the last
    # whole block run outside the loop.
    block = _block_size(steps)
    blocks = steps // block
    rest = range(blocks * block, steps)

    def forward(ts, prev, states, xs, cs):
        """Steps `ts`, in order, from `prev` and `states`: the last
        output and states, and per step its output, the states it
        started from and the output before it."""
        outs, started, before = [], [], []
        for t in ts:
            started.append(states)
            before.append(prev)
            out, new, _ = step([tf.gather(x, t) for x in xs], states, cs)
            prev, states = masked(t, out, new, prev, states)
            outs.append(prev)
        return prev, states, outs, started, before

    @tf.custom_gradient
    def loop(*args):
        xs = list(args[:n_in])
        s0 = list(args[n_in:n_in + n_st])
        cs = list(args[n_in + n_st:])
        zero_out = [tf.zeros_like(o) for o in first_output]

        def body(b, prev, states, outs, kept_states, kept_prev, spare):
            ts = [b * block + k for k in range(block)]
            prev, states, o, st, pr = forward(ts, prev, states, xs, cs)
            outs = _blocks_written(outs, b, o)
            kept_states = _blocks_written(kept_states, b, st)
            if keep_previous:
                kept_prev = _blocks_written(kept_prev, b, pr)
            return (b + 1, prev, states, outs, kept_states, kept_prev,
                    [c + 1 for c in spare])

        start = (
            tf.constant(0), zero_out, s0,
            [_blocks(blocks, block, o) for o in first_output],
            [_blocks(blocks, block, s) for s in s0],
            [_blocks(blocks, block, o) for o in first_output]
            if keep_previous else [],
            _spare_carries(),
        )
        ended = tf.while_loop(
            lambda b, *_: b < blocks, body, start,
            maximum_iterations=blocks, name=_unique_name("rnn_loop"),
        )
        _, last_out, last_states, outs, kept_states, kept_prev, _ = ended
        last_out, last_states, o, st, pr = forward(
            rest, last_out, last_states, xs, cs)
        outs = _joined(outs, o)
        kept_states = _joined(kept_states, st)
        kept_prev = _joined(kept_prev, pr) if keep_previous else []

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
            # The weights' gradients come after the loop, from all steps
            # at once (`weight_gradients`), unless the cells take
            # constants (not Keras's own: their rows need not be the
            # batch's).
            weights_after = n_const == 0
            in_loop = [] if weights_after else cs

            def backward(ts, d_states, d_prev, d_cs, d_vars):
                """Steps `ts`, last first, from the gradients of the
                last one's states and output: the first one's, the
                sums over the steps of the constants' and variables',
                and per step (in `ts`'s order) its inputs' gradients,
                then (`weights_after`) the gradients its outputs and
                new states got."""
                d_x = []  # last step first
                for t_now in reversed(ts):
                    x_t = [tf.gather(x, t_now) for x in xs]
                    s_t = [tf.gather(b, t_now) for b in kept_states]
                    p_t = ([tf.gather(b, t_now) for b in kept_prev]
                           if keep_previous else [])
                    x_needed = [x for x, need in zip(x_t, need_input_grads)
                                if need]
                    with tf.GradientTape(
                            watch_accessed_variables=False) as tape:
                        tape.watch(x_needed + s_t + p_t + in_loop)
                        for variable in variables:
                            tape.watch(variable)
                        out, new, _ = step(x_t, s_t, cs)
                        out, new = masked(t_now, out, new, p_t, s_t)
                    d_out = [tf.gather(g, t_now) + p
                             for g, p in zip(d_outs, d_prev)]
                    sources = x_needed + s_t + p_t + in_loop + variables
                    grads = tape.gradient(
                        out + new, sources,
                        output_gradients=d_out + d_states,
                        unconnected_gradients=tf.UnconnectedGradients.ZERO,
                    )
                    d_x.append(list(grads[:n_dx]) + (
                        d_out + d_states if weights_after else []))
                    d_states = list(grads[n_dx:n_dx + n_st])
                    g_p = grads[n_dx + n_st:n_dx + n_st + len(p_t)]
                    others = grads[n_dx + n_st + len(p_t):]
                    g_c = others[:len(in_loop)]
                    g_v = others[len(in_loop):]
                    d_cs = [a + g for a, g in zip(d_cs, g_c)]
                    d_vars = [a + g for a, g in zip(d_vars, g_v)]
                    d_prev = (list(g_p) if keep_previous
                              else [tf.zeros_like(p) for p in d_prev])
                return d_states, d_prev, d_cs, d_vars, d_x[::-1]

            def back(b, d_states, d_prev, d_xs, d_cs, d_vars, spare):
                i = blocks - 1 - b
                d_states, d_prev, d_cs, d_vars, d_x = backward(
                    [i * block + k for k in range(block)],
                    d_states, d_prev, d_cs, d_vars)
                d_xs = _blocks_written(d_xs, i, d_x)
                return (b + 1, d_states, d_prev, d_xs, d_cs, d_vars,
                        [c + 1 for c in spare])

            for cell, name, value in dropout_masks:
                setattr(cell, name, value)
            try:
                d_states, d_prev, d_cs, d_vars, d_rest = backward(
                    rest, d_last, d_last_out,
                    [tf.zeros_like(c) for c in in_loop],
                    [tf.zeros_like(v) for v in variables])
                start = (
                    tf.constant(0), d_states, d_prev,
                    [_blocks(blocks, block, x[0])
                     for x, need in zip(xs, need_input_grads) if need] + (
                        [_blocks(blocks, block, o) for o in first_output]
                        + [_blocks(blocks, block, s) for s in s0]
                        if weights_after else []),
                    d_cs, d_vars, _spare_carries(),
                )
                _, d_s0, _, d_xs, d_cs, d_vars, _ = tf.while_loop(
                    lambda b, *_: b < blocks, back, start,
                    maximum_iterations=blocks,
                    name=_unique_name("rnn_loop_grad"),
                )
                recorded = _joined(d_xs, d_rest)
                if weights_after:
                    d_cs = weight_gradients(recorded[n_dx:])
            finally:
                for cell, name, value in restored:
                    setattr(cell, name, value)
            d_inputs = iter(recorded[:n_dx])
            d_args = [next(d_inputs) if need else None
                      for need in need_input_grads]
            d_args += list(d_s0) + list(d_cs)
            if not variables:  # TensorFlow asks for weights' gradients
                return d_args  # only when the loop read weights
            return d_args, list(d_vars)

        def weight_gradients(received: list) -> list:
            """The weights' gradients over all steps, from one call of
            the step on every (batch row, step) as a row, each with the
            gradients its outputs and new states `received` in the
            backward loop (time-major, as the loop's buffers).

            Why: summed in the backward loop, each step's gradient of a
            weight is reduced over the batch's devices where it is
            computed, 200 times in a 200-step sequence: on 2 virtual
            CPUs, keras.io's IMDB Bidirectional LSTM ran 390-407 ms a
            step so, against 268-279 ms this way (blocks of 8, the
            module docstring's runs). A cell's
            rows are independent (Keras's cells: a matmul, gates, their
            dropout masks per row), so the sum over rows and steps is
            the gradient of one call over them all, reduced once."""
            rows = [_rows(v) for v in xs + kept_states + kept_prev
                    + received]
            x_all = rows[:n_in]
            s_all = rows[n_in:n_in + n_st]
            p_all = rows[n_in + n_st:n_in + n_st + len(kept_prev)]
            cotangents = rows[n_in + n_st + len(kept_prev):]
            for cell, name, value in dropout_masks:
                setattr(cell, name, None if value is None
                        else tree.map_structure(
                            lambda v: _repeated(v, steps), value))
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(cs)
                out, new, _ = step(x_all, s_all, cs)
                if mask is not None:
                    out, new = kept(_rows(mask), out, new, p_all, s_all)
            return tape.gradient(
                out + new, cs, output_gradients=cotangents,
                unconnected_gradients=tf.UnconnectedGradients.ZERO)

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


# The most steps a loop iteration runs (`_block_size`).
MAX_BLOCK = 8


def _block_size(steps: int) -> int:
    """How many steps each loop iteration runs: a power of two, at most
    `MAX_BLOCK`, and at most an eighth of the steps (a short sequence
    keeps a loop of one step an iteration rather than running unrolled).

    Why: each iteration writes its steps into buffers of the whole
    sequence, and a write copies the buffer. Measured on 2 virtual CPUs
    (a 200-step tanh RNN of 64 units, batch 32): 13.8 ms a sequence at
    one step an iteration, 6.9 ms at 8, 4.9 ms without writes; the
    first call 0.24 s against 0.32 s. A block is that many steps'
    copies in the loop's body for DTensor to expand."""
    size = 1
    while size * 2 <= min(MAX_BLOCK, steps // 8):
        size *= 2
    return size


def _blocks(blocks: int, block: int, value: Any) -> Any:
    """Zeros for `blocks` blocks of `block` values shaped like `value`."""
    return tf.zeros([blocks, block] + value.shape.as_list(), value.dtype)


def _blocks_written(buffers: list, b: Any, per_step: list) -> list:
    """Each buffer with block `b` written: `per_step[k][i]` is step k's
    value for buffer i."""
    # `array_ops.concat`, not `tf.concat`: these join time steps (axis 0
    # is time here), which `op_rules`' batch-axis rule must not relay.
    return [_written(buffer, b, array_ops.concat(
        [tf.expand_dims(values[i], 0) for values in per_step], 0))
        for i, buffer in enumerate(buffers)]


def _joined(buffers: list, per_step: list) -> list:
    """Each buffer's blocks as one sequence, then the steps past the
    last block (`per_step[k][i]`: step k's value for buffer i)."""
    joined = []
    for i, buffer in enumerate(buffers):
        shape = buffer.shape.as_list()
        parts = [tf.reshape(buffer, [shape[0] * shape[1]] + shape[2:])]
        parts += [tf.expand_dims(values[i], 0) for values in per_step]
        joined.append(array_ops.concat(parts, 0) if len(parts) > 1
                      else parts[0])
    return joined


def _written(buffer: Any, t: Any, value: Any) -> Any:
    """`buffer` with `value` at index `t` of its first dim (no strided
    slice adding an axis: DTensor crashes on one inside a loop)."""
    return tf.tensor_scatter_nd_update(
        buffer, tf.reshape(t, [1, 1]), tf.expand_dims(value, 0)
    )


def _rows(value: Any) -> Any:
    """A time-major (steps, batch, ...) value as (batch x steps, ...)
    rows: row b * steps + t is batch row b's step t (batch-major, so a
    batch split stays a split of the rows)."""
    shape = value.shape.as_list()
    return tf.reshape(_swap(value), [shape[0] * shape[1]] + shape[2:])


def _repeated(value: Any, steps: int) -> Any:
    """A (batch, ...) value repeated for each step, as `_rows` orders
    rows."""
    shape = value.shape.as_list()
    tiled = tf.tile(tf.expand_dims(value, 1),
                    [1, steps] + [1] * (len(shape) - 1))
    return tf.reshape(tiled, [shape[0] * steps] + shape[1:])


def _zero_if_none(gradient: Any, like: Any) -> Any:
    return tf.zeros_like(like) if gradient is None else gradient
