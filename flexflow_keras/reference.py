"""Reference optima to measure the MCMC search against.

Two yardsticks, each exact over what it covers:

- `chain_optimum`: an exact dynamic program over a chain of ops (each op
  reads only the op before it), OptCNN's (Jia et al., ICML'18) on the
  simulator's own costs. Its objective (`ChainCosts`) sums the pieces
  the simulator builds (`taskgraph.op_piece`, `edge_piece`,
  `family_piece`) as if they did not overlap: each phase of a piece
  (forwards, backwards, transfers each way, weight syncs, updates) is
  list-scheduled alone (`phase_ms`), and phases run one after another.
  On a chain the passes are sequential anyway; what the sum cannot see
  is a weight sync hiding behind the backwards still to run, so there
  are two objectives, every sync counted or only the exposed one, and
  `chain_reference` simulates both optima and keeps the faster.
- `exhaustive_optimum`: every strategy over the configs given, each
  simulated (delta simulation in odometer order): the true optimum of
  the simulator, for graphs small enough to enumerate.

Both consider, by default, contiguous device blocks aligned to their
size (`aligned_configs`); the search proposes any placement, so it may
beat a reference, and where it does not, the gap is its shortfall.
Imports no TensorFlow.
"""

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence

from flexflow_keras import taskgraph
from flexflow_keras.graph import Op, OpGraph
from flexflow_keras.search_space import valid_configs
from flexflow_keras.simulator import Simulator
from flexflow_keras.strategy import ParallelConfig, Strategy

# Graphs whose strategy count exceeds this are refused by
# `exhaustive_optimum`: 10^5 delta simulations take seconds to a minute
# (0.9 s for RNNLM's 12,544 on v100x4).
EXHAUSTIVE_LIMIT = 100_000


@dataclasses.dataclass(frozen=True)
class Optimum:
    """A reference strategy.

    Args:
        strategy: The strategy found.
        cost_ms: The objective it minimizes: the additive piece cost for
            `chain_optimum`, the simulated step time for
            `exhaustive_optimum` (ms).
        candidates: Configs considered per op, summed over ops.
        evaluated: Strategies (exhaustive) or config pairs (chain)
            costed.
    """

    strategy: Strategy
    cost_ms: float
    candidates: int
    evaluated: int


def aligned_configs(op: Op, num_devices: int) -> list[ParallelConfig]:
    """The op's configs on contiguous device blocks that start at a
    multiple of their size (`0-3`, `4-7`, ... for four parts).

    Why these: on machines of identical nodes, where a block starts
    matters mostly through which nodes it spans; aligned blocks cover
    every degree and every span of whole nodes with far fewer configs
    than every start (`valid_configs(..., "contiguous")`)."""
    return [
        config
        for config in valid_configs(op, num_devices, "contiguous")
        if config.device_ids[0] % config.num_parts == 0
    ]


def phase_ms(piece: taskgraph.Piece) -> float:
    """A piece's time with no overlap between its phases: the tasks of
    each kind (forwards, transfers, syncs, ...) list-scheduled alone, in
    priority order, each as soon as all its resources are free (as the
    simulator's scheduler places tasks that are all ready at once); the
    kinds one after another."""
    by_kind: dict[int, list[tuple[int, float, tuple[int, ...]]]] = {}
    for ms, resources, prio, label in zip(
        piece.durations_ms, piece.resources, piece.priorities, piece.labels
    ):
        by_kind.setdefault(label[0], []).append((prio, ms, resources))
    total = 0.0
    for tasks in by_kind.values():
        free: dict[int, float] = {}
        end = 0.0
        for _, ms, resources in sorted(tasks):
            start = max((free.get(r, 0.0) for r in resources), default=0.0)
            for r in resources:
                free[r] = start + ms
            end = max(end, start + ms)
        total += end
    return total


def chain_order(graph: OpGraph) -> list[Op] | None:
    """The graph's ops as a chain, or None when it is not one.

    A chain: one op reads only model inputs, every other reads only the
    op before it (any number of its inputs), each op feeds at most the
    op after it, and no op shares weights."""
    ops = list(graph.ops)
    for k, op in enumerate(ops):
        if op.shares_weights_with:
            return None
        predecessors = graph.predecessors(op)
        expected = () if k == 0 else (ops[k - 1],)
        if tuple(predecessors) != expected:
            return None
        if k > 0 and any(t in graph.inputs for t in op.inputs):
            return None
        if len(graph.successors(op)) > (1 if k + 1 < len(ops) else 0):
            return None
    return ops


