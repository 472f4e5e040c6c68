"""The SOAP search space of one op: every config the runtime can execute.

A config splits only the output dims the op declares partitionable
(`Op.partitionable`, from `op_specs`), each by a degree dividing that
dim's size, into at most `num_devices` parts, and places the parts on
any distinct devices in any order (the Operator dimension of SOAP). So
a whole op on one device k (`dims` all 1, `device_ids=(k,)`) is in the
space, as FlexFlow's DLRM strategy needs for its embedding tables.

The DTensor runtime's tests execute random configs from here: what this
module proposes, the runtime must run. The calls of one shared layer are
tied (`weight_ties`): the runtime keeps the layer's weights on one mesh
and runs every call there, so they take one config together.
"""

import functools
import itertools
import math
import random
from collections.abc import Iterator

from flexflow_keras.graph import Op, OpGraph
from flexflow_keras.mesh_space import (
    MeshSpec, mesh_configs, mesh_data_parallel, mesh_shapes,
)
from flexflow_keras.strategy import ParallelConfig, Strategy


# Share of proposals placed on a contiguous device block. Scattered
# devices span more nodes and are rarely faster, so proposing them half
# the time (as before) wasted proposals: on the benchmark suite, 5 seeds,
# MCMC's median step time over the best of 0.5 / 0.9 / 1.0 averaged
# 1.027 / 1.008 / 1.003 (docs/SEARCH.md). 0.9 keeps every placement
# reachable.
CONTIGUOUS_SHARE = 0.9


def _divisors(size: int, limit: int) -> list[int]:
    return [d for d in range(1, min(size, limit) + 1) if size % d == 0]


def valid_dims(op: Op, num_devices: int) -> list[tuple[int, ...]]:
    """Every degree tuple the op may take on `num_devices` devices.

    Args:
        op: The op.
        num_devices: Devices of the machine.

    Returns:
        Tuples with one degree per output dim (rank-0 ops: one entry),
        > 1 only on partitionable dims, each dividing its dim, product
        <= `num_devices`; sorted, `(1, ..., 1)` first.
    """
    if num_devices < 1:
        raise ValueError(
            f"`num_devices` must be >= 1. Received: num_devices={num_devices}"
        )
    groups = _dims_by_parts(
        op.output_shape or (1,), frozenset(op.partitionable), num_devices
    )
    return [dims for _, choices in groups for dims in choices]


def sweep_configs(op: Op, num_devices: int) -> list[ParallelConfig]:
    """Every degree tuple of `op` (`valid_dims`), each on the first
    devices (`0..parts-1`): what the search's first sweep tries per op.

    Why these: how an op splits decides most of its cost (compute per
    part, the transfers its neighbours need, its weight sync); where the
    parts run matters mostly through which nodes they span, which the
    MCMC chain after the sweep explores.
    """
    return [
        ParallelConfig(dims, tuple(range(math.prod(dims))))
        for dims in valid_dims(op, num_devices)
    ]


def _device_sets(parts: int, num_devices: int) -> Iterator[tuple[int, ...]]:
    return itertools.permutations(range(num_devices), parts)


def valid_configs(
    op: Op, num_devices: int, placement: str = "any"
) -> Iterator[ParallelConfig]:
    """Every valid config of `op`, lazily.

    Args:
        op: The op.
        num_devices: Devices of the machine.
        placement: `"any"`: every ordered choice of distinct devices
            (n!/(n-k)! per degree tuple with k parts: enumerate only on
            small machines); `"contiguous"`: blocks `s..s+k-1` as
            FlexFlow proposes them.

    Yields:
        `ParallelConfig`s, each exactly once.
    """
    if placement not in ("any", "contiguous"):
        raise ValueError(
            "`placement` must be 'any' or 'contiguous'. "
            f"Received: placement={placement!r}"
        )
    for dims in valid_dims(op, num_devices):
        parts = math.prod(dims)
        if placement == "any":
            sets = _device_sets(parts, num_devices)
        else:
            sets = (
                tuple(range(s, s + parts))
                for s in range(num_devices - parts + 1)
            )
        for ids in sets:
            yield ParallelConfig(dims, ids)


@functools.lru_cache(maxsize=4096)
def _dims_by_parts(
    shape: tuple[int, ...], split_dims: frozenset[int], num_devices: int
) -> tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]:
    """(part count, degree tuples) pairs; a pure function, so cached."""
    choices = [
        _divisors(size, num_devices) if dim in split_dims else [1]
        for dim, size in enumerate(shape)
    ]
    by_parts: dict[int, list[tuple[int, ...]]] = {}
    for dims in itertools.product(*choices):
        parts = math.prod(dims)
        if parts <= num_devices:
            by_parts.setdefault(parts, []).append(dims)
    return tuple((p, tuple(sorted(by_parts[p]))) for p in sorted(by_parts))


