"""Task graph of one training step: pieces built per op, edge and family.

A strategy's task graph is the union of pieces, each depending on few
configs, so that a delta simulation rebuilds only the pieces a changed
op reaches and takes every other piece from a cache:

- op piece (op config): a forward and a backward task per part;
- edge piece (producer config, consumer config): for each (producer
  part, consumer part) whose rectangles intersect on different devices,
  a forward transfer of the activation and a backward transfer of its
  gradient, sized by the intersection, over the route's links; on one
  device, a plain dependency. Between two configs on one mesh, what
  DTensor's all-gather relayout brings each part (`overlaps`), moved by
  one collective per group of devices and direction (`_relayouts`);
- family piece (configs of an owner op and the ops sharing its weights):
  per weight shard, a ring all-reduce over the devices holding replicas
  of it, then an update task on each of those devices; and the weight,
  gradient and optimizer-slot memory.

Tasks refer to other pieces' tasks as (op index, local index); `compile`
resolves them. Every task has a canonical priority, unique and
independent of build order, which breaks ties in the list scheduler so
that a delta simulation gives bit for bit the full one's answer.
"""

import dataclasses
import functools

import numpy as np

from flexflow_keras import partition
from flexflow_keras.cost import CostModel
from flexflow_keras.graph import Op, OpGraph
from flexflow_keras.machine import MachineModel
from flexflow_keras.mesh_space import share_a_mesh
from flexflow_keras.search_space import mesh_key
from flexflow_keras.strategy import ParallelConfig

XFER_FWD, FWD, BWD, XFER_BWD, SYNC, UPDATE = range(6)
KIND_NAMES = ("xfer", "fwd", "bwd", "xfer_grad", "allreduce", "update")
SELF = -1  # op index of a reference into the piece's own tasks


def priority(op_index: int, kind: int, a: int = 0, b: int = 0) -> int:
    """Canonical tie-break: op order, then kind, then part numbers."""
    return ((op_index * 8 + kind) << 44) | (a << 22) | b


@dataclasses.dataclass(frozen=True)
class Piece:
    """Tasks and dependencies of one piece, in local numbering.

    Args:
        durations_ms: Per task.
        resources: Per task, device ids and `num_devices + link` ids.
        priorities: Per task, canonical tie-break.
        labels: Per task, (kind, op name, detail) for traces; a
            transfer's detail is (tensor, from, to) (`detail_text`).
        deps: (src op index, src local, dst op index, dst local); op
            index `SELF` means this piece.
        busy_ms: (device, ms) of compute tasks.
        memory_bytes: (device, bytes) this piece keeps resident.
        comm_bytes: Bytes moved over links.
        riders: (leader local, count): the `count` tasks after the
            leader are sinks on distinct devices, ready when it is, with
            the next priorities; the scheduler runs them with it (see
            `schedule`), so they have no dependencies of their own.
        derived: What `schedule` computes once from the piece (per-device
            rows, first resources), kept with it; not part of its value.
    """

    durations_ms: tuple[float, ...] = ()
    resources: tuple[tuple[int, ...], ...] = ()
    priorities: tuple[int, ...] = ()
    labels: tuple[tuple[int, str, str | tuple], ...] = ()
    deps: tuple[tuple[int, int, int, int], ...] = ()
    busy_ms: tuple[tuple[int, float], ...] = ()
    memory_bytes: tuple[tuple[int, float], ...] = ()
    comm_bytes: float = 0.0
    riders: tuple[tuple[int, int], ...] = ()
    derived: dict = dataclasses.field(
        default_factory=dict, compare=False, hash=False, repr=False
    )


class _Builder:
    """Collects one piece's tasks."""

    def __init__(self):
        self.dur, self.res, self.prio, self.labels = [], [], [], []
        self.deps, self.busy, self.memory = [], [], []
        self.comm = 0.0
        self.riders = []

    def task(self, ms, resources, prio, label) -> int:
        self.dur.append(ms)
        self.res.append(resources)
        self.prio.append(prio)
        self.labels.append(label)
        return len(self.dur) - 1

    def piece(self) -> Piece:
        return Piece(
            tuple(self.dur), tuple(self.res), tuple(self.prio),
            tuple(self.labels), tuple(self.deps), tuple(self.busy),
            tuple(self.memory), self.comm, tuple(self.riders),
        )


