"""Per-layer-type facts: FLOPs and which output dims a strategy may split.

`describe()` is the one entry point; `graph.py` calls it for each layer
call. A layer type without a rule is an opaque op: estimated FLOPs and
sample-dim partitioning only, never an error.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from flexflow_keras.graph import PARAMETER, SAMPLE


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
    input_shapes: tuple[tuple[int, ...], ...],
    output_shapes: tuple[tuple[int, ...], ...],
    arguments: Any = None,
) -> OpSpec:
    rule = _RULES.get(type(layer).__name__, _opaque)
    return rule(layer, input_shapes, output_shapes)


def _num_params(layer: Any) -> int:
    return sum(math.prod(v.shape) for v in getattr(layer, "weights", ()))


def _opaque(layer, input_shapes, output_shapes) -> OpSpec:
    """Estimate: 2 FLOPs per weight per sample, or 1 per output element."""
    batch = output_shapes[0][0] if output_shapes[0] else 1
    params = _num_params(layer)
    forward = 2.0 * params * batch
    forward += sum(math.prod(s) for s in output_shapes)
    return OpSpec(forward, 2.0 * forward, False, {0: SAMPLE})


def _dense(layer, input_shapes, output_shapes) -> OpSpec:
    out = output_shapes[0]
    rows = math.prod(out[:-1])
    forward = 2.0 * rows * input_shapes[0][-1] * out[-1]
    if layer.use_bias:
        forward += rows * out[-1]
    axes = {layer.kernel.path: 1}
    if layer.use_bias:
        axes[layer.bias.path] = 0
    return OpSpec(
        forward, 2.0 * forward, True,
        {0: SAMPLE, len(out) - 1: PARAMETER}, axes,
    )


_RULES = {"Dense": _dense}