def random_config(
    op: Op, num_devices: int, rng: random.Random
) -> ParallelConfig:
    """One random valid config of `op`.

    Draws the part count uniformly among those the op can take (so one
    device, the Operator-parallel placement, is as likely as any split),
    then a degree tuple with that many parts, then the devices: with
    probability `CONTIGUOUS_SHARE` a contiguous block at a random start
    (FlexFlow's proposal), else any distinct devices in any order (so
    every placement stays reachable).

    Args:
        op: The op.
        num_devices: Devices of the machine.
        rng: Source of randomness (`random.Random`), for reproducibility.
    """
    if num_devices < 1:
        raise ValueError(
            f"`num_devices` must be >= 1. Received: num_devices={num_devices}"
        )
    groups = _dims_by_parts(
        op.output_shape or (1,), frozenset(op.partitionable), num_devices
    )
    parts, choices = rng.choice(groups)
    dims = rng.choice(choices)
    if rng.random() < CONTIGUOUS_SHARE:
        start = rng.randrange(num_devices - parts + 1)
        ids = tuple(range(start, start + parts))
    else:
        ids = tuple(rng.sample(range(num_devices), parts))
    return ParallelConfig(dims, ids)


def weight_ties(graph: OpGraph) -> dict[str, tuple[str, ...]]:
    """Op name -> the ops that must share its config, itself included.

    The calls of a shared layer with the owner's output shape: their
    weights live once, on the owner's mesh, and the runtime runs each
    call there (`runtime.layouts.plan_ops`). A call of another shape is
    not tied (the runtime needs its config to equal the owner's anyway).
    Ops outside any tie are absent.
    """
    groups: dict[str, list[str]] = {}
    for op in graph:
        owner = op.shares_weights_with
        if owner and graph.op(owner).output_shape == op.output_shape:
            groups.setdefault(owner, [owner]).append(op.name)
    return {name: tuple(g) for g in groups.values() for name in g}


def twin_groups(graph: OpGraph) -> tuple[tuple[str, ...], ...]:
    """Groups of two or more ops that are alike (the same type, shapes,
    dtype, weights, FLOPs and partitionable dims) and not tied
    (`weight_ties`), in graph order: the layers a model repeats (NMT's
    source and target embeddings, a Transformer's blocks).

    Why: the search's sweep also tries each config for a group at once.
    Twins often gain only together: NMT on k80x64, searched on one 2 x 32
    mesh, went from 212.48 to 192.13 ms with both embeddings split 2-D,
    while either alone was 1% slower (the other's weight sync kept the
    step's length), so neither the sweep nor 500 chain iterations took
    the pair (seed 1, or 4,000 iterations, did)."""
    tied = weight_ties(graph)
    groups: dict[tuple, list[str]] = {}
    for op in graph:
        if op.name in tied:
            continue
        key = (
            op.type, op.input_shapes, op.output_shapes, op.dtype,
            tuple((w.shape, w.dtype, w.trainable) for w in op.weights),
            op.forward_flops, op.backward_flops,
            tuple(sorted(op.partitionable.items())),
        )
        groups.setdefault(key, []).append(op.name)
    return tuple(tuple(g) for g in groups.values() if len(g) > 1)


def tie_shared(
    graph: OpGraph, strategy: Strategy
) -> tuple[Strategy, list[str]]:
    """`strategy` with each tied op given its owner's config, and the
    names of the ops that changed (what runs, so what to simulate)."""
    changed = []
    for name, group in weight_ties(graph).items():
        owner = strategy[group[0]]
        if strategy[name] != owner:
            strategy = strategy.replace(name, owner)
            changed.append(name)
    return strategy, changed


# -- one mesh ---------------------------------------------------------------
#
# A model that runs its own training step (a `train_step` or
# `compute_loss` override, `add_loss`, activity regularizers, masks, mixed
# precision, any Keras optimizer) runs it as one DTensor function, and
# DTensor runs such a function on one device mesh. That mesh may have
# several axes (`mesh_space`: the search chooses its shape); the 1-D
# mesh of `k` devices `0..k-1` below is its simplest case, kept for
# batches the devices do not divide (`one_mesh_devices`).


def one_mesh_configs(op: Op, parts: int) -> list[ParallelConfig]:
    """The configs of `op` on the 1-D mesh of devices `0..parts-1`
    (`mesh_space.mesh_configs`): one partitionable dim split `parts`
    ways, sample dim first, then the unsplit config, which the runtime
    runs replicated on the mesh (the only one when `parts` is 1 or
    divides none of its splittable dims, as a convolution's batch of 50
    on 4 devices). Never empty: every batch size has a space."""
    return mesh_configs(op, MeshSpec.first((parts,)))