def op_piece(
    op: Op, index: int, config: ParallelConfig, cost: CostModel,
    machine: MachineModel | None = None,
) -> Piece:
    """Forward and backward tasks of every part; saved activations.

    A part computes on its device's compute resource
    (`MachineModel.compute_resource`: virtual devices share cores)."""
    b = _Builder()
    n = config.num_parts
    saved = op.output_bytes / n  # each part keeps its output share

    def on(device):
        return machine.compute_resource(device) if machine else device

    for i, device in enumerate(config.device_ids):
        forward_ms, _ = cost.op_cost(op, config, device)
        b.task(forward_ms, (on(device),), priority(index, FWD, i),
               (FWD, op.name, f"part {i}"))
        b.busy.append((device, forward_ms))
        b.memory.append((device, saved))
    for i, device in enumerate(config.device_ids):
        _, backward_ms = cost.op_cost(op, config, device)
        b.task(backward_ms, (on(device),), priority(index, BWD, i),
               (BWD, op.name, f"part {i}"))
        b.busy.append((device, backward_ms))
        b.deps.append((SELF, i, SELF, n + i))
    return b.piece()


def edge_piece(
    machine: MachineModel,
    producer: Op,
    producer_index: int,
    producer_config: ParallelConfig,
    consumer: Op,
    consumer_index: int,
    consumer_config: ParallelConfig,
    input_index: int,
    between_meshes: str = "regions",
) -> Piece:
    """Transfers (or plain dependencies) for one consumer input.

    Per pair of parts that exchange data (`overlaps`), a forward
    transfer from the producer part to the consumer part and a backward
    transfer of the gradient the other way; on one device, or where
    nothing moves one way, a plain dependency. A transfer's label detail
    is (tensor, from, to), formatted only for traces (`detail_text`).

    On one mesh DTensor relays out, by collectives (`_relayouts`);
    between meshes the runtime copies regions (`runtime/moves.py`),
    transfers that `MachineModel.copy_route` prices where it differs
    from the links (`_region_transfers`).

    `between_meshes`: "regions" (that copy), or "replicated": a move
    between two configs that no one mesh holds (`share_a_mesh`) and
    that split differently, as one DTensor function makes it
    (`replicated_pairs`), for pricing what that route would cost
    (`bench/one_function_bench.py`). Moves that one mesh holds are
    priced as under "regions"."""
    check_between_meshes(between_meshes)
    b = _Builder()
    tensor = consumer.inputs[input_index]
    itemsize = np.dtype(producer.dtype).itemsize
    n_p, n_c = producer_config.num_parts, consumer_config.num_parts
    relaid = one_mesh(producer_config, consumer_config)
    output = producer.outputs.index(tensor)
    if (between_meshes == "replicated" and not relaid
            and producer_config.dims != consumer_config.dims
            and not share_a_mesh(producer_config, consumer_config,
                                 machine.num_devices)):
        pairs = replicated_pairs(
            producer, output, producer_config.dims,
            consumer, input_index, consumer_config.dims,
        )
        # Two views of the same devices, part k of each on device k: the
        # gather to replicated is one collective, as a relayout's.
        collective = producer_config.device_ids == consumer_config.device_ids
    else:
        pairs = overlap_array(
            producer, output, producer_config.dims,
            consumer, input_index, consumer_config.dims, relaid,
        )
        collective = relaid
    if collective:
        _relayouts(b, machine, pairs.tolist(), (producer_index, n_p),
                   (consumer_index, n_c), consumer_config.device_ids,
                   (priority(consumer_index, XFER_FWD, input_index << 12),
                    priority(consumer_index, XFER_BWD, input_index << 12)),
                   (consumer.name, tensor), itemsize)
        return b.piece()
    return _region_transfers(
        machine, pairs, (producer_index, producer_config),
        (consumer_index, consumer_config, input_index),
        (consumer.name, tensor), itemsize,
    )


# How a move between two meshes is priced (`edge_piece`).
BETWEEN_MESHES = ("regions", "replicated")


