"""Per-layer-type FLOPs (and, from `capabilities`, which dims may split).

`describe()` is the one entry point; `graph.py` calls it for each layer
call. A layer type without a rule is an opaque op: estimated FLOPs and
sample-dim partitioning only, never an error.

Counting convention (`flops_exact=True` means exact under these rules):

- Whole batch, one training step; a multiply-add is 2 FLOPs, any other
  add, multiply, compare, divide, exp or select is 1.
- Backward = gradient w.r.t. the inputs (always counted, even for the
  first op, whose input gradient TensorFlow may skip) + gradients w.r.t.
  the weights. A matmul-like op (Dense, Conv, attention, RNN gates) costs
  twice its forward matmul FLOPs backward; a bias adds 1 FLOP per output
  element forward (the add) and backward (the accumulation).
- Convolutions count every kernel tap, padded ones included (the kernel
  computes them). Pooling counts only window elements inside the input
  (TensorFlow skips padding): max = window - 1 compares per output,
  average = window adds + divide; backward max = 1 per output (scatter
  to the argmax), average = 1 per window element + 1 per output.
- Activations: 1 FLOP per element forward and 1 backward (the multiply
  by the local derivative), whatever the function; `linear` is free.
  Softmax (also as an activation) is 5 per element forward (max, subtract,
  exp, sum, divide) and 4 backward.
- BatchNormalization / LayerNormalization, training mode: 6 per element
  forward (mean 1, variance 3, normalize 2), +1 for `scale`, +1 for
  `center`; 7 per element backward through the statistics, +2 for the
  gamma gradient, +1 for the beta gradient. RMS scaling: 3 forward, 5
  backward. O(channels) terms (rsqrt, moving averages) are not counted.
- Elementwise ops: 1 per output element per binary operation forward;
  backward per element per tensor input: add 0, subtract 0/1 (negate the
  second), multiply 1, divide 1/3, maximum/minimum 1 (select). Sums over
  broadcast dims in backward are not counted.
- Dropout with rate > 0: 2 per element forward (mask, scale), 1 backward.
  Embedding: 0 forward (a gather), 1 per output element backward (the
  scatter-add). Reshape, Flatten, Concatenate, padding: 0.
- Attention: the five projections as Dense, query scaling 1 per query
  element, scores and weighted sum as matmuls, softmax as above. Masks
  are not counted.
- RNN cells per step and sample: the gate matmuls as Dense, plus 13U
  (LSTM) / 11U (GRU) / 2U (SimpleRNN) gate arithmetic in each direction.

Which dims a strategy may split is DTensor's fact, not a cost: it lives in
`capabilities.py`, and `describe` adds it to the FLOPs.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from flexflow_keras import capabilities
from flexflow_keras.capabilities import LayerCall as _Call
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
from flexflow_keras.op_specs_sequence import RNN_TYPES, attention, rnn
NORM_FLOPS = (6, 7)  # statistics + normalize; scale/center extra
RMS_NORM_FLOPS = (3, 5)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """What one layer call costs and how it may be split.

    Args:
        forward_flops: Forward FLOPs over the whole batch.
        backward_flops: Backward FLOPs over the whole batch.
        flops_exact: False for estimates.
        partitionable: Output dim -> SOAP kind.
        weight_shard_axes: Variable path -> axis split by a parameter
            partition (absent or None: replicated).
    """

    forward_flops: float
    backward_flops: float
    flops_exact: bool
    partitionable: Mapping[int, str]
    weight_shard_axes: Mapping[str, int | None] = dataclasses.field(
        default_factory=dict
    )


def describe(
    layer: Any,
    input_shapes: Shapes,
    output_shapes: Shapes,
    arguments: Any = None,
) -> OpSpec:
    """FLOPs and partitionable dims (`capabilities.splits`) of one call
    of `layer`.

    Args:
        layer: The Keras layer or operation.
        input_shapes: Static shapes of its tensor inputs (batch filled in),
            in the order of `arguments.keras_tensors`.
        output_shapes: Static shapes of its outputs.
        arguments: The call's Keras `SymbolicArguments`, or None; rules
            that must tell inputs apart (attention, binary ops) use it.

    Returns:
        An `OpSpec`. Unknown types get an estimated FLOP count.
    """
    input_shapes = tuple(tuple(s) for s in input_shapes)
    output_shapes = tuple(tuple(s) for s in output_shapes)
    rule = _RULES.get(type(layer).__name__, _opaque)
    forward, backward, exact = rule(
        _Call(layer, input_shapes, output_shapes, arguments)
    )
    kinds, axes = capabilities.splits(
        layer, input_shapes, output_shapes, arguments
    )
    return OpSpec(float(forward), float(backward), exact, kinds, axes)


def part_flops(
    op: Any, ins: Shapes, out: Shape
) -> tuple[float, float] | None:
    """(forward, backward) FLOPs of one part of `op` that reads `ins`
    and writes `out`, for ops whose parts read some input whole
    (`capabilities.FIRST_INPUT`: attention's key and value under a
    sequence split, whose projections every part computes in full);
    None for the rest, whose parts share the whole's FLOPs evenly.
    The op's own rule, on the part's shapes."""
    if capabilities.of_type(op.type).inputs != capabilities.FIRST_INPUT:
        return None
    rule = _RULES.get(op.type)
    if rule is None or op.layer is None:
        return None
    forward, backward, _ = rule(_Call(op.layer, tuple(ins), (tuple(out),),
                                      op.arguments))
    return float(forward), float(backward)


def _opaque(call: _Call) -> Flops:
    """Estimate: 2 FLOPs per weight per sample, or 1 per output element."""
    layer, ins, outs, arguments = call
    batch = outs[0][0] if outs and outs[0] else 1
    params = sum(math.prod(v.shape) for v in getattr(layer, "weights", ()))
    forward = 2.0 * params * batch
    forward += sum(math.prod(s) for s in outs)
    return forward, 2.0 * forward, False


def _dense(call: _Call) -> Flops:
    layer, ins, outs, arguments = call
    out = outs[0]
    n = math.prod(out)
    matmul = 2 * n * ins[0][-1]
    bias = n if layer.use_bias else 0
    act_fwd, act_bwd = _activation_flops(layer.activation)
    return _spec(
        matmul + bias + act_fwd * n, 2 * matmul + bias + act_bwd * n
    )


def _conv(call: _Call) -> Flops:
    """Conv1D/2D/3D; strides, padding and dilation act via the output."""
    layer, ins, outs, arguments = call
    out, x = outs[0], ins[0]
    channels_last = layer.data_format == "channels_last"
    groups = getattr(layer, "groups", 1)
    if type(layer).__name__.startswith("Depthwise"):
        taps = math.prod(layer.kernel_size)
    else:
        in_channels = x[-1] if channels_last else x[1]
        taps = math.prod(layer.kernel_size) * (in_channels // groups)
    n = math.prod(out)
    matmul = 2 * n * taps
    bias = n if layer.use_bias else 0
    act_fwd, act_bwd = _activation_flops(layer.activation)
    return _spec(
        matmul + bias + act_fwd * n, 2 * matmul + bias + act_bwd * n
    )


def _window_elements(
    size: int, out: int, pool: int, stride: int, padding: str
) -> int:
    """Sum over output positions of the window elements inside the input."""
    if padding == "valid":
        return out * pool
    pad = max((out - 1) * stride + pool - size, 0) // 2  # TF "same"
    return sum(
        min(i * stride - pad + pool, size) - max(i * stride - pad, 0)
        for i in range(out)
    )


def _pool_flops(is_max: bool, window: int, outputs: int) -> tuple[int, int]:
    if is_max:
        return window - outputs, outputs
    return window, window + outputs


def _pooling(call: _Call) -> Flops:
    layer, ins, outs, arguments = call
    x, out = ins[0], outs[0]
    channels_last = layer.data_format == "channels_last"
    spatial = slice(1, -1) if channels_last else slice(2, None)
    channels = x[-1] if channels_last else x[1]
    window = x[0] * channels
    for size, o, k, s in zip(
        x[spatial], out[spatial], layer.pool_size, layer.strides
    ):
        window *= _window_elements(size, o, k, s, layer.padding)
    fwd, bwd = _pool_flops(
        type(layer).__name__.startswith("Max"), window, math.prod(out)
    )
    return _spec(fwd, bwd)


def _global_pooling(call: _Call) -> Flops:
    layer, ins, outs, arguments = call
    outputs = math.prod(outs[0])
    fwd, bwd = _pool_flops(
        "Max" in type(layer).__name__, math.prod(ins[0]), outputs
    )
    return _spec(fwd, bwd)


def _norm_flops(
    n: int, rms: bool, scale: bool, center: bool
) -> tuple[int, int]:
    fwd, bwd = RMS_NORM_FLOPS if rms else NORM_FLOPS
    return n * (fwd + scale + center), n * (bwd + 2 * scale + center)


def _batch_norm(call: _Call) -> Flops:
    layer, ins, outs, arguments = call
    out = outs[0]
    fwd, bwd = _norm_flops(
        math.prod(out), False, bool(layer.scale), bool(layer.center)
    )
    return _spec(fwd, bwd)


def _layer_norm(call: _Call) -> Flops:
    layer, ins, outs, arguments = call
    fwd, bwd = _norm_flops(
        math.prod(outs[0]),
        bool(getattr(layer, "rms_scaling", False)),
        getattr(layer, "gamma", None) is not None,
        getattr(layer, "beta", None) is not None,
    )
    return _spec(fwd, bwd)


def _embedding(call: _Call) -> Flops:
    return _spec(0, math.prod(call.outs[0]))


def _is_layer(op: Any) -> bool:
    from keras.src.layers.layer import Layer

    return isinstance(op, Layer)


# Backward FLOPs per element for each input position of a binary op.
_BINARY_BACKWARD = {
    "Add": (0, 0),
    "Subtract": (0, 1),
    "Multiply": (1, 1),
    "Divide": (1, 3),
    "TrueDivide": (1, 3),
    "Maximum": (1, 1),
    "Minimum": (1, 1),
}


def _tensor_positions(arguments: Any, num_inputs: int) -> list[int]:
    """Which of the two operands of a binary op are tensors."""
    if arguments is None:
        return list(range(min(num_inputs, 2)))
    from keras.src.backend import KerasTensor

    operands = [_call_arg(arguments, i, f"x{i + 1}") for i in range(2)]
    return [i for i, a in enumerate(operands) if isinstance(a, KerasTensor)]


def _merge(call: _Call) -> Flops:
    """Merge layers over k inputs, and the same-named binary `keras.ops`."""
    layer, ins, outs, arguments = call
    kind = type(layer).__name__
    n = math.prod(outs[0])
    if not _is_layer(layer):
        if kind not in _BINARY_BACKWARD:  # ops.average is a reduction
            return _opaque(call)
        bwd = sum(
            _BINARY_BACKWARD[kind][i]
            for i in _tensor_positions(arguments, len(ins))
        )
        return _spec(n, bwd * n)
    k = len(ins)
    fwd = {"Average": k}.get(kind, k - 1)
    bwd = {"Add": 0, "Subtract": 1, "Multiply": k * (k - 1)}.get(kind, k)
    return _spec(fwd * n, bwd * n)


def _softmax(call: _Call) -> Flops:
    layer, ins, outs, arguments = call
    n = math.prod(outs[0])
    fwd, bwd = SOFTMAX_FLOPS
    return _spec(fwd * n, bwd * n)


def _activation(call: _Call) -> Flops:
    """Activation layers and unary `keras.ops`: elementwise."""
    layer, ins, outs, arguments = call
    out = outs[0]
    n = math.prod(out)
    fn = getattr(layer, "activation", None)
    fwd, bwd = _activation_flops(fn) if fn is not None else (1, 1)
    return _spec(fwd * n, bwd * n)


def _dropout(call: _Call) -> Flops:
    layer, ins, outs, arguments = call
    n = math.prod(outs[0])
    fwd, bwd = DROPOUT_FLOPS if layer.rate > 0 else (0, 0)
    return _spec(fwd * n, bwd * n)


def _data_movement(call: _Call) -> Flops:
    """Reshape, Flatten, padding, cropping, concatenation: no
    arithmetic."""
    layer, ins, outs, arguments = call
    return _spec(0, 0)


def _matmul(call: _Call) -> Flops:
    """`keras.ops.matmul` of two tensors of rank >= 2."""
    layer, ins, outs, arguments = call
    if len(ins) != 2 or min(len(s) for s in ins) < 2:
        return _opaque(call)
    macs = math.prod(outs[0]) * ins[0][-1]
    return _spec(2 * macs, 4 * macs)


def _rules() -> dict[str, Callable[[_Call], Flops]]:
    rules: dict[str, Callable[[_Call], Flops]] = {
        "Dense": _dense,
        "BatchNormalization": _batch_norm,
        "LayerNormalization": _layer_norm,
        "Embedding": _embedding,
        "MultiHeadAttention": attention,
        "Softmax": _softmax,
        "LogSoftmax": _softmax,
        "Dropout": _dropout,
        "Concatenate": _data_movement,
        "Matmul": _matmul,
    }
    for n in "123":
        rules[f"Conv{n}D"] = _conv
        rules[f"DepthwiseConv{n}D"] = _conv
        for mode in ("Max", "Average"):
            rules[f"{mode}Pooling{n}D"] = _pooling
            rules[f"Global{mode}Pooling{n}D"] = _global_pooling
        rules[f"ZeroPadding{n}D"] = _data_movement
        rules[f"Cropping{n}D"] = _data_movement
    for name in RNN_TYPES:
        rules[name] = rnn
    for name in (*_BINARY_BACKWARD, "Average"):
        rules[name] = _merge
    for name in (
        "Activation ReLU LeakyReLU ELU Relu Relu6 Sigmoid Tanh Exp Log "
        "Sqrt Square Abs Absolute Negative Gelu Silu Softplus Softsign "
        "Elu Selu LeakyRelu HardSigmoid HardSilu"
    ).split():
        rules[name] = _activation
    for name in (
        "Reshape Flatten Permute RepeatVector Identity ExpandDims Squeeze "
        "GetItem Cast"
    ).split():
        rules[name] = _data_movement
    return rules


_RULES = _rules()
