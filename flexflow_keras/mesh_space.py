"""Strategies on one N-D device mesh: what a model's own step can run.

A model's own training step runs as one DTensor function, and DTensor
runs such a function only on one mesh: functions over several meshes
hang or fail in their backward pass (measured, docs/ARCHITECTURE.md,
also for a 1-D and a 2-D view of the same devices). One mesh can still
have several axes. Its devices are `np.reshape(device_ids, shape)`,
host-major (strategy device ids count devices host by host, so the
first axis crosses the slow links); each op maps each of its split
tensor dims to a distinct mesh axis (DTensor shards a tensor dim over
at most one axis) and runs replicated along the axes it does not use.
So on a 4 x 4 mesh an op may split its batch over axis 0 and its
channels over axis 1 (data x tensor parallelism inside one function),
or its batch over axis 1 alone, every row of devices computing a copy.

FlexFlow's strategy format is kept: an op's config is the block of the
mesh that computes one copy of it. `dims` are the axis sizes its split
dims take; `device_ids` the mesh's devices with every unused axis at
one index, laid out by the split dims in order (`block_config`). A
config that is no such block on a mesh is not on it (`axes_on`), and a
strategy whose configs are all blocks of one mesh is a mesh strategy
(`MeshSpec.of`): today's one-mesh strategies (one dim split `k` ways on
devices `0..k-1`) are the 1-D case, and every file written for them
loads unchanged.

Pure Python + NumPy: the planning core imports no TensorFlow.
"""

import dataclasses
import functools
import itertools
import math
from typing import Any

import numpy as np

from flexflow_keras.graph import Op
from flexflow_keras.strategy import ParallelConfig, Strategy

# Most axes a searched mesh may have: each op has at most a few dims it
# may split (batch, sequence, channels), so a fourth axis would only
# ever be replicated.
MAX_AXES = 3