class ChainCosts:
    """The additive cost of strategies of one chain (module docstring),
    priced with a simulator's machine, op costs and optimizer slots (one
    source for both: the program's optimum is then simulated as is).

    Args:
        simulator: A `Simulator` of a chain-shaped graph (`chain_order`).
        hidden_syncs: Count no op's weight sync but the first op's (its
            backward is the step's last compute, so its sync is exposed;
            the others may hide behind the backwards still to run). False:
            count every sync.

    Raises:
        ValueError: If the graph is not a chain.
    """

    def __init__(self, simulator: Simulator, hidden_syncs: bool = False):
        graph = simulator.graph
        ops = chain_order(graph)
        if ops is None:
            raise ValueError(
                "A chain is needed: every op reading only the op before "
                "it, none shared. Received a graph that is not one "
                f"({len(graph)} ops). Use `exhaustive_optimum` on small "
                "graphs, or the search."
            )
        self.ops, self.machine = ops, simulator.machine
        self.cost, self.slots = simulator.cost, simulator.slots
        self.hidden_syncs = hidden_syncs
        self._index = {op.name: i for i, op in enumerate(ops)}

    def node_ms(self, op: Op, config: ParallelConfig) -> float:
        """The op's forwards, backwards, weight sync and updates."""
        i = self._index[op.name]
        ms = phase_ms(taskgraph.op_piece(op, i, config, self.cost,
                                         self.machine))
        if op.weights and not (self.hidden_syncs and i > 0):
            ms += phase_ms(taskgraph.family_piece(
                self.machine, self.cost, [(op, i, config)], self.slots,
            ))
        return ms

    def edge_ms(
        self, producer: Op, producer_config: ParallelConfig,
        consumer: Op, consumer_config: ParallelConfig,
    ) -> float:
        """Transfers each way for every input `consumer` reads from
        `producer`."""
        return sum(
            phase_ms(taskgraph.edge_piece(
                self.machine, producer, self._index[producer.name],
                producer_config, consumer, self._index[consumer.name],
                consumer_config, k,
            ))
            for k, tensor in enumerate(consumer.inputs)
            if tensor in producer.outputs
        )

    def total_ms(self, strategy: Strategy) -> float:
        """The additive cost of a whole strategy."""
        ops = self.ops
        return sum(self.node_ms(op, strategy[op.name]) for op in ops) + sum(
            self.edge_ms(a, strategy[a.name], b, strategy[b.name])
            for a, b in zip(ops, ops[1:])
        )


def chain_optimum(
    costs: ChainCosts,
    configs: Callable[[Op, int], Sequence[ParallelConfig]] = aligned_configs,
) -> Optimum:
    """The exact optimum of a chain's additive cost, by dynamic program.

    Args:
        costs: The chain's `ChainCosts`.
        configs: Candidate configs per op; `aligned_configs` by default.

    Returns:
        An `Optimum` whose `cost_ms` is the additive cost; simulate its
        strategy for the step time.
    """
    ops, n = costs.ops, costs.machine.num_devices
    choices = [list(configs(op, n)) for op in ops]
    for op, options in zip(ops, choices):
        if not options:
            raise ValueError(
                f"No candidate config for op {op.name!r}: `configs` "
                "returned none. Return at least data parallelism."
            )
    evaluated = 0
    best = [costs.node_ms(ops[0], c) for c in choices[0]]
    back: list[list[int]] = []
    for k in range(1, len(ops)):
        producer, consumer = ops[k - 1], ops[k]
        row, links = [], []
        for c_config in choices[k]:
            totals = [
                best[j] + costs.edge_ms(producer, p_config, consumer,
                                        c_config)
                for j, p_config in enumerate(choices[k - 1])
            ]
            evaluated += len(totals)
            j = min(range(len(totals)), key=totals.__getitem__)
            row.append(totals[j] + costs.node_ms(consumer, c_config))
            links.append(j)
        best = row
        back.append(links)
    j = min(range(len(best)), key=best.__getitem__)
    total, picked = best[j], [j]
    for links in reversed(back):
        j = links[j]
        picked.append(j)
    picked.reverse()
    strategy = Strategy({
        op.name: choices[k][j] for k, (op, j) in enumerate(zip(ops, picked))
    })
    return Optimum(strategy, total, sum(map(len, choices)), evaluated)


