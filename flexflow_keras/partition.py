"""Geometry of a partitioned op: part rectangles, input regions, shards.

Part `i` of an op's output is the `i`-th block, row-major over
`ParallelConfig.dims` (last dim fastest). What a part reads of each input
is what the DTensor runtime gives it (`split_input_dims`, which the
runtime's input layouts use too): an input dim split like the same
output dim where the op then runs on its slice alone, every other input
dim whole (e.g. Dense reads all input features for any unit shard).
Used by the cost model (shard shapes) and the simulator (transfers).
"""

import math

import numpy as np

from flexflow_keras import capabilities
from flexflow_keras.graph import ATTRIBUTE, PARAMETER, SAMPLE, Op
from flexflow_keras.strategy import ParallelConfig

Rect = tuple[tuple[int, int], ...]  # (lo, hi) per dim, hi exclusive


def part_rects(shape: tuple[int, ...], dims: tuple[int, ...]) -> list[Rect]:
    """Rectangles of the parts of `shape` split by `dims`, row-major.

    A rank-0 shape has one part, the empty rectangle.
    """
    if not shape:
        return [()] * math.prod(dims)
    axes = [
        [(k * n // d, (k + 1) * n // d) for k in range(d)]
        for n, d in zip(shape, dims)
    ]
    rects: list[Rect] = [()]
    for ranges in axes:
        rects = [r + (x,) for r in rects for x in ranges]
    return rects


def rect_size(rect: Rect) -> int:
    return math.prod(hi - lo for lo, hi in rect)


def intersect(a: Rect, b: Rect) -> Rect | None:
    """The intersection of two rectangles, None when empty."""
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b):
        lo, hi = max(alo, blo), min(ahi, bhi)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def split_input_dims(
    op: Op, index: int, in_shape: tuple[int, ...]
) -> frozenset[int]:
    """Dims of input `index` split like the same output dim.

    Where the op computes its output slice from the input's matching
    slice with no communication: the sample dim; an attribute dim of
    equal size and position (not MultiHeadAttention's key/value); a
    per-channel op's channel dim (`capabilities.Capability.inputs`). The
    runtime lays inputs out so, and the simulator moves and costs exactly
    that.
    """
    out = op.output_shape
    follows = capabilities.of_type(op.type).inputs
    leading = follows == capabilities.FIRST_INPUT and (
        index == capabilities.first_input(op)
    )
    split = set()
    for d, n in enumerate(in_shape):
        if d >= len(out) or n != out[d]:
            continue
        kind = op.partitionable.get(d)
        if kind == SAMPLE and d == 0:
            ok = True
        elif kind == PARAMETER:
            ok = follows == capabilities.CHANNELWISE and len(in_shape) == len(
                out
            )
        elif kind == ATTRIBUTE:
            ok = (leading or follows != capabilities.FIRST_INPUT) and (
                len(in_shape) == len(out) or follows == capabilities.PREFIX
            )
        else:
            ok = False
        if ok:
            split.add(d)
    return frozenset(split)


def input_region(op: Op, index: int, out_rect: Rect) -> Rect:
    """The part of input `index` that the output part `out_rect` reads."""
    in_shape = op.input_shapes[index]
    split = split_input_dims(op, index, in_shape)
    return tuple(
        out_rect[d] if d in split else (0, n) for d, n in enumerate(in_shape)
    )


def tensor_rects(
    op: Op, output: int, dims: tuple[int, ...]
) -> list[Rect | None]:
    """What each part of `op` holds of its output `output` when its
    config splits it `dims`.

    Output 0 is split by `dims`. Another output of the same rank is split
    alike (scaled); one of another rank is held whole by part 0.
    """
    shape = op.output_shapes[output]
    if output == 0:
        return part_rects(shape, dims)
    base = op.output_shape
    if len(shape) != len(base):
        full = tuple((0, n) for n in shape)
        return [full] + [None] * (math.prod(dims) - 1)
    return [
        tuple(
            (lo * n // m, max(-(-hi * n // m), lo * n // m + 1))
            for (lo, hi), n, m in zip(r, shape, base)
        )
        for r in part_rects(base, dims)
    ]


def parameter_degree(op: Op, config: ParallelConfig) -> int:
    """Parts along the parameter dim: how many weight shards there are."""
    dim = op.parameter_dim
    if dim is None or dim >= len(config.dims):
        return 1
    return config.dims[dim]


def shard_coords(op: Op, config: ParallelConfig) -> list[int]:
    """Per part, the index of the weight shard it holds."""
    degree = parameter_degree(op, config)
    if degree == 1:
        return [0] * config.num_parts
    coords = np.unravel_index(np.arange(config.num_parts), config.dims)
    return [int(c) for c in coords[op.parameter_dim]]


def weight_split(op: Op, degree: int) -> tuple[float, float]:
    """(sharded, replicated) trainable bytes per part at a shard degree.

    Sharded bytes are per shard, i.e. already divided by `degree`.
    """
    sharded = replicated = 0.0
    for w in op.weights:
        if not w.trainable:
            continue
        if degree > 1 and w.shard_axis is not None:
            sharded += w.num_bytes / degree
        else:
            replicated += w.num_bytes
    return sharded, replicated


def frozen_weight_bytes(op: Op, degree: int) -> float:
    """Non-trainable bytes one part holds (no gradient, no slots)."""
    total = 0.0
    for w in op.weights:
        if w.trainable:
            continue
        split = degree > 1 and w.shard_axis is not None
        total += w.num_bytes / degree if split else w.num_bytes
    return total
