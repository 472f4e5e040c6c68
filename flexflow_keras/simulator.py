"""Execution simulator from the FlexFlow paper, made exact and fast.

Turns an `OpGraph`, a `Strategy` and a `MachineModel` into a task graph
(`taskgraph.py`: forward/backward tasks per op part, transfers between
intersecting parts, ring all-reduce of replicated weight shards, update
tasks) and list-schedules it: devices and links are serial resources;
tasks start in order of ready time, ties broken by a canonical priority,
each as soon as its predecessors are done and all its resources free.
The makespan is the step time. Imports no TensorFlow.

Delta simulation (`start` / `propose` / `accept`): the task graph is a
list of pieces, each a function of one to a few op configs and cached by
them; a proposal rebuilds only the pieces of the changed op (its op
piece, its in and out edges, its weight family), swaps them into the
flat task lists (`schedule.Compiled.replace`) and re-runs the schedule
after the last pop of the previous run that provably precedes every
changed task (`schedule.Schedule.rerun`). Same pieces, same priorities,
same arithmetic: the result is bit for bit the full simulation's.
"""

import collections
import dataclasses
import math
from typing import NamedTuple

from flexflow_keras import taskgraph
from flexflow_keras.cost import CostModel
from flexflow_keras.graph import OpGraph
from flexflow_keras.machine import MachineModel
from flexflow_keras.schedule import Compiled, Schedule, no_gc
from flexflow_keras.mesh_space import MeshSpec
from flexflow_keras.search_space import mesh_key
from flexflow_keras.strategy import (
    ParallelConfig, Strategy, validate_config,
)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of simulating one training step.

    Args:
        step_ms: Simulated makespan of one step plus the machine's fixed
            `step_overhead_ms`, in ms. Computed (finite) also when the
            strategy is infeasible.
        busy_ms: Per device, ms of compute tasks (forward, backward,
            update).
        comm_bytes: Bytes over links: activations and their gradients
            between parts, plus 2(p-1) * shard bytes per ring all-reduce.
        peak_memory_bytes: Per device: weights, gradients and optimizer
            slots of the shards it holds, plus the activations it keeps
            for backward (outputs of its parts, inputs it received). All
            of these are alive at the forward/backward turn, the peak.
        feasible: False when some device's peak exceeds its memory.
    """

    step_ms: float
    busy_ms: tuple[float, ...]
    comm_bytes: float
    peak_memory_bytes: tuple[int, ...]
    feasible: bool


class _Simulated(NamedTuple):
    """One simulated strategy: what a delta simulation starts from."""

    configs: dict[str, ParallelConfig]  # op name -> config
    pieces: list[taskgraph.Piece]  # one per task-graph slot
    compiled: Compiled  # the pieces as flat task arrays
    schedule: Schedule  # its list schedule (for reruns)


class Simulator:
    """Simulates strategies of one graph on one machine.

    Args:
        graph: The model's `OpGraph`.
        machine: The `MachineModel` strategies are placed on.
        cost_model: Op costs; None: measured for a live machine,
            analytic otherwise.
        optimizer_slots: Variables per weight the optimizer keeps: 0 for
            SGD, 1 for momentum, 2 for Adam, 3 for AMSGrad or centered
            RMSprop with momentum.
        between_meshes: How a move between two meshes is priced:
            "regions", as the layer-by-layer executor copies it, or
            "replicated", as one DTensor function would
            (`taskgraph.replicated_pairs`; `bench/one_function_bench.py`).
    """

    def __init__(
        self,
        graph: OpGraph,
        machine: MachineModel,
        cost_model: CostModel | None = None,
        optimizer_slots: int = 0,
        between_meshes: str = "regions",
    ):
        taskgraph.check_between_meshes(between_meshes)
        if not isinstance(optimizer_slots, int) or optimizer_slots < 0:
            raise ValueError(
                "`optimizer_slots` must be an int >= 0 (0 for SGD, 1 for "
                "momentum, 2 for Adam). Received: "
                f"optimizer_slots={optimizer_slots!r}"
            )
        self.graph, self.machine = graph, machine
        self.cost = cost_model or CostModel(machine)
        self.slots = optimizer_slots
        self.between_meshes = between_meshes
        self._ops = graph.ops
        self._index = {op.name: i for i, op in enumerate(self._ops)}
        self._families = taskgraph.families(graph)
        self._layout = _Layout(graph, self._index, self._families)
        self._cache = _PieceCache(PIECE_CACHE_TASKS)
        self._state: _Simulated | None = None  # started or accepted
        self._proposal: _Simulated | None = None  # the last propose()

    # Full simulation -------------------------------------------------

    def simulate(self, strategy: Strategy) -> SimResult:
        """Full simulation of `strategy`; keeps no state."""
        with no_gc():
            return self._result(self._full(strategy))

    def start(self, strategy: Strategy) -> SimResult:
        """Full simulation that becomes the base of delta simulations."""
        with no_gc():
            self._state = self._full(strategy)
            self._proposal = None
            return self._result(self._state)

    # Delta simulation ------------------------------------------------

    def propose(self, op_name: str, config: ParallelConfig) -> SimResult:
        """The current strategy with one op's config changed; no commit."""
        return self.propose_many({op_name: config})

    def propose_many(self, changes: dict[str, ParallelConfig]) -> SimResult:
        """The current strategy with several ops' configs changed (e.g. the
        calls of one shared layer, which run alike); no commit."""
        if self._state is None:
            raise ValueError(
                "Call `start(strategy)` before `propose()`. "
                f"Received: changes to {sorted(changes)} with no started "
                "strategy."
            )
        state = self._state
        for op_name, config in changes.items():
            self._check_config(self.graph.op(op_name), config)
        new_configs = dict(state.configs)
        new_configs.update(changes)
        touched = self._layout.touched
        changed = tuple(sorted({k for n in changes for k in touched[n]}))
        with no_gc():
            new_pieces = list(state.pieces)
            for k in changed:
                new_pieces[k] = self._piece(
                    self._layout.slots[k], new_configs
                )
            new_compiled = state.compiled.replace(new_pieces, changed)
            self._proposal = _Simulated(
                new_configs, new_pieces, new_compiled,
                state.schedule.rerun(new_compiled),
            )
            return self._result(self._proposal)

    def accept(self) -> None:
        """Makes the last proposal the current strategy."""
        if self._proposal is None:
            raise ValueError(
                "No proposal to accept: call `propose()` first. "
                "Received: accept() after start() or accept()."
            )
        self._state, self._proposal = self._proposal, None
        compiled = self._state.compiled
        if compiled.num_ids > 2 * compiled.num_live + 256:
            # Killed ids pile up over accepts; lay the graph out afresh.
            with no_gc():
                self._state = self._full(Strategy(self._state.configs))

    @property
    def strategy(self) -> Strategy | None:
        """The current (started or accepted) strategy."""
        return None if self._state is None else Strategy(self._state.configs)

    @property
    def num_tasks(self) -> int:
        """Tasks in the current strategy's task graph (0 before start)."""
        return 0 if self._state is None else self._state.compiled.num_tasks

    def timeline(self, strategy: Strategy | None = None) -> dict:
        """Chrome trace-event JSON of a strategy (default: current)."""
        from flexflow_keras import trace

        if strategy is None:
            if self._state is None:
                raise ValueError(
                    "No strategy to trace. Received: strategy=None "
                    "before start()."
                )
            strategy = Strategy(self._state.configs)
        with no_gc():
            full = self._full(strategy)
        return trace.chrome_trace(self.machine, full.compiled, full.schedule)

    # Internals -------------------------------------------------------

    def _full(self, strategy: Strategy) -> "_Simulated":
        configs = self._check(strategy)
        pieces = [self._piece(k, configs) for k in self._layout.slots]
        compiled = Compiled.build(
            pieces, self._layout.op_slots, self.machine.num_devices
        )
        schedule = Schedule.run(compiled, self._num_resources())
        return _Simulated(configs, pieces, compiled, schedule)

    def _num_resources(self) -> int:
        return self.machine.num_devices + len(self.machine.links)

    def _piece(self, slot: "_Slot", configs: dict) -> taskgraph.Piece:
        key = slot + tuple(configs[n] for n in self._layout.reads[slot])
        piece = self._cache.get(key)
        if piece is None:
            piece = self._build(slot, configs)
            self._cache.put(key, piece)
        return piece

    def _build(self, slot: "_Slot", configs: dict) -> taskgraph.Piece:
        name = slot.name
        op, i = self.graph.op(name), self._index[name]
        if slot.kind == "op":
            return taskgraph.op_piece(
                op, i, configs[name], self.cost, self.machine
            )
        if slot.kind == "edge":
            producer = self.graph.op(slot.producer)
            return taskgraph.edge_piece(
                self.machine, producer, self._index[slot.producer],
                configs[slot.producer], op, i, configs[name],
                slot.input_index, self.between_meshes,
            )
        family = [
            (self.graph.op(n), self._index[n], configs[n])
            for n in self._families[name]
        ]
        return taskgraph.family_piece(
            self.machine, self.cost, family, self.slots
        )

    def _result(self, simulated: "_Simulated") -> SimResult:
        configs, _, compiled, schedule = simulated
        busy = tuple(float(x) for x in compiled.busy_ms())
        peak = tuple(int(math.ceil(m)) for m in compiled.memory_bytes())
        feasible = all(
            p <= d.memory_bytes for p, d in zip(peak, self.machine.devices)
        )
        step_ms = schedule.step_ms + self.machine.step_overhead_ms
        if self.machine.live:
            mesh = MeshSpec.of(configs, self.machine.num_devices)
            if mesh is not None:
                step_ms += self._replicated_ms(configs, mesh)
            else:
                step_ms += self._several_meshes_ms(configs)
        return SimResult(
            step_ms, busy, compiled.comm_bytes, peak, feasible,
        )

    def _replicated_ms(self, configs: dict, mesh: MeshSpec) -> float:
        """What the runtime pays beyond the task graph for the copies of
        a mesh strategy (`mesh_space`): an op whose block spans part of
        the mesh runs on every device of it, `copies` blocks computing
        the same parts and updating their own copies of the weights,
        where the task graph has one block. On `g` compute resources the
        mesh's `n` parts of the op take `n / g` rounds of one part where
        the task graph counts `p / min(p, g)` for the block's `p`: the
        difference is added (nothing on devices that compute at once;
        an unsplit op on `n` virtual CPU devices costs `n - 1` more)."""
        groups = min(self.machine.compute_groups or mesh.size, mesh.size)
        extra = 0.0
        for op in self._ops:
            config = configs[op.name]
            parts = len(config.device_ids)
            rounds = mesh.size / groups - parts / min(parts, groups)
            if rounds <= 0:
                continue
            forward_ms, backward_ms = self.cost.op_cost(op, config, 0)
            extra += rounds * (forward_ms + backward_ms)
            if op.trainable_weight_bytes and not op.shares_weights_with:
                param = op.parameter_dim
                shards = 1 if param is None else config.dims[param]
                extra += rounds * self.cost.update_ms(
                    op.trainable_weight_bytes / shards, self.slots, 0
                )
        return extra

    def _several_meshes_ms(self, configs: dict) -> float:
        """What the runtime pays beyond the task graph for a strategy over
        several meshes (`runtime/step.py`): one forward and one backward
        function per segment (consecutive ops on one mesh), the gather of
        the outputs and the loss function, and into each segment after
        the first one call of the compiled copy function that brings its
        inputs from another mesh and one that sends their gradients back
        (`runtime/moves.py`; their pieces are tasks, priced by
        `MachineModel.copy`): each call `MachineModel.call_overhead_ms`,
        less the one `step_overhead_ms` holds; and every backward
        recomputes its forward (added on the busiest compute resource:
        exact when the devices share one, as virtual CPU devices do)."""
        meshes = [mesh_key(configs[op.name]) for op in self._ops]
        segments = 1 + sum(a != b for a, b in zip(meshes, meshes[1:]))
        recompute: dict[int, float] = collections.defaultdict(float)
        for op in self._ops:
            config = configs[op.name]
            for device in config.device_ids:
                forward_ms, _ = self.cost.op_cost(op, config, device)
                recompute[self.machine.compute_resource(device)] += forward_ms
        functions = 2 * segments + 2  # each segment's two; gather; loss
        copies = 2 * (segments - 1)
        # One call is the step's own, in `step_overhead_ms`.
        calls = (functions + copies - 1) * self.machine.call_overhead_ms
        return calls + max(recompute.values(), default=0.0)

    def _check(self, strategy: Strategy) -> dict[str, ParallelConfig]:
        missing = [op.name for op in self._ops if op.name not in strategy]
        if missing:
            raise ValueError(
                "The strategy has no config for some ops. Received: "
                f"missing={missing[:5]}. Give every op a ParallelConfig."
            )
        for op in self._ops:
            self._check_config(op, strategy[op.name])
        return {op.name: strategy[op.name] for op in self._ops}

    def _check_config(self, op, config: ParallelConfig) -> None:
        validate_config(op, config, self.machine.num_devices)