@functools.lru_cache(maxsize=256)
def mesh_shapes(num_devices: int, max_axes: int = MAX_AXES) -> tuple:
    """Every ordered factorization of `num_devices` into at most
    `max_axes` factors >= 2: the mesh shapes the search may choose, 1-D
    first, then by axis count. `(1,)` for one device."""
    if num_devices < 1:
        raise ValueError(
            f"`num_devices` must be >= 1. Received: num_devices={num_devices}"
        )
    if num_devices == 1:
        return ((1,),)
    shapes: list[tuple[int, ...]] = []

    def grow(prefix: tuple[int, ...], rest: int) -> None:
        if rest == 1:
            shapes.append(prefix)
            return
        if len(prefix) == max_axes:
            return
        for factor in range(2, rest + 1):
            if rest % factor == 0:
                grow(prefix + (factor,), rest // factor)

    grow((), num_devices)
    return tuple(sorted(shapes, key=lambda s: (len(s), s)))


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """One device mesh: `devices` laid out row-major in `shape`.

    Args:
        shape: Axis sizes, outermost first.
        devices: Strategy device ids, `prod(shape)` of them.
    """

    shape: tuple[int, ...]
    devices: tuple[int, ...]

    @classmethod
    def first(cls, shape: tuple[int, ...]) -> "MeshSpec":
        """The mesh of `shape` over devices `0..prod(shape)-1`."""
        return cls(tuple(shape), tuple(range(math.prod(shape))))

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def grid(self) -> np.ndarray:
        return np.asarray(self.devices).reshape(self.shape)

    def axes(self, config: ParallelConfig) -> dict[int, int] | None:
        """Split tensor dim -> mesh axis of `config` on this mesh, or None
        when `config` is no block of it (`axes_on`)."""
        return axes_on(config, self)

    @classmethod
    def of(cls, strategy: Any, num_devices: int) -> "MeshSpec | None":
        """The mesh every config of `strategy` is a block of, or None.

        Tried in order: the devices of its largest split config (how
        one-mesh strategies were written), then devices `0..k-1` for
        growing `k` up to `num_devices`; on each, its shapes 1-D first.
        A strategy with no split op has the 1-device mesh of its first
        op's device.
        """
        configs = list(dict(strategy).values())
        split = [c for c in configs if len(c.device_ids) > 1]
        if not split:
            devices = {c.device_ids[0] for c in configs} or {0}
            if len(devices) == 1:
                return cls((1,), (devices.pop(),))
        top = max((c.device_ids for c in split), key=len, default=())
        used = max((i for c in configs for i in c.device_ids), default=0)
        candidates = [tuple(top)] if top else []
        candidates += [
            tuple(range(k)) for k in range(used + 1, num_devices + 1)
        ]
        for devices in dict.fromkeys(candidates):
            for shape in mesh_shapes(len(devices), max(MAX_AXES, 1)):
                mesh = cls(shape, devices)
                if all(axes_on(c, mesh) is not None for c in configs):
                    return mesh
        return None


def axes_on(config: ParallelConfig, mesh: MeshSpec) -> dict[int, int] | None:
    """Split tensor dim -> mesh axis for `config` on `mesh`, or None.

    `config` is on `mesh` when its split dims take distinct axes of
    their size and its devices, laid out by its degrees, are the mesh's
    devices along those axes with every other axis at index 0: the
    block that holds the mesh's first device, whose copies the other
    devices compute. An unsplit config is on it on that first device
    (replicated everywhere). A block elsewhere (devices 2, 3 of a 2 x 2
    mesh) is a placement the runtime would not honour on the mesh, so
    it is on no mesh with the first block: such a strategy uses several
    meshes.
    """
    split = [(d, g) for d, g in enumerate(config.dims) if g > 1]
    if len(split) > len(mesh.shape) or config.device_ids[0] != mesh.devices[0]:
        return None
    if not split:
        return {}
    grid = mesh.grid
    origin = (0,) * len(mesh.shape)
    ids = np.asarray(config.device_ids).reshape([g for _, g in split])
    for axes in itertools.permutations(range(len(mesh.shape)), len(split)):
        if any(mesh.shape[a] != g for a, (_, g) in zip(axes, split)):
            continue
        index = tuple(
            slice(None) if a in axes else origin[a]
            for a in range(len(mesh.shape))
        )
        kept = [a for a in range(len(mesh.shape)) if a in axes]
        block = np.transpose(grid[index], [kept.index(a) for a in axes])
        if np.array_equal(block, ids):
            return {d: a for (d, _), a in zip(split, axes)}
    return None


@functools.lru_cache(maxsize=65536)
def share_a_mesh(
    a: ParallelConfig, b: ParallelConfig, num_devices: int
) -> bool:
    """Whether one mesh holds both configs as blocks, found as the
    runtime finds a strategy's (`MeshSpec.of`): then one DTensor mesh
    carries both, and a value moves between them by a relayout on it,
    not between meshes. Cached: the simulator asks per edge piece."""
    return MeshSpec.of({"a": a, "b": b}, num_devices) is not None


def block_config(
    op: Op, mesh: MeshSpec, axes: dict[int, int]
) -> ParallelConfig:
    """The config of `op` splitting tensor dim `d` over mesh axis
    `axes[d]` (replicated along the others, their index 0)."""
    rank = max(op.rank, 1)
    dims = tuple(
        mesh.shape[axes[d]] if d in axes else 1 for d in range(rank)
    )
    order = [axes[d] for d in sorted(axes)]
    index = tuple(
        slice(None) if a in order else 0 for a in range(len(mesh.shape))
    )
    kept = [a for a in range(len(mesh.shape)) if a in order]
    block = np.transpose(mesh.grid[index], [kept.index(a) for a in order])
    return ParallelConfig(dims, tuple(int(i) for i in block.ravel()))


def mesh_configs(op: Op, mesh: MeshSpec) -> list[ParallelConfig]:
    """Every config of `op` on `mesh`: each axis given to at most one dim
    the op may partition whose size it divides, the most split first
    (so data parallelism over the whole mesh, where it exists, leads);
    the unsplit config (replicated on the mesh) last. Never empty."""
    shape = op.output_shape or (1,)
    dims = [d for d in sorted(op.partitionable) if d < len(shape)]
    found: dict[ParallelConfig, int] = {}
    for choice in itertools.product([None] + dims, repeat=len(mesh.shape)):
        taken = [d for d in choice if d is not None]
        if len(set(taken)) != len(taken):
            continue
        axes = {d: a for a, d in enumerate(choice) if d is not None}
        if any(shape[d] % mesh.shape[a] for d, a in axes.items()):
            continue
        if any(mesh.shape[a] == 1 for a in axes.values()):
            continue
        config = block_config(op, mesh, axes)
        found.setdefault(config, len(config.device_ids))
    unsplit = ParallelConfig((1,) * max(op.rank, 1), (mesh.devices[0],))
    found.pop(unsplit, None)
    ordered = sorted(found, key=lambda c: (-found[c], _split_first(c)))
    return ordered + [unsplit]


def _split_first(config: ParallelConfig) -> tuple:
    """Sort key among configs on as many devices: by the dims they
    split (the sample dim, 0, first), then the widest first."""
    split = [d for d, g in enumerate(config.dims) if g > 1]
    return (split, [-config.dims[d] for d in split], config.device_ids)


def mesh_data_parallel(graph: Any, mesh: MeshSpec) -> Strategy:
    """Every op on `mesh` with its first `mesh_configs` entry: the batch
    over as much of the mesh as it can take."""
    return Strategy({op.name: mesh_configs(op, mesh)[0] for op in graph})


def copies(config: ParallelConfig, mesh: MeshSpec) -> int:
    """How many copies of `config`'s block the mesh computes: every
    device runs one part, so the mesh's size over the block's."""
    return mesh.size // len(config.device_ids)