def check_between_meshes(between_meshes: str) -> None:
    """Raises a ValueError naming `BETWEEN_MESHES` for any other value
    (`edge_piece`'s and `Simulator`'s argument)."""
    if between_meshes not in BETWEEN_MESHES:
        raise ValueError(
            f"`between_meshes` must be one of {BETWEEN_MESHES}. "
            f"Received: between_meshes={between_meshes!r}"
        )


@functools.lru_cache(maxsize=1024)
def replicated_pairs(
    producer: Op, output: int, producer_dims: tuple[int, ...],
    consumer: Op, input_index: int, consumer_dims: tuple[int, ...],
) -> np.ndarray:
    """`overlap_array`'s rows for a move between two meshes inside one
    DTensor function: every consumer part receives every producer part
    (forward), and every producer part the input region of every
    consumer part (the gradient, backward).

    Why: `dtensor.copy_to_mesh` copies only replicated layouts, or
    sharded ones one to one (the same split on both meshes), so a value
    whose split changes between meshes is relaid out to replicated on
    its mesh, copied, and sliced on the other; its gradient goes back
    the same way. Pairs on one device cost nothing (`_region_transfers`
    makes them plain dependencies). Cached as `overlap_array`."""
    held = partition.tensor_rects(producer, output, producer_dims)
    parts = [
        partition.input_region(consumer, input_index, rect)
        for rect in partition.part_rects(consumer.output_shape, consumer_dims)
    ]
    sizes = [0 if r is None else partition.rect_size(r) for r in held]
    rows = [
        (i, j, sizes[j], partition.rect_size(region))
        for i, region in enumerate(parts)
        for j in range(len(held)) if sizes[j]
    ]
    array = np.array(rows, np.int64).reshape(-1, 4)
    array.setflags(write=False)
    return array


def _region_transfers(machine, pairs, producer, consumer, names,
                      itemsize) -> Piece:
    """The piece of a move between two meshes: per `pairs` row
    (consumer part i, producer part j, forward, backward elements) on
    two devices, a forward transfer where the forward elements are not
    0, then a backward one where the backward elements are not 0, each
    between the parts' tasks; a plain dependency where a direction moves
    nothing or both parts are on one device.

    Why in arrays: between two meshes of 64 devices one piece holds up
    to 8,192 transfers, and built one by one in Python they were about
    half of NMT on k80x64's search. Tasks come in the order of the rows
    (forward before backward), priorities `priority(c, kind, (input
    << 12) | i, j)`, durations by `Route.transfer_ms`'s formula over
    `MachineModel.copy_route_figures`. `producer` is (op index,
    config), `consumer` (op index, config, input index), `names`
    (consumer name, tensor) for the labels."""
    p, producer_config = producer
    c, consumer_config, input_index = consumer
    name, tensor = names
    n_p, n_c = producer_config.num_parts, consumer_config.num_parts
    i, j, forward, backward = pairs.T
    dst = np.asarray(consumer_config.device_ids, np.int64)[i]
    src = np.asarray(producer_config.device_ids, np.int64)[j]
    cross = src != dst
    sends = cross & (forward > 0)  # a forward transfer
    returns = cross & (backward > 0)  # a backward transfer
    count = sends.astype(np.int64) + returns
    first = np.cumsum(count) - count  # the row's first task
    n = int(count.sum())
    at_f, at_b = first[sends], (first + sends)[returns]
    frm = np.empty(n, np.int64)
    to = np.empty(n, np.int64)
    elements = np.empty(n, np.int64)
    prio = np.empty(n, np.int64)
    frm[at_f], to[at_f] = src[sends], dst[sends]
    frm[at_b], to[at_b] = dst[returns], src[returns]
    elements[at_f], elements[at_b] = forward[sends], backward[returns]
    pair = (i << 22) | j
    prio[at_f] = priority(c, XFER_FWD, input_index << 12) | pair[sends]
    prio[at_b] = priority(c, XFER_BWD, input_index << 12) | pair[returns]
    num_bytes = elements * itemsize
    latency, gbps = machine.copy_route_figures
    dur = latency[frm, to] + num_bytes / (gbps[frm, to] * 1e6)
    deps = _transfer_deps((p, n_p), (c, n_c), pairs, first, (sends, returns))
    frm_list, to_list = frm.tolist(), to.tolist()
    table = machine.route_resource_table
    kinds = np.full(n, XFER_BWD)
    kinds[at_f] = XFER_FWD
    piece = Piece(
        tuple(dur.tolist()),
        tuple([table[a][z] for a, z in zip(frm_list, to_list)]),
        tuple(prio.tolist()),
        tuple([(k, name, (tensor, a, z))
               for k, a, z in zip(kinds.tolist(), frm_list, to_list)]),
        tuple(map(tuple, deps.tolist())),
        (),
        tuple(zip(dst[sends].tolist(),
                  (forward[sends] * itemsize).astype(float).tolist())),
        float(num_bytes.sum()),
    )
    piece.derived["deps"] = deps
    return piece


