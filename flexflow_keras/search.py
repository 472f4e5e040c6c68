"""MCMC search over strategies, as in FlexFlow (MLSys'19, section 6),
after one greedy sweep.

Starts from data parallelism, or from the fastest of the `candidates`
given (`compile()` passes the model's expert strategy, `experts.py`).

The sweep: op after op, those with the most trainable weight bytes
first (graph order among equals), each tries every degree split it can
take on the first devices (`search_space.sweep_configs`), and a faster
strategy is kept at once. It stops after `sweep` (default half) of the
budget: small graphs' sweeps end well before (AlexNet's 92 configs),
large ones' do not (Inception-v3's 5,941), which is why the heavy ops go
first: their weight syncs are what a split other than data parallelism
saves. Then each group of alike ops (`search_space.twin_groups`: a
model's repeated layers) tries every config at once, which finds splits
that pay only together (NMT's two embeddings on one 2 x 32 mesh).
Why a sweep: MCMC's single random proposals, each accepted on its own,
settle in a nearby local optimum where trying all of one op's splits in
turn finds the basin (NMT's embeddings split 2-D over all
devices rather than moved to one device). On the benchmark suite, with
the chain after it, MCMC went from behind greedy search on 5 of 12
cases to ahead of or level with it on every one (docs/SEARCH.md).

Then FlexFlow's chain, for the rest of the budget: each iteration picks
a random op and a random valid config for it
(`search_space.random_config`), scores the changed strategy with the
simulator's delta simulation, and accepts it if faster, else with
probability `exp(-relative_alpha * (next_ms - cur_ms) / cur_ms)` (or
FlexFlow's per-ms rule, `exp(-alpha * (next_ms - cur_ms))`, when `alpha`
is given); the best strategy seen is kept. `sweep=0` is FlexFlow's plain
MCMC.

Why relative by default: FlexFlow's alpha 0.05 per ms accepts a
proposal 10 ms slower 60% of the time, so on 40-150 ms steps the chain
is close to a random walk, and on 2 ms steps it never leaves a local
optimum. A rule on the relative change behaves alike at every scale.

As in FlexFlow's `FFModel::optimize`, the chain restarts from the best
strategy every `budget / 100` iterations (at least 1, at most 1000).
Every proposal of either phase is one iteration of the budget.
Infeasible proposals (over a device's memory) are rejected. Ctrl-C
ends the search early and keeps the best.

The calls of a shared layer (`search_space.weight_ties`) change config
together, as the runtime runs them.

Python only: the simulator is any object with FlexFlow's interface,
`start(strategy)`, `propose(op_name, config)` (not committed) and
`accept()`, each returning a result with `step_ms` and `feasible`, plus
`propose_many({op_name: config})` for graphs with shared layers or alike
ops.
"""

import dataclasses
import math
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from flexflow_keras.graph import OpGraph
from flexflow_keras.mesh_space import (
    MeshSpec, mesh_configs, mesh_data_parallel, mesh_shapes,
)
from flexflow_keras.report import batch_split, search_report
from flexflow_keras.schedule import no_gc
from flexflow_keras.search_space import (
    random_config, sweep_configs, tie_shared, twin_groups, weight_ties,
)
from flexflow_keras.strategy import ParallelConfig, Strategy, validate_config