def one_mesh_splits(op: Op, parts: int) -> list[ParallelConfig]:
    """The configs of `op` that split one dim it may partition `parts`
    ways over devices `0..parts-1`, sample dim first; empty when `parts`
    is 1 or divides none of them."""
    return [c for c in one_mesh_configs(op, parts) if c.num_parts > 1]


def one_mesh_devices(graph: OpGraph, num_devices: int) -> int:
    """The devices (<= `num_devices`) of the one mesh a model's ops share.

    The most devices at which every op that may split something splits
    some dim (`one_mesh_splits`): a batch of 50 on 4 devices gives a
    mesh of 2 when an op splits only the batch, of 4 when each op
    splits another dim 4 ways. When no mesh of 2 or more lets every op
    split (a batch of 7 through a convolution), the mesh where the most
    ops split (the larger on ties), the others replicated on it; 1 when
    no op splits on any.
    """
    splittable = [op for op in graph if op.partitionable]
    best, best_split = 1, 0
    for parts in range(num_devices, 1, -1):
        split = sum(1 for op in splittable if one_mesh_splits(op, parts))
        if split == len(splittable):
            return parts
        if split > best_split:
            best, best_split = parts, split
    return best


def one_mesh_data_parallel(graph: OpGraph, parts: int) -> Strategy:
    """Every op on the one mesh of `parts` devices, splitting the batch
    where it can (else its first partitionable dim that divides, else
    replicated on the mesh)."""
    return mesh_data_parallel(graph, MeshSpec.first((parts,)))


def fewer_devices(num_devices: int) -> tuple[int, ...]:
    """The smaller counts of devices, more than one, that divide
    `num_devices`, largest first: what the search also starts from
    (`planner.search_candidates`) or weighs (`planning_meshes`).

    Why: where devices share compute (virtual CPU devices on a host's
    cores) a step over fewer of them can be faster, and the chain seldom
    gets there, since every op must move at once and each one moved
    alone pays transfers between meshes. keras.io's addition RNN on 4
    virtual CPUs (2 cores): data parallelism over 2 devices simulated
    11.5 ms, over 4 14.6 ms (11-13 ms measured against 18-28), and a
    chain of 5,000 iterations from the 4 ended at 14.6 ms.
    """
    return tuple(k for k in range(num_devices - 1, 1, -1)
                 if num_devices % k == 0)


def planning_meshes(
    parts: int, num_devices: int, fewer: bool = True
) -> tuple[MeshSpec, ...]:
    """The meshes a model that runs its own step is searched on: every
    shape over all `num_devices` devices (`mesh_space.mesh_shapes`,
    host-major), or the 1-D mesh of `parts` devices when the batch leaves
    fewer (`one_mesh_devices`); then, with `fewer`, the 1-D mesh of each
    of `fewer_devices(parts)`. Not across DTensor clients
    (`fewer=False`): each mesh must hold every host's devices
    (docs/MULTIHOST.md).
    """
    if parts != num_devices:
        meshes = [MeshSpec.first((parts,))]
    else:
        meshes = [MeshSpec.first(s) for s in mesh_shapes(num_devices)]
    if fewer:
        meshes += [MeshSpec.first((k,)) for k in fewer_devices(parts)]
    return tuple(meshes)


def is_one_mesh(strategy: Strategy, num_devices: int | None = None) -> bool:
    """Whether every op of `strategy` runs on one DTensor mesh
    (`mesh_space.MeshSpec.of`: each config a block of one N-D mesh over
    at most `num_devices` devices; None: the devices it uses)."""
    if num_devices is None:
        num_devices = 1 + max(
            (i for c in strategy.values() for i in c.device_ids), default=0
        )
    return MeshSpec.of(strategy, num_devices) is not None


def mesh_key(config: ParallelConfig) -> tuple:
    """The layer-by-layer executor's mesh of a config: its degrees > 1
    (axes named by position) and its devices."""
    return tuple(d for d in config.dims if d > 1), config.device_ids


def random_strategy(
    graph: OpGraph,
    num_devices: int,
    rng: random.Random,
    one_mesh_parts: int | None = None,
) -> Strategy:
    """A random strategy from the space the search explores: every op a
    `random_config` (or, with `one_mesh_parts`, one of its
    `one_mesh_configs`), shared layers' calls tied."""
    configs = {}
    for op in graph:
        if one_mesh_parts is None:
            configs[op.name] = random_config(op, num_devices, rng)
        else:
            choices = one_mesh_configs(op, one_mesh_parts)
            configs[op.name] = choices[rng.randrange(len(choices))]
    strategy, _ = tie_shared(graph, Strategy(configs))
    return strategy