def _transfer_deps(producer, consumer, pairs, first, moves) -> np.ndarray:
    """The (n, 4) dependencies of `_region_transfers`, in the order a
    loop over the rows makes them: per `pairs` row, where the forward
    move is a transfer (`moves[0]`) producer part -> transfer ->
    consumer part, else producer part -> consumer part; then where the
    backward move is one (`moves[1]`) the consumer part's backward ->
    transfer -> producer part's backward, else consumer -> producer.
    `first` is the row's first transfer's local index. Six template
    slots per row, of which the moves pick: few NumPy calls a piece."""
    (p, n_p), (c, n_c) = producer, consumer
    sends, returns = moves
    i, j = pairs[:, 0], pairs[:, 1]
    back = first + sends  # the row's backward transfer
    slots = np.empty((len(pairs), 6, 4), np.int64)
    slots[:, :, 0] = (p, SELF, p, c, SELF, c)
    slots[:, :, 2] = (SELF, c, c, SELF, p, p)
    for k, local in enumerate((j, first, j, n_c + i, back, n_c + i)):
        slots[:, k, 1] = local
    for k, local in enumerate((first, i, i, back, n_p + j, n_p + j)):
        slots[:, k, 3] = local
    chosen = np.empty((len(pairs), 6), bool)
    for k, picked in enumerate((sends, sends, ~sends, returns, returns,
                                ~returns)):
        chosen[:, k] = picked
    return slots[chosen]


def _relayouts(b, machine, pairs, producer, consumer, devices, keys, names,
               itemsize):
    """The collectives of a DTensor relayout on one mesh, added to `b`.

    DTensor runs a relayout as one collective per group of devices that
    exchange parts (an all-gather over the mesh axis whose split moves),
    not as FlexFlow's independent transfers: each group's forward and
    backward moves are one task each over the group's ring
    (`ring_allgather_ms`, sized by the largest part a device sends), after
    every part of the group that feeds it and before every part that
    reads it. Why: priced as point-to-point transfers each holding two
    NICs, the list scheduler packed the 240 transfers of AlexNet's fc6
    output moved from its channels to its batch on p100x16 end to end
    (44 ms against 4.2 ms of work on each NIC); an NCCL all-gather of
    those bytes takes under 1 ms.

    `pairs` are `overlaps` rows (consumer part, producer part, forward,
    backward elements); part k of each config is on `devices[k]`;
    `producer`/`consumer` are (op index, parts); `keys` the forward and
    backward priority keys; `names` (consumer name, tensor); `itemsize`
    the tensor's bytes per element."""
    (p, n_p), (c, n_c) = producer, consumer
    name, tensor = names
    group = list(range(len(devices)))  # union-find over parts

    def root(k):
        while group[k] != k:
            group[k] = group[group[k]]
            k = group[k]
        return k

    for i, j, _, _ in pairs:
        if i == j:  # one device: a plain dependency each way
            b.deps.append((p, j, c, i))
            b.deps.append((c, n_c + i, p, n_p + j))
        else:
            group[root(i)] = root(j)
    members: dict[int, list] = {}
    for row in pairs:
        if row[0] != row[1]:
            members.setdefault(root(row[0]), []).append(row)
    comm = 0.0
    for first, rows in sorted((min(min(r[0], r[1]) for r in rows), rows)
                              for rows in members.values()):
        parts = sorted({k for r in rows for k in r[:2]})
        ring = tuple(sorted(devices[k] for k in parts))
        # Per direction: its elements' column in `pairs`, and the tasks
        # it runs between as (op index, first local task, the column of
        # `pairs` naming the part): forward from the producer parts'
        # forward tasks to the consumer parts', backward from the
        # consumer parts' backward tasks to the producer parts'.
        for kind, key, column, sender, reader in (
            (XFER_FWD, keys[0], 2, (p, 0, 1), (c, 0, 0)),
            (XFER_BWD, keys[1], 3, (c, n_c, 0), (p, n_p, 1)),
        ):
            moved = [r for r in rows if r[column]]
            if not moved:
                continue
            part_bytes = max(r[column] for r in moved) * itemsize
            ms, links = ring_allgather_ms(machine, ring, part_bytes)
            t = len(b.dur)
            b.dur.append(ms)
            b.res.append(machine.link_resources(links))
            b.prio.append(key | (first << 22))
            b.labels.append((kind, name, f"{tensor} gathered over {ring}"))
            op, base, part = sender
            b.deps += [(op, base + k, SELF, t)
                       for k in sorted({r[part] for r in moved})]
            op, base, part = reader
            b.deps += [(SELF, t, op, base + k)
                       for k in sorted({r[part] for r in moved})]
            comm += sum(r[column] for r in moved) * itemsize
            if kind == XFER_FWD:  # each reader keeps what it received
                b.memory += [(devices[r[0]], float(r[2] * itemsize))
                             for r in moved]
    b.comm = comm