# Tasks the piece cache holds at most: a few hundred bytes each (labels,
# resources, memoized rows), so ~100-200 MB; the walk of
# `bench/simulator_bench.py` on InceptionV3 needs ~300,000.
PIECE_CACHE_TASKS = 500_000


class _PieceCache:
    """Least recently used pieces, bounded by their total task count.

    Pieces are pure functions of their key, so evicting one only costs
    a rebuild; results stay exact. Unbounded, a random search on
    InceptionV3 (16 devices) held gigabytes of pieces.
    """

    def __init__(self, max_tasks: int):
        self.max_tasks = max_tasks
        self.num_tasks = 0
        self._pieces: collections.OrderedDict[tuple, taskgraph.Piece] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._pieces)

    def get(self, key: tuple) -> taskgraph.Piece | None:
        piece = self._pieces.get(key)
        if piece is not None:
            self._pieces.move_to_end(key)
        return piece

    def put(self, key: tuple, piece: taskgraph.Piece) -> None:
        self._pieces[key] = piece
        self.num_tasks += 1 + len(piece.durations_ms)
        while self.num_tasks > self.max_tasks and len(self._pieces) > 1:
            _, old = self._pieces.popitem(last=False)
            self.num_tasks -= 1 + len(old.durations_ms)


class _Slot(NamedTuple):
    """One piece of the task graph: an op's forwards and backwards
    (`op`), the transfers of input `input_index` of op `name` from
    `producer` (`edge`), or the weight syncs and updates of the family
    `name` owns (`family`)."""

    kind: str
    name: str
    producer: str | None = None
    input_index: int = 0


