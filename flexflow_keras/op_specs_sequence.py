"""FLOP rules of sequence layers: attention and RNNs.

Split from `op_specs` (whose docstring states the counting convention)
to keep each module one size; `op_specs` registers these rules. Both
build on `flop_counting`, so neither imports the other's names.
"""

import math
from typing import Any

from flexflow_keras.capabilities import LayerCall as _Call
from flexflow_keras.capabilities import argument_index
from flexflow_keras.flop_counting import (
    DROPOUT_FLOPS,
    SOFTMAX_FLOPS,
    Flops,
    Shape,
    Shapes,
)
from flexflow_keras.flop_counting import activation_flops as _activation_flops
from flexflow_keras.flop_counting import call_arg as _call_arg
from flexflow_keras.flop_counting import spec as _spec


def recurrent(layer: Any) -> bool:
    """Whether `layer` runs a recurrent loop (an RNN layer's `cell`, a
    `Bidirectional`'s `forward_layer`): the planning stages price it
    from two batches (`cost._is_recurrent`) and the runtime rolls or
    unrolls it (`runtime/unroll.py`)."""
    return hasattr(layer, "cell") or hasattr(layer, "forward_layer")


def _full_shape(kt: Any, batch: int) -> Shape:
    return (batch,) + tuple(kt.shape[1:])


def _argument_shape(
    arguments: Any, ins: Shapes, position: int, name: str, batch: int
) -> Shape | None:
    """The shape in `ins` of a call's tensor argument (by position or
    keyword, `capabilities.argument_index`); None when absent. From
    `ins`, which may be a part's (`op_specs.part_flops`); the tensor's
    own shape where `ins` do not line up with the call."""
    tensor = _call_arg(arguments, position, name)
    if tensor is None:
        return None
    index = argument_index(arguments, position, name)
    if index is not None and len(ins) == len(arguments.keras_tensors):
        return tuple(ins[index])
    return _full_shape(tensor, batch)


def _projection_flops(sublayer: Any, rows: int) -> tuple[int, int]:
    """Forward, backward FLOPs of an `EinsumDense` applied to `rows`.

    Its activation (the gate's sigmoid) is counted by the caller.
    """
    macs = rows * math.prod(sublayer.kernel.shape)
    bias = getattr(sublayer, "bias", None)
    bias_flops = rows * math.prod(bias.shape) if bias is not None else 0
    return 2 * macs + bias_flops, 4 * macs + bias_flops


def attention(call: _Call) -> Flops:
    """MultiHeadAttention; query, value, key told apart via `arguments`."""
    layer, ins, outs, arguments = call
    batch = outs[0][0]
    query = _call_arg(arguments, 0, "query")
    value = _call_arg(arguments, 1, "value")
    if query is not None and value is not None:
        # From `ins`, which may be a part's (`op_specs.part_flops`).
        q = _argument_shape(arguments, ins, 0, "query", batch)
        v = _argument_shape(arguments, ins, 1, "value", batch)
        k = _argument_shape(arguments, ins, 2, "key", batch) or v
    else:
        q = ins[0]
        v = ins[1] if len(ins) > 1 else q
        k = ins[2] if len(ins) > 2 else v
    heads = layer.num_heads
    q_rows, k_rows = math.prod(q[:-1]), math.prod(k[:-1])
    fwd = bwd = 0
    projections = [
        (layer.query_dense, q_rows),
        (layer.key_dense, k_rows),
        (layer.value_dense, k_rows),
        (layer.output_dense, q_rows),
    ]
    if getattr(layer, "_use_gate", False):
        projections.append((layer._gate_dense, q_rows))
    for sublayer, rows in projections:
        f, b = _projection_flops(sublayer, rows)
        fwd, bwd = fwd + f, bwd + b
    # Non-attention axes act like batch axes: same size in query and key.
    batch_like = math.prod(
        q[i] for i in range(1, len(q) - 1) if i not in layer._attention_axes
    )
    scores = heads * q_rows * (k_rows // batch // batch_like)
    key_dim, value_dim = layer.key_dim, layer.value_dim
    fwd += heads * q_rows * key_dim  # query * 1/sqrt(key_dim)
    bwd += heads * q_rows * key_dim
    fwd += 2 * scores * (key_dim + value_dim) + SOFTMAX_FLOPS[0] * scores
    bwd += 4 * scores * (key_dim + value_dim) + SOFTMAX_FLOPS[1] * scores
    if layer.dropout > 0:
        fwd += DROPOUT_FLOPS[0] * scores
        bwd += DROPOUT_FLOPS[1] * scores
    if getattr(layer, "_use_gate", False):
        gated = heads * q_rows * value_dim
        fwd += 2 * gated  # sigmoid, multiply
        bwd += 3 * gated  # sigmoid derivative, two multiply gradients
    return _spec(fwd, bwd)


_RNN_GATES = {"SimpleRNN": 1, "GRU": 3, "LSTM": 4}
_RNN_ELEMENTWISE = {"SimpleRNN": 2, "GRU": 11, "LSTM": 13}
RNN_TYPES = tuple(_RNN_GATES)


def rnn(call: _Call) -> Flops:
    """SimpleRNN / GRU / LSTM over a (batch, steps, features) input."""
    layer, ins, outs, arguments = call
    kind = type(layer).__name__
    x = ins[0]
    cell = layer.cell
    units = cell.units
    gates = _RNN_GATES[kind]
    macs = (x[-1] + units) * gates * units
    elementwise = _RNN_ELEMENTWISE[kind] * units
    bias = gates * units if cell.use_bias else 0
    if kind == "GRU" and cell.use_bias and cell.reset_after:
        bias *= 2  # separate input and recurrent biases
    if kind == "SimpleRNN" and _activation_flops(cell.activation)[0] == 0:
        elementwise -= units
    steps_samples = x[0] * x[1]
    fwd = steps_samples * (2 * macs + elementwise + bias)
    bwd = steps_samples * (4 * macs + elementwise + bias)
    return _spec(fwd, bwd)
