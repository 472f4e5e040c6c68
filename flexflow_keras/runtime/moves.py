"""Moves of a value between two device meshes, region by region.

The layer-by-layer executor (`step.py`) runs each run of ops on one mesh
as a function of its own; a tensor made on one mesh and read on another
crosses between them eagerly. FlexFlow moves such a tensor region by
region: each device of the consumer receives the part of the tensor it
reads, from the devices that hold it, and that is what the simulator
prices between meshes (`taskgraph.overlaps`). This module makes the same
move: it unpacks the producer's per-device parts, cuts from each the
piece a consumer device needs (on the device that holds it), copies the
pieces over and joins them there, and packs the consumer's parts.

Before (until 2026-11-29) the executor relaid the value out to replicated
on the producer's mesh (an all-gather), took one device's copy and packed
it onto every device of the consumer's mesh: 5.6 to 144 times the bytes
priced, on the saved strategies (`bench/cross_mesh_bench.py`).

The cuts and joins of one segment boundary run as one compiled function
(`_copy_function`). A regular tensor (a batch input, the loss's
gradient: outside the op graph the simulator prices) is packed whole
onto each device (`replicate`), and the function reading it slices it.

`copy_plan` is pure Python (no TensorFlow op), so the bench counts the
bytes the runtime moves from the same plan the runtime follows.

Where this process does not hold every device of both meshes (DTensor's
multi-client mode), a device cannot read another host's part eagerly:
the value goes through a replicated copy, as before.
"""

import dataclasses
import itertools
from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from flexflow_keras.runtime.layouts import UNSHARDED, replicated
from flexflow_keras.runtime.tracing import step_function


@dataclasses.dataclass(frozen=True)
class Grid:
    """How a layout cuts a tensor: per dim, the number of blocks, and per
    device (in `dtensor.unpack` order) its block index per dim."""

    shape: tuple[int, ...]
    cuts: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]

    def interval(self, block: tuple[int, ...], dim: int) -> tuple[int, int]:
        step = self.shape[dim] // self.cuts[dim]
        return block[dim] * step, (block[dim] + 1) * step

    def region(self, device: int) -> tuple[tuple[int, int], ...]:
        block = self.blocks[device]
        return tuple(self.interval(block, d) for d in range(len(self.shape)))


def grid_of(layout: Any, shape: Sequence[int]) -> Grid:
    """`layout`'s cut of a tensor of `shape`, for this process's devices
    of its mesh, in `dtensor.unpack` order."""
    mesh = layout.mesh
    sizes = mesh.shape()
    axes = [None if spec == UNSHARDED else mesh.dim_names.index(spec)
            for spec in layout.sharding_specs]
    cuts = tuple(1 if a is None else int(sizes[a]) for a in axes)
    blocks = []
    for device_id in mesh.local_device_ids():
        where = np.unravel_index(device_id, sizes)
        blocks.append(tuple(0 if a is None else int(where[a]) for a in axes))
    return Grid(tuple(int(s) for s in shape), cuts, tuple(blocks))


def whole(shape: Sequence[int]) -> Grid:
    """One part holding the whole tensor (a regular tensor)."""
    shape = tuple(int(s) for s in shape)
    return Grid(shape, (1,) * len(shape), ((0,) * len(shape),))


@dataclasses.dataclass(frozen=True)
class Piece:
    """One copy: `source` part's `[begin, end)`, in the tensor's
    coordinates (its place in the destination part follows from the
    order of its plan's pieces, `copy_plan`)."""

    source: int
    begin: tuple[int, ...]
    end: tuple[int, ...]

    @property
    def elements(self) -> int:
        return int(np.prod([e - b for b, e in zip(self.begin, self.end)]))