class _Layout:
    """Which pieces exist, which configs each reads, which an op touches.

    `slots`: op slots first (one per op, in graph order), then edges,
    then families; `reads[slot]` are the op names whose configs the
    piece depends on; `touched[name]` the slot indices to rebuild when
    that op's config changes.
    """

    def __init__(self, graph: OpGraph, index: dict, families: dict):
        slots: list[_Slot] = []
        reads: dict[_Slot, tuple[str, ...]] = {}
        for op in graph:
            slots.append(_Slot("op", op.name))
            reads[slots[-1]] = (op.name,)
        for op in graph:
            for k, tensor in enumerate(op.inputs):
                producer = graph.producer(tensor)
                if producer is not None:
                    slots.append(_Slot("edge", op.name, producer.name, k))
                    reads[slots[-1]] = (producer.name, op.name)
        for owner, members in families.items():
            slots.append(_Slot("family", owner))
            reads[slots[-1]] = tuple(members)
        self.slots = slots
        self.reads = reads
        self.op_slots = list(range(len(graph)))  # op slots come first
        touched: dict[str, list[int]] = {op.name: [] for op in graph}
        for k, slot in enumerate(slots):
            for name in reads[slot]:
                touched[name].append(k)
        self.touched = {n: tuple(ks) for n, ks in touched.items()}
        del index