def detail_text(detail) -> str:
    """A label's detail as a trace shows it: a transfer's (tensor, from,
    to) as "tensor from->to", any other detail as it is."""
    if isinstance(detail, tuple):
        tensor, frm, to = detail
        return f"{tensor} {frm}->{to}"
    return detail


def one_mesh(a: ParallelConfig, b: ParallelConfig) -> bool:
    """True if the runtime moves a tensor between the two configs inside
    one DTensor mesh, by a relayout: they have the layer-by-layer
    executor's same mesh (`search_space.mesh_key`: split degrees in
    order, and devices; `(4, 1)` and `(1, 4)` on the same devices share
    one). Between other configs (two meshes, or two blocks of an N-D
    mesh) the simulator keeps FlexFlow's region transfers:
    docs/RUNTIME.md, "What a move between two layouts costs"."""
    return mesh_key(a) == mesh_key(b)


def overlaps(
    producer: Op, output: int, producer_dims: tuple[int, ...],
    consumer: Op, input_index: int, consumer_dims: tuple[int, ...],
    relaid: bool = False,
) -> tuple[tuple[int, int, int, int], ...]:
    """`overlap_array`'s rows as tuples of ints."""
    return tuple(map(tuple, overlap_array(
        producer, output, producer_dims, consumer, input_index,
        consumer_dims, relaid,
    ).tolist()))


@functools.lru_cache(maxsize=4096)
def overlap_array(
    producer: Op, output: int, producer_dims: tuple[int, ...],
    consumer: Op, input_index: int, consumer_dims: tuple[int, ...],
    relaid: bool = False,
) -> np.ndarray:
    """(consumer part, producer part, forward elements, backward
    elements), an (n, 4) int64 array, read-only, one row for every pair
    of parts that exchange data: the activation
    the producer part holds of `output` that the consumer part receives
    for input `input_index`, and the gradient sent back. Consumer part
    first.

    `relaid`: the two configs are on `one_mesh` (part i of each on one
    device), so the runtime moves the tensor by a DTensor relayout. The
    package turns DTensor's all-to-all relayouts off
    (`settings.all_gather_relayouts`): DTensor gathers every dim whose
    split the new layout does not keep, then slices locally, so consumer
    part i receives the `gathered_region` of producer part i, not only
    the region it reads (a move of a 4-device split from the channels to
    the batch brings the whole tensor to every device, 4 times what the
    parts read). The gradient goes back the same way where the consumer
    parts read disjoint regions (a layout move); where they overlap (a
    replicated read) it is a sum of partial gradients, sent as the
    regions met. Otherwise each consumer part receives its input region
    from each part holding some of it, as FlexFlow moves it. No gradient
    goes back for an input the step computes none of
    (`Op.gradient_inputs`: a frozen base's output).

    Why cached: it depends on the two configs' dims, not their devices
    (beyond `relaid`), and a search proposes
    far more placements than splits (NMT on k80x64: the pairwise
    intersections were a third of the search's time). Ops are immutable
    and hash by identity.
    """
    held = partition.tensor_rects(producer, output, producer_dims)
    needs = [
        partition.input_region(consumer, input_index, rect)
        for rect in partition.part_rects(consumer.output_shape, consumer_dims)
    ]
    rank = len(needs[0])
    holds = np.array([r is not None for r in held])  # else holds nothing
    have = np.array([r or ((0, 0),) * rank for r in held],
                    np.int64).reshape(len(held), rank, 2)
    need = np.array(needs, np.int64).reshape(len(needs), rank, 2)
    whole = np.array(
        [(0, n) for n in consumer.input_shapes[input_index]], np.int64
    ).reshape(rank, 2)
    if not relaid:
        forward = backward = _met(need, have, holds)
    else:
        # Part i of each on one device; one that holds nothing of this
        # output (another rank's, `tensor_rects`) gathers nothing.
        gets = np.where(holds[:, None, None],
                        gathered_region(need, have, whole), need)
        forward = _met(gets, have, holds)
        grads = have
        if _disjoint(need):
            grads = np.where(holds[:, None, None],
                             gathered_region(have, need, whole), have)
        backward = _met(need, grads, holds)
    if not consumer.input_needs_gradient(input_index):
        backward = np.zeros_like(backward)  # the step computes none
    i, j = np.nonzero((forward > 0) | (backward > 0))
    rows = np.stack([i, j, forward[i, j], backward[i, j]], axis=1)
    rows = rows.astype(np.int64).reshape(-1, 4)
    rows.flags.writeable = False  # cached and shared
    return rows