def copy_plan(src: Grid, dst: Grid,
              src_devices: Sequence[str],
              dst_devices: Sequence[str]) -> list[list[Piece]]:
    """Per destination part, the pieces that make it, in row-major order
    of their position (so joining them dim by dim rebuilds the part).

    A piece held by several source parts (a layout replicated over a mesh
    axis) is taken from the destination's own device where it holds it,
    else from the holders in turn, so no one device sends every copy.
    """
    if src.shape != dst.shape:
        raise ValueError(
            f"A move between meshes received a value of shape {src.shape} "
            f"for a layout of shape {dst.shape}; expected the same shape.")
    holders: dict[tuple, list[int]] = {}
    for part, block in enumerate(src.blocks):
        holders.setdefault(block, []).append(part)
    turn = dict.fromkeys(holders, 0)
    plan = []
    for part in range(len(dst.blocks)):
        region = dst.region(part)
        # Per dim, the source blocks the region crosses.
        per_dim = []
        for dim, (lo, hi) in enumerate(region):
            step = max(src.shape[dim] // src.cuts[dim], 1)  # 1: empty dim
            last = min(max(hi - 1, lo) // step, src.cuts[dim] - 1)
            per_dim.append(range(min(lo // step, last), last + 1))
        pieces = []
        for block in itertools.product(*per_dim):
            begin = tuple(max(lo, src.interval(block, d)[0])
                          for d, (lo, _) in enumerate(region))
            end = tuple(min(hi, src.interval(block, d)[1])
                        for d, (_, hi) in enumerate(region))
            owners = holders[block]
            here = [o for o in owners if src_devices[o] == dst_devices[part]]
            if here:
                source = here[0]
            else:
                source = owners[turn[block] % len(owners)]
                turn[block] += 1
            pieces.append(Piece(source, begin, end))
        plan.append(pieces)
    return plan


def moved_elements(plan: list[list[Piece]], src_devices: Sequence[str],
                   dst_devices: Sequence[str]) -> int:
    """Elements a plan copies from one device to another."""
    return sum(p.elements for part, pieces in enumerate(plan)
               for p in pieces if src_devices[p.source] != dst_devices[part])


def _all_local(mesh: Any) -> bool:
    return len(mesh.local_devices()) == mesh.size


def _cut(part: Any, part_region: tuple, piece: Piece, device: str) -> Any:
    """`piece` of a source part, cut on the part's device."""
    lo = [b - r[0] for b, r in zip(piece.begin, part_region)]
    size = [e - b for b, e in zip(piece.begin, piece.end)]
    if all(s == r[1] - r[0] for s, r in zip(size, part_region)):
        return part
    with tf.device(device):
        return tf.slice(part, lo, size)


def _joined(cut: list, pieces: list[Piece], rank: int) -> Any:
    """The cut pieces (row-major over the source blocks they come from)
    joined into one tensor on the current device, last dim first."""
    if len(cut) == 1:
        return tf.identity(cut[0])
    counts = [len({p.begin[d] for p in pieces}) for d in range(rank)]
    row = list(cut)
    for dim in reversed(range(rank)):
        n = counts[dim]
        if n > 1:
            row = [tf.concat(row[i:i + n], axis=dim)
                   for i in range(0, len(row), n)]
    (result,) = row
    return result


def _copy_function(moves: list[tuple], parts: list) -> Any:
    """One compiled function making, for each (source grid, destination
    grid, source devices, destination devices), every destination part
    from the source parts (`copy_plan`), traced for `parts`. One call
    per segment boundary, where eager slices and joins cost a dispatch
    each (measured: 2-3 ms a move on 4 virtual CPU devices, a quarter of
    a small MLP's step); the concrete function, called directly, skips
    `tf.function`'s signature matching (0.75 ms a call, measured)."""
    plans = [(copy_plan(src, dst, src_devices, dst_devices), src,
              src_devices, dst_devices)
             for src, dst, src_devices, dst_devices in moves]

    def copy(all_parts):
        everything = []
        for parts, (plan, src, src_devices, dst_devices) in zip(all_parts,
                                                                plans):
            made = []
            for part, pieces in enumerate(plan):
                with tf.device(dst_devices[part]):
                    cut = [_cut(parts[p.source], src.region(p.source), p,
                                src_devices[p.source]) for p in pieces]
                    made.append(_joined(cut, pieces, len(src.shape)))
            everything.append(made)
        return everything

    return step_function(copy).get_concrete_function(parts)


# Per call of `move_all` or `gathered`: ((source layout, destination
# layout or "whole", shape, dtype), ...) -> its compiled copies.
_COPIES: dict[tuple, Any] = {}


def _copied(keys: list[tuple], held: list[list], describe: Any) -> list:
    """Each move's destination parts from its source parts `held`, by the
    compiled copies of `keys` (`_COPIES`), made at the first call from
    `describe()`: per move, (source grid, destination grid, source
    devices, destination devices)."""
    key = tuple(keys)
    copy = _COPIES.get(key)
    if copy is None:
        copy = _COPIES[key] = _copy_function(describe(), held)
    return copy(held)


def move(value: Any, layout: Any) -> Any:
    """`value` (a DTensor on any mesh, or a regular tensor) as a DTensor
    of `layout`, each part made of the pieces its device reads
    (`move_all` of one value)."""
    (moved,) = move_all([value], [layout])
    return moved


def move_all(values: Sequence[Any], layouts: Sequence[Any]) -> list:
    """Each value as a DTensor of its layout, the copies between meshes
    made by one compiled call (`_copy_function`). A regular tensor is
    packed whole onto the layout's mesh (`replicate`), and the function
    reading it takes its slice there.

    On a value's own mesh the move is left to DTensor (`relayout`: what
    the simulator prices there, `taskgraph.one_mesh`); where this
    process lacks a device of either mesh, it goes through a replicated
    copy (`_through_copy`).
    """
    result: list = [None] * len(values)
    copied, keys, held, sources = [], [], [], []
    for index, (value, layout) in enumerate(zip(values, layouts)):
        if not dtensor.is_dtensor(value):
            # A batch input or the loss's gradient: whole on each device
            # (one `pack`, no copy function); the function that reads it
            # slices it locally.
            result[index] = replicate(value, layout.mesh)
            continue
        source = dtensor.fetch_layout(value)
        if source.mesh == layout.mesh:
            result[index] = (value if source == layout
                             else dtensor.relayout(value, layout))
            continue
        if not (_all_local(source.mesh) and _all_local(layout.mesh)):
            result[index] = _through_copy(value, layout)
            continue
        copied.append(index)
        held.append(dtensor.unpack(value))
        sources.append(source)
        keys.append((source.to_string(), layout.to_string(),
                     tuple(value.shape), value.dtype))
    if copied:
        made = _copied(keys, held, lambda: [
            (grid_of(source, values[index].shape),
             grid_of(layouts[index], values[index].shape),
             [p.device for p in parts], layouts[index].mesh.local_devices())
            for index, parts, source in zip(copied, held, sources)
        ])
        for index, parts in zip(copied, made):
            result[index] = dtensor.pack(parts, layouts[index])
    return result


def _through_copy(value: Any, layout: Any) -> Any:
    """The multi-client path: one replicated copy per client, packed onto
    the destination's mesh whole (the function that reads it relays it
    out to the layout it reads)."""
    if dtensor.is_dtensor(value):
        source = dtensor.fetch_layout(value)
        if not source.is_fully_replicated():
            value = dtensor.relayout(
                value, replicated(source.mesh, value.shape.rank))
        value = dtensor.unpack(value)[0]
    return replicate(value, layout.mesh)


def replicate(value: Any, mesh: Any) -> Any:
    """A regular tensor as a replicated DTensor on `mesh` (eager).

    `pack` of one copy per local device: it costs 0.03 ms against 0.18
    ms for `copy_to_mesh` (a DTensor op of its own), measured on 4
    virtual CPU devices; per batch input and per variable, that was a
    visible part of a small model's step. In DTensor's multi-client mode
    each client packs its own devices' copies (every client holds the
    same value: the same script on the same data).
    """
    value = tf.convert_to_tensor(value)
    layout = replicated(mesh, value.shape.rank)
    local = mesh.local_devices()
    if local:
        return dtensor.pack([value] * len(local), layout)
    return dtensor.copy_to_mesh(value, layout)


def gathered(values: Sequence[Any]) -> list:
    """Each value whole, as a regular tensor on its first part's device
    (a regular tensor as it is), the split ones joined by one compiled
    call."""
    result: list = list(values)
    joined, keys, held, sources = [], [], [], []
    for index, value in enumerate(values):
        if not dtensor.is_dtensor(value):
            continue
        layout = dtensor.fetch_layout(value)
        if layout.is_fully_replicated():
            result[index] = dtensor.unpack(value)[0]
        elif not _all_local(layout.mesh):
            result[index] = dtensor.unpack(dtensor.relayout(
                value, replicated(layout.mesh, value.shape.rank)))[0]
        else:
            joined.append(index)
            held.append(dtensor.unpack(value))
            sources.append(layout)
            keys.append((layout.to_string(), "whole", tuple(value.shape),
                         value.dtype))
    if joined:
        made = _copied(keys, held, lambda: [
            (grid_of(source, values[index].shape),
             whole(values[index].shape), [p.device for p in parts],
             [parts[0].device])
            for index, parts, source in zip(joined, held, sources)
        ])
        for index, (one,) in zip(joined, made):
            result[index] = one
    return result


def added(a: Any, b: Any) -> Any:
    """The sum of two values of one layout, part by part (no DTensor op)."""
    if not dtensor.is_dtensor(a):
        return a + b
    layout = dtensor.fetch_layout(a)
    if dtensor.fetch_layout(b) != layout or not _all_local(layout.mesh):
        return a + b
    sums = []
    for x, y in zip(dtensor.unpack(a), dtensor.unpack(b)):
        with tf.device(x.device):
            sums.append(x + y)
    return dtensor.pack(sums, layout)


def zeros_like(value: Any) -> Any:
    """Zeros of `value`'s shape, dtype and layout, made part by part."""
    if not dtensor.is_dtensor(value):
        return tf.zeros_like(value)
    layout = dtensor.fetch_layout(value)
    if not _all_local(layout.mesh):
        return tf.zeros_like(value)
    zeros = []
    for part in dtensor.unpack(value):
        with tf.device(part.device):
            zeros.append(tf.zeros_like(part))
    return dtensor.pack(zeros, layout)