def chain_reference(
    graph: OpGraph,
    simulator: Simulator,
    configs: Callable[[Op, int], Sequence[ParallelConfig]] = aligned_configs,
) -> tuple[Strategy, float] | None:
    """The reference for a chain: the optima of both additive costs
    (every sync counted; syncs hidden), simulated; the faster kept.

    Args:
        graph: The model's `OpGraph`.
        simulator: A `Simulator` of `graph`; its machine, cost model and
            optimizer slots price the pieces.
        configs: Candidate configs per op.

    Returns:
        (strategy, simulated step ms), or None when the graph is not a
        chain.
    """
    if chain_order(graph) is None:
        return None
    found = []
    for hidden in (False, True):
        costs = ChainCosts(simulator, hidden)
        strategy = chain_optimum(costs, configs).strategy
        found.append((_ms(simulator.simulate(strategy)), strategy))
    ms, strategy = min(found, key=lambda pair: pair[0])
    return strategy, ms


def exhaustive_optimum(
    graph: OpGraph,
    simulator: object,
    num_devices: int,
    configs: Callable[[Op, int], Sequence[ParallelConfig]] = aligned_configs,
    limit: int = EXHAUSTIVE_LIMIT,
) -> Optimum:
    """The simulator's optimum over every strategy of the given configs.

    Args:
        graph: The model's `OpGraph`, without shared layers.
        simulator: A `Simulator` of `graph` (delta simulation is used).
        num_devices: Devices of the machine.
        configs: Candidate configs per op; `aligned_configs` by default.
        limit: Refuse graphs with more strategies than this.

    Returns:
        An `Optimum` whose `cost_ms` is the simulated step time; an
        infeasible strategy (over memory) is never chosen unless all are,
        in which case `cost_ms` is `inf`.

    Raises:
        ValueError: If the strategies number more than `limit`, or the
            graph shares weights.
    """
    ops = list(graph.ops)
    if any(op.shares_weights_with for op in ops):
        raise ValueError(
            "`exhaustive_optimum` does not handle shared layers (their "
            "calls are tied). Received a graph with shared layers."
        )
    choices = [list(configs(op, num_devices)) for op in ops]
    count = math.prod(len(c) for c in choices)
    if count > limit:
        raise ValueError(
            f"Too many strategies to enumerate: {count} over {len(ops)} "
            f"ops, more than limit={limit}. Use fewer devices, a smaller "
            "graph, `chain_optimum`, or raise `limit`."
        )
    best, best_ms, evaluated = None, math.inf, 0
    for picked, ms in _odometer(ops, choices, simulator):
        evaluated += 1
        if ms < best_ms or best is None:
            best, best_ms = picked, ms
    strategy = Strategy({op.name: c for op, c in zip(ops, best)})
    return Optimum(strategy, best_ms, sum(map(len, choices)), evaluated)


def _odometer(
    ops: list[Op], choices: list[list[ParallelConfig]], simulator: object,
) -> Iterable[tuple[tuple[ParallelConfig, ...], float]]:
    """Every combination with its simulated ms, changing the last op
    fastest so that most steps are a one-op delta simulation."""
    first = tuple(c[0] for c in choices)
    current = list(first)
    yield first, _ms(simulator.start(Strategy(
        {op.name: c for op, c in zip(ops, first)}
    )))
    for picked in itertools.islice(itertools.product(*choices), 1, None):
        changes = {
            op.name: c for op, c, old in zip(ops, picked, current)
            if c != old
        }
        ms = _ms(simulator.propose_many(changes))
        simulator.accept()
        current = list(picked)
        yield picked, ms


def _ms(result: object) -> float:
    return float(result.step_ms) if result.feasible else math.inf