PROGRESS_EVERY = 100
# `progress(iterations, best_ms, data_parallel_ms, done)`: how a search
# shows its progress (the planner's Keras progress bar); `done` on its
# last call.
Progress = Callable[[int, float, float, bool], None]
# Default acceptance factor on the relative change: a proposal 1% slower
# is accepted with probability exp(-0.01 * RELATIVE_ALPHA). Chosen on the
# benchmark suite (bench/search_bench.py --tune; docs/SEARCH.md).
RELATIVE_ALPHA = 100.0
# Most of the budget the first sweep may use. Chosen on the benchmark
# suite (bench/search_bench.py --sweep; docs/SEARCH.md): 9 of its 12
# cases end their sweep below it; the large graphs use it all.
SWEEP_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What one search found.

    Args:
        strategy: The best strategy found.
        best_ms: Its simulated step time (ms).
        data_parallel_ms: Simulated step time of data parallelism (ms),
            `Strategy.data_parallel` (a batch the devices do not divide
            split as far as it divides, other dims for the rest);
            `inf` when data parallelism does not fit in memory.
        iterations: Iterations run (fewer than the budget if stopped).
        accepted: Proposals accepted.
        wall_s: Wall time of the search (s).
        interrupted: True when Ctrl-C ended it.
        seed: The seed used (drawn when None was given).
        one_device_ms: Simulated step time of every op on device 0 (ms),
            which the search does not propose (see `search`).
        batch_split: (batch size, parts its batch splits into under
            data parallelism, devices); fewer parts than devices where
            the batch does not divide, so the report says that its
            "data parallelism" splits other dims too. None: not known.
    """

    strategy: Strategy
    best_ms: float
    data_parallel_ms: float
    iterations: int
    accepted: int = 0
    wall_s: float = 0.0
    interrupted: bool = False
    seed: int | None = None
    one_device_ms: float = math.nan
    batch_split: tuple[int, int, int] | None = None

    @property
    def speedup(self) -> float:
        """Data-parallel step time over the best step time."""
        if self.best_ms <= 0 or math.isinf(self.best_ms):
            return float("nan")
        return self.data_parallel_ms / self.best_ms


def _ms(result: Any) -> float:
    if not getattr(result, "feasible", True):
        return math.inf
    return float(result.step_ms)


def search(
    graph: OpGraph,
    simulator: Any,
    num_devices: int,
    budget: int,
    alpha: float | None = None,
    seed: int | None = None,
    verbose: int = 1,
    initial: Strategy | None = None,
    print_fn: Callable[[str], None] | None = None,
    reset_every: int | None = None,
    propagation: float = 0.0,
    one_mesh_parts: int | None = None,
    relative_alpha: float = RELATIVE_ALPHA,
    candidates: tuple[Strategy, ...] = (),
    sweep: float = SWEEP_SHARE,
    mesh: MeshSpec | None = None,
    progress: "Progress | None" = None,
    choices: dict[str, list[ParallelConfig]] | None = None,
) -> SearchResult:
    """Runs FlexFlow's MCMC search for `budget` iterations.

    Args:
        graph: The model's `OpGraph`.
        simulator: A simulator of `graph` on the machine (see module
            docstring for the interface).
        num_devices: Devices of the machine (ids 0..n-1).
        budget: Iterations; 0 returns data parallelism.
        alpha: FlexFlow's temperature factor per ms: a proposal slower
            by d ms is accepted with probability exp(-alpha * d). None
            (default): the relative rule with `relative_alpha`.
        seed: Seed for the proposals; the same seed, graph and simulator
            give the same result. None draws one.
        verbose: 0 silent; 1 the best strategy at the end (and
            `progress`, e.g. the planner's Keras progress bar); 2 also
            FlexFlow's lines every 100 iterations.
        initial: Start strategy; data parallelism when None.
        print_fn: Where lines go; `print` when None.
        reset_every: Restart the chain from the best strategy every this
            many iterations; None: FlexFlow's `budget // 100` clipped to
            1..1000; 0: never.
        propagation: Chance that a proposal copies a neighbour op's
            config instead of drawing a random one (FlexFlow's
            `use_propagation` uses 0.7); 0 is the plain search.
        one_mesh_parts: Shorthand for `mesh=MeshSpec.first((k,))`: the
            1-D mesh of devices `0..k-1`.
        progress: Called every 100 iterations and at the end with the
            iterations so far, the best and the data-parallel step time
            (`Progress`), whatever `verbose` says.
        mesh: Search only strategies on this one N-D mesh
            (`mesh_space.mesh_configs`: each op's split dims on distinct
            axes), starting from `mesh_data_parallel`; for models that
            run their own training step (`search_meshes` chooses the
            mesh). None: the whole SOAP space.
        choices: Search only these configs, per op name (every op
            named), starting from each op's first unless `initial` is
            given; `mesh` is the case of one mesh's configs. Not with
            `mesh`.
        relative_alpha: Without `alpha`, a proposal slower by a
            fraction r of the current step is accepted with probability
            exp(-relative_alpha * r).
        candidates: Other start points (expert strategies, say): the
            search starts from the fastest of them and the usual start.
        sweep: Share of the budget (0..1) the first sweep may use (see
            the module docstring); 0: FlexFlow's plain MCMC.

    A strategy that puts every op on one device is never proposed, nor
    started from (a candidate such as an RNN model's expert placement
    can be one), when there are several: that is plain Keras on one
    device, which needs no search, and where the simulator finds it
    faster (virtual CPU devices share the host's cores: no split can
    speed a step up), the report says so (`SearchResult.one_device_ms`).

    Returns:
        A `SearchResult`.
    """
    if budget < 0:
        raise ValueError(
            f"`budget` must be >= 0. Received: budget={budget}"
        )
    if alpha is not None and alpha < 0:
        raise ValueError(f"`alpha` must be >= 0. Received: alpha={alpha}")
    if relative_alpha < 0:
        raise ValueError(
            "`relative_alpha` must be >= 0. "
            f"Received: relative_alpha={relative_alpha}"
        )
    if not 0 <= sweep <= 1:
        raise ValueError(
            f"`sweep` must be between 0 and 1. Received: sweep={sweep}"
        )
    out = print_fn or _print
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    data_parallel = Strategy.data_parallel(graph, num_devices)
    if one_mesh_parts is not None and mesh is None:
        mesh = MeshSpec.first((one_mesh_parts,))
    if mesh is not None and choices is not None:
        raise ValueError("Pass `mesh` or `choices`, not both.")
    if mesh is not None:
        choices = {op.name: mesh_configs(op, mesh) for op in graph.ops}
        if initial is None:
            initial = mesh_data_parallel(graph, mesh)
    if choices is not None:
        missing = [op.name for op in graph.ops if not choices.get(op.name)]
        if missing:
            raise ValueError(
                "`choices` must give configs for every op. Received none "
                f"for: {missing}"
            )
        if initial is None:
            initial = Strategy({op.name: choices[op.name][0]
                                for op in graph.ops})
    current = data_parallel if initial is None else initial
    current.validate(graph, num_devices)
    current, _ = tie_shared(graph, current)
    ties = weight_ties(graph)
    start = time.perf_counter()
    if initial is None:
        data_parallel_ms = cur_ms = _ms(simulator.start(current))
    else:
        data_parallel_ms = _ms(simulator.simulate(data_parallel))
        cur_ms = _ms(simulator.start(current))
    for candidate in candidates:
        candidate.validate(graph, num_devices)
        candidate, _ = tie_shared(graph, candidate)
        if num_devices > 1 and _DeviceUse(graph, candidate).single:
            continue  # not a proposal either (`_Stepper.try_config`)
        candidate_ms = _ms(simulator.simulate(candidate))
        if candidate_ms < cur_ms:
            current, cur_ms = candidate, _ms(simulator.start(candidate))
    chain = _Chain(current, cur_ms)
    if reset_every is None:
        reset_every = min(max(budget // 100, 1), 1000)
    ops = graph.ops

    def weight_order(names: tuple[str, ...]) -> int:
        """Sweep order: the most trainable weight bytes first (a stable
        sort keeps graph order among equals)."""
        return -graph.op(names[0]).trainable_weight_bytes

    mesh_choices = choices or {}
    used = _DeviceUse(graph, current) if num_devices > 1 else None
    step = _Stepper(chain, simulator, used, alpha, relative_alpha, rng,
                    out if verbose >= 2 else None,
                    None if progress is None else
                    lambda: progress(chain.iterations, chain.best_ms,
                                     data_parallel_ms, False))
    interrupted = False
    # Python's cyclic GC paused for the chain: proposals allocate
    # millions of tuples that hold no cycles, and the collections
    # they set off walked every cached piece between proposals.
    with no_gc():
        try:
            # The sweep (module docstring): each op tries its degree splits
            # (`sweep_configs`, or its one-mesh configs); a faster one is
            # kept at once, so the op ends on its fastest (all proposals for
            # one op change that op alone). At most `sweep` of the budget.
            limit = int(budget * sweep)
            singles = [ties.get(op.name, (op.name,)) for op in ops]
            # A shared layer's later calls take their owner's turn.
            singles = [names for op, names in zip(ops, singles)
                       if names[0] == op.name]
            # Then the twins together (`twin_groups`), heaviest first.
            for names in [*sorted(singles, key=weight_order),
                          *sorted(twin_groups(graph), key=weight_order)]:
                if chain.iterations >= limit:
                    break
                op = graph.op(names[0])
                choices = mesh_choices.get(op.name) or sweep_configs(
                    op, num_devices
                )
                for config in choices:
                    if chain.iterations >= limit:
                        break
                    step.try_config(names, config, greedy=True)
            # FlexFlow's chain, for the rest of the budget.
            while chain.iterations < budget:
                if reset_every and (chain.iterations + 1) % reset_every == 0:
                    step.restart()
                op = ops[rng.randrange(len(ops))]
                names = ties.get(op.name, (op.name,))
                config = None
                if propagation and rng.random() < propagation:
                    config = _neighbour_config(graph, op, chain.current,
                                               num_devices, rng)
                    if mesh_choices and config not in mesh_choices[op.name]:
                        config = None
                if config is None and mesh_choices:
                    choices = mesh_choices[op.name]
                    config = choices[rng.randrange(len(choices))]
                elif config is None:
                    config = random_config(op, num_devices, rng)
                if not step.try_config(names, config, greedy=False):
                    step.count(chain.cur_ms)  # not proposed: same iteration
        except KeyboardInterrupt:
            interrupted = True
            if verbose:
                out(f"Search interrupted after {chain.iterations} iterations; "
                    "keeping the best strategy found so far.")
    one_device_ms = math.nan
    if used is not None:
        one_device_ms = _ms(simulator.simulate(Strategy.data_parallel(
            graph, 1  # every op whole on device 0, for any batch
        )))
    result = SearchResult(
        strategy=chain.best,
        best_ms=chain.best_ms,
        data_parallel_ms=data_parallel_ms,
        iterations=chain.iterations,
        accepted=chain.accepted,
        wall_s=time.perf_counter() - start,
        interrupted=interrupted,
        seed=seed,
        one_device_ms=one_device_ms,
        # As the baseline split it (`data_parallel_config`'s rule).
        batch_split=batch_split(graph.batch_size, data_parallel,
                                num_devices),
    )
    if progress is not None:
        progress(chain.iterations, chain.best_ms, data_parallel_ms, True)
    if verbose:
        out(search_report(result))
    return result


def search_meshes(
    graph: OpGraph,
    simulator: Any,
    num_devices: int,
    budget: int,
    meshes: tuple[MeshSpec, ...] | None = None,
    seed: int | None = None,
    verbose: int = 1,
    print_fn: Callable[[str], None] | None = None,
    progress: Progress | None = None,
    **options: Any,
) -> SearchResult:
    """The search for a model that runs its own step: one N-D mesh.

    Such a step runs as one DTensor function on one mesh
    (`mesh_space`), so the mesh's shape is a choice of the whole
    strategy. Every shape first gets an equal share of half the budget
    (`SWEEP_SHARE`) for its own sweep from its data parallelism, heaviest
    ops first; the fastest shape then gets the rest: a sweep and
    FlexFlow's chain from its best strategy (`search`).

    Args:
        meshes: The meshes to weigh; None: every shape of
            `mesh_space.mesh_shapes(num_devices)` over all devices.
        progress: As `search`'s, counting both phases' iterations.
        options: Passed on to `search` (`alpha`, `relative_alpha`, ...).

    Returns:
        A `SearchResult` counting every iteration of both phases.
    """
    if meshes is None:
        meshes = tuple(MeshSpec.first(s) for s in mesh_shapes(num_devices))
    if not meshes:
        raise ValueError("`meshes` must name at least one mesh.")
    out = print_fn or _print
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    start = time.perf_counter()
    share = int(budget * SWEEP_SHARE) // len(meshes) if budget else 0
    done_before = [0]  # iterations of the searches already ended
    best_before = [math.inf]

    def phase_progress() -> Progress | None:
        if progress is None:
            return None

        def shown(iterations, best_ms, data_parallel_ms, done):
            best_ms = min(best_ms, best_before[0])
            progress(done_before[0] + iterations, best_ms,
                     data_parallel_ms, False)
            if done:
                done_before[0] += iterations
                best_before[0] = best_ms

        return shown

    first = []
    for each in meshes:
        first.append((search(graph, simulator, num_devices, share,
                             seed=seed, verbose=0, mesh=each, sweep=1.0,
                             progress=phase_progress(), **options), each))
    best, mesh = min(first, key=lambda pair: pair[0].best_ms)
    if verbose > 1:
        for result, each in first:
            out(f"mesh {each.shape}: {result.best_ms:.2f} ms after "
                f"{result.iterations} iterations")
    rest = budget - sum(result.iterations for result, _ in first)
    final = search(
        graph, simulator, num_devices, max(rest, 0), seed=seed,
        verbose=0, initial=best.strategy, mesh=mesh,
        progress=phase_progress(), **options,
    )
    if final.best_ms > best.best_ms:
        final = dataclasses.replace(
            final, strategy=best.strategy, best_ms=best.best_ms
        )
    result = dataclasses.replace(
        final,
        data_parallel_ms=first[0][0].data_parallel_ms,
        iterations=final.iterations + sum(r.iterations for r, _ in first),
        accepted=final.accepted + sum(r.accepted for r, _ in first),
        wall_s=time.perf_counter() - start,
        seed=seed,
    )
    if progress is not None:
        progress(result.iterations, result.best_ms,
                 result.data_parallel_ms, True)
    if verbose:
        # The mesh the strategy runs on (`MeshSpec.of`, as the runtime and
        # the simulator read it): the shape searched on may hold it as
        # one block, its copies never run (keras.io's PixelCNN, searched
        # on 2 x 2 with every op on devices 0, 1, runs on the 1-D mesh of
        # those two; the report named the 2 x 2 mesh).
        runs_on = MeshSpec.of(result.strategy, num_devices) or mesh
        out(f"Mesh {runs_on.shape} over {_devices_text(runs_on.devices)} "
            f"(of {len(meshes)} shapes weighed)")
        out(search_report(result))
    return result


def _devices_text(devices: tuple[int, ...]) -> str:
    """"devices 0..3" for a run from 0, else "devices 2, 3"."""
    if len(devices) > 1 and devices == tuple(range(len(devices))):
        return f"devices 0..{len(devices) - 1}"
    if len(devices) == 1:
        return f"device {devices[0]}"
    return "devices " + ", ".join(map(str, devices))


@dataclasses.dataclass
class _Chain:
    """The search's state. A field changes only after the simulator has
    committed the change, so Ctrl-C anywhere leaves them consistent."""

    current: Strategy
    cur_ms: float
    best: Strategy | None = None
    best_ms: float = math.inf
    iterations: int = 0
    accepted: int = 0

    def __post_init__(self):
        self.best, self.best_ms = self.current, self.cur_ms


class _Stepper:
    """One iteration of either phase: a config proposed for a group of
    tied ops, scored by delta simulation, accepted or not, counted."""

    def __init__(
        self, chain: _Chain, simulator: Any, used: "_DeviceUse | None",
        alpha: float | None, relative_alpha: float, rng: random.Random,
        out: Callable[[str], None] | None,
        tick: Callable[[], None] | None = None,
    ):
        self.chain, self.simulator = chain, simulator
        self.used, self.rng, self.out = used, rng, out
        self.tick = tick
        self.alpha, self.relative_alpha = alpha, relative_alpha

    def try_config(
        self, names: tuple[str, ...], config: Any, greedy: bool
    ) -> bool:
        """Proposes `config` for the ops `names` (one iteration); accepts
        it by the Metropolis rule, or only when faster if `greedy`.

        Returns False, counting nothing, when it is no proposal: the
        current config, or one that would leave one device in use (see
        `search`)."""
        chain, used = self.chain, self.used
        current = chain.current
        if all(current[name] == config for name in names) or (
            used is not None and used.one_device_after(current, names, config)
        ):
            return False
        if len(names) == 1:
            next_ms = _ms(self.simulator.propose(names[0], config))
        else:  # a shared layer's calls, or twins, change together
            next_ms = _ms(self.simulator.propose_many(
                {name: config for name in names}
            ))
        if greedy:
            accept = next_ms < chain.cur_ms
        else:
            accept = _accept(next_ms, chain.cur_ms, self.alpha,
                             self.relative_alpha, self.rng)
        if accept:
            self.simulator.accept()
            for name in names:
                if used is not None:
                    used.replace(name, current[name], config)
                current = current.replace(name, config)
            chain.current, chain.cur_ms = current, next_ms
            chain.accepted += 1
            if next_ms < chain.best_ms:
                chain.best, chain.best_ms = current, next_ms
        self.count(next_ms)
        return True

    def count(self, next_ms: float) -> None:
        """Ends an iteration; FlexFlow's progress line every 100."""
        chain = self.chain
        chain.iterations += 1
        if chain.iterations % PROGRESS_EVERY:
            return
        if self.tick is not None:
            self.tick()
        if self.out is not None:
            self.out(
                f"iter({chain.iterations}) cur({chain.cur_ms:.2f}) "
                f"next({next_ms:.2f}) best({chain.best_ms:.2f})"
            )

    def restart(self) -> None:
        """Back to the best strategy (FlexFlow's periodic reset)."""
        chain = self.chain
        if chain.current is not chain.best:
            cur_ms = _ms(self.simulator.start(chain.best))
            chain.current, chain.cur_ms = chain.best, cur_ms
            if self.used is not None:
                self.used.reset(chain.current)


class _DeviceUse:
    """How the step's work (each op's FLOPs, split evenly over its parts)
    spreads over the devices, to tell in O(parts) per change a strategy
    that runs the step on one device in effect.

    Why the work and not the devices touched: with every op whole on one
    device forbidden, a search on virtual CPU devices (which share the
    host's cores, so no split speeds a step up) put every op of keras.io's
    IMDB LSTM on device 0 but its last 1-unit Dense on device 1, on a new
    machine: plain Keras on one device with a transfer added.
    """

    # A device that does this share of a step's work runs it alone.
    ONE_DEVICE_SHARE = 0.9

    def __init__(self, graph: OpGraph, strategy: Strategy):
        self.weights = {op.name: op.forward_flops + op.backward_flops
                        for op in graph}
        if not any(self.weights.values()):  # no FLOPs known: ops count
            self.weights = dict.fromkeys(self.weights, 1.0)
        self.total = sum(self.weights.values())
        self.reset(strategy)

    def reset(self, strategy: Strategy) -> None:
        """Counts `strategy` afresh (no drift from many changes)."""
        self.work: dict[int, float] = {}
        for name, config in strategy.items():
            self._add(name, config, 1)

    def _add(self, name: str, config: Any, sign: int) -> None:
        share = sign * self.weights.get(name, 0.0) / config.num_parts
        for device in config.device_ids:
            self.work[device] = self.work.get(device, 0.0) + share

    def replace(self, name: str, old: Any, new: Any) -> None:
        self._add(name, old, -1)
        self._add(name, new, 1)

    @property
    def single(self) -> bool:
        """Whether one device does `ONE_DEVICE_SHARE` of the work."""
        return max(self.work.values()) >= (
            self.ONE_DEVICE_SHARE * self.total * (1 - 1e-9))

    def one_device_after(
        self, strategy: Strategy, names: tuple[str, ...], config: Any
    ) -> bool:
        """Whether giving `names` the `config` leaves the step on one
        device in effect."""
        for name in names:
            self.replace(name, strategy[name], config)
        single = self.single
        for name in names:
            self.replace(name, config, strategy[name])
        return single


def _neighbour_config(
    graph: OpGraph, op: Any, current: Strategy, num_devices: int,
    rng: random.Random,
) -> Any:
    """A random neighbour's config if `op` can take it, else None.

    Why: a lone op split unlike its neighbours pays resharding on both
    sides, so chains of ops rarely change one random proposal at a time.
    """
    neighbours = graph.predecessors(op) + graph.successors(op)
    if not neighbours:
        return None
    config = current[neighbours[rng.randrange(len(neighbours))].name]
    try:
        validate_config(op, config, num_devices)
    except ValueError:
        return None
    return config


def _accept(
    next_ms: float, cur_ms: float, alpha: float | None,
    relative_alpha: float, rng: random.Random,
) -> bool:
    """Metropolis rule; draws a number only when it must (reproducible).
    Per ms with `alpha`, else on the relative change."""
    if math.isinf(next_ms):
        return False
    if next_ms < cur_ms:
        return True
    if alpha is not None:
        return rng.random() < math.exp(-alpha * (next_ms - cur_ms))
    if math.isinf(cur_ms):
        return True  # anything feasible beats an infeasible start
    change = (next_ms - cur_ms) / max(cur_ms, 1e-9)
    return rng.random() < math.exp(-relative_alpha * change)


def _print(line: str) -> None:
    print(line, file=sys.stdout, flush=True)