def gathered_region(
    wanted: np.ndarray, local: np.ndarray, whole: np.ndarray
) -> np.ndarray:
    """What DTensor's all-gather relayout brings to a device: per dim,
    the extent the device holds where the rectangle it wants lies inside
    it (that split is kept, the slice is local), the whole dim otherwise
    (the split moves or changes, so that dim is gathered first).
    Rectangles are (..., rank, 2) arrays of (lo, hi)."""
    kept = (wanted[..., 0] >= local[..., 0]) & (wanted[..., 1] <= local[..., 1])
    return np.where(kept[..., None], local, whole)


def _met(a: np.ndarray, b: np.ndarray, holds: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) elements of each `a` rectangle's intersection
    with each `b` rectangle, 0 where `b` holds nothing."""
    extent = np.minimum(a[:, None, :, 1], b[None, :, :, 1]) - (
        np.maximum(a[:, None, :, 0], b[None, :, :, 0])
    )
    meet = (extent > 0).all(axis=2) & holds[None, :]
    return np.where(meet, np.prod(np.maximum(extent, 0), axis=2), 0)


def _disjoint(rects: np.ndarray) -> bool:
    """True if no two of the rectangles share an element."""
    n = len(rects)
    if n < 2:
        return True
    met = _met(rects, rects, np.ones(n, bool))
    np.fill_diagonal(met, 0)
    return not met.any()


def _ring(machine: MachineModel, devices: tuple[int, ...]) -> tuple:
    """(routes, links) of a ring over `devices` in id order."""
    p = len(devices)
    ring = sorted(devices)
    routes = [machine.route(ring[k], ring[(k + 1) % p]) for k in range(p)]
    return routes, tuple(sorted({k for r in routes for k in r.links}))


def ring_allreduce_ms(
    machine: MachineModel, devices: tuple[int, ...], num_bytes: float
) -> tuple[float, tuple[int, ...]]:
    """Ring all-reduce time (ms) over `devices` and the links it holds.

    2(p-1) steps, each moving bytes/p over every ring hop at once; a step
    lasts as long as its slowest hop (latency + bytes/p / bandwidth). A
    machine with a measured all-reduce (`MachineModel.allreduce`: the
    live one) takes that time instead, on the same links.
    """
    routes, links = _ring(machine, devices)
    if machine.allreduce is not None:
        latency_ms, gbps = machine.allreduce
        return latency_ms + num_bytes / (gbps * 1e6), links
    p = len(devices)
    step_ms = max(r.transfer_ms(num_bytes / p) for r in routes)
    return 2 * (p - 1) * step_ms, links


def ring_allgather_ms(
    machine: MachineModel, devices: tuple[int, ...], part_bytes: float
) -> tuple[float, tuple[int, ...]]:
    """Ring all-gather time (ms) over `devices`, each sending a part of
    `part_bytes` to the others, and the links it holds.

    p-1 steps, each moving a part over every ring hop at once; a step
    lasts as long as its slowest hop. A machine with a measured
    all-gather (`MachineModel.allgather`: the live one, whose links are
    fitted to it) takes latency + part / bandwidth instead, on the same
    links.
    """
    routes, links = _ring(machine, devices)
    if machine.allgather is not None:
        latency_ms, gbps = machine.allgather
        return latency_ms + part_bytes / (gbps * 1e6), links
    step_ms = max(r.transfer_ms(part_bytes) for r in routes)
    return (len(devices) - 1) * step_ms, links


def _family_groups(
    family: list[tuple[Op, int, ParallelConfig]],
) -> list[tuple[int, float, dict[int, list[tuple[int, int]]]]]:
    """Weight-sync groups: (group id, bytes, device -> [(op idx, part)]).

    The owner (first) fixes the shards; a sharing op's part joins every
    shard group whose interval of the parameter dim meets its own.
    """
    owner, _, owner_config = family[0]
    degree = partition.parameter_degree(owner, owner_config)
    sharded, replicated = partition.weight_split(owner, degree)
    groups = []
    if sharded > 0:
        for shard in range(degree):
            groups.append((shard, sharded, {}, (shard, shard + 1, degree)))
    if replicated > 0:
        groups.append((degree, replicated, {}, None))
    for op, index, config in family:
        deg = partition.parameter_degree(op, config)
        coords = partition.shard_coords(op, config)
        for part, device in enumerate(config.device_ids):
            lo, hi = coords[part], coords[part] + 1
            for _, _, members, span in groups:
                if span is not None and (
                    lo * span[2] >= span[1] * deg
                    or hi * span[2] <= span[0] * deg
                ):
                    continue
                members.setdefault(device, []).append((index, part))
    return [(g, size, members) for g, size, members, _ in groups]


def family_piece(
    machine: MachineModel,
    cost: CostModel,
    family: list[tuple[Op, int, ParallelConfig]],
    slots: int,
) -> Piece:
    """Weight sync and updates of an owner op and its sharers."""
    b = _Builder()
    owner, owner_index, _ = family[0]
    parts = {index: config.num_parts for _, index, config in family}
    for group, size, members in _family_groups(family):
        devices = tuple(sorted(members))
        sources = [(i, parts[i] + k) for d in devices for i, k in members[d]]
        sync = None
        if len(devices) > 1:
            ms, links = ring_allreduce_ms(machine, devices, size)
            sync = b.task(
                ms, machine.link_resources(links),
                priority(owner_index, SYNC, group),
                (SYNC, owner.name, f"shard {group} over {devices}"),
            )
            b.deps += [(i, k, SELF, sync) for i, k in sources]
            b.comm += 2.0 * (len(devices) - 1) * size
        for device in devices:  # sorted: priorities ascend
            ms = cost.update_ms(size, slots, device)
            t = b.task(
                ms, (machine.compute_resource(device),),
                priority(owner_index, UPDATE, group, device),
                (UPDATE, owner.name, f"shard {group}"),
            )
            b.busy.append((device, ms))
            b.memory.append((device, size * (2 + slots)))
            if sync is None:
                b.deps += [(i, k, SELF, t) for i, k in sources]
        if sync is not None:
            # Updates wait for the sync alone and wake nothing: one
            # queue entry for all of them (see `Piece.riders`).
            b.deps.append((SELF, sync, SELF, sync + 1))
            b.riders.append((sync + 1, len(devices) - 1))
    for op, _, config in family:
        degree = partition.parameter_degree(op, config)
        frozen = partition.frozen_weight_bytes(op, degree)
        if frozen and op is owner:
            b.memory += [(d, frozen) for d in config.device_ids]
    return b.piece()


def families(graph: OpGraph) -> dict[str, list[str]]:
    """Owner op name -> [owner, sharers...] for ops with weights."""
    found: dict[str, list[str]] = {}
    for op in graph:
        if op.shares_weights_with:
            found.setdefault(op.shares_weights_with, []).append(op.name)
        elif op.weights:
            found.setdefault(op.name, []).insert(0, op.name)
    return found
