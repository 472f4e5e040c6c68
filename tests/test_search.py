"""MCMC search: FlexFlow's acceptance rule, reproducibility, the optimum.

A closed-form fake simulator keeps these tests exact and fast; the real
simulator is used too where it exists.
"""

import itertools
import math
import unittest
from unittest import mock

import keras

from flexflow_keras import report as report_lib
from flexflow_keras import search as search_lib
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.search_space import sweep_configs, valid_configs
from flexflow_keras.strategy import ParallelConfig, Strategy

PEAK_FLOPS_PER_MS = 1e7
LINK_BYTES_PER_MS = 1e5


class FakeResult:
    def __init__(self, step_ms: float, feasible: bool = True):
        self.step_ms = step_ms
        self.feasible = feasible


class FakeSimulator:
    """Closed-form cost: busiest device + resharding + weight sync (ms).

    Compute splits evenly over an op's parts; an edge between ops whose
    configs differ moves the whole tensor once; replicated trainable
    weights cost a ring all-reduce. `infeasible` lists configs to reject.
    """

    def __init__(self, graph, infeasible=()):
        self.graph = graph
        self.infeasible = set(infeasible)
        self.current = None
        self.pending = None
        self.calls = {"start": 0, "propose": 0, "accept": 0}

    def cost(self, strategy) -> FakeResult:
        load: dict[int, float] = {}
        comm = 0.0
        syncs = [0.0]
        for op in self.graph:
            config = strategy[op.name]
            if (op.name, config) in self.infeasible:
                return FakeResult(math.inf, feasible=False)
            flops = op.forward_flops + op.backward_flops
            for d in config.device_ids:
                load[d] = load.get(d, 0.0) + (
                    flops / config.num_parts / PEAK_FLOPS_PER_MS
                )
            for pred in self.graph.predecessors(op):
                if strategy[pred.name] != config:
                    comm += pred.output_bytes / LINK_BYTES_PER_MS
            pdim = op.parameter_dim
            shards = config.dims[pdim] if pdim is not None else 1
            replicas = config.num_parts // shards
            if replicas > 1 and op.trainable_weight_bytes:
                syncs.append(2 * (replicas - 1) / replicas
                             * op.trainable_weight_bytes / shards
                             / LINK_BYTES_PER_MS)
        return FakeResult(max(load.values()) + comm + self.synced(syncs))

    def synced(self, syncs) -> float:
        """The step's share of the ops' weight syncs: one after another."""
        return sum(syncs)

    def simulate(self, strategy):
        return self.cost(strategy)

    def start(self, strategy):
        self.calls["start"] += 1
        self.current = strategy
        return self.cost(strategy)

    def propose(self, name, config):
        self.calls["propose"] += 1
        self.pending = self.current.replace(name, config)
        return self.cost(self.pending)

    def propose_many(self, changes):
        self.calls["propose"] += 1
        pending = self.current
        for name, config in changes.items():
            pending = pending.replace(name, config)
        self.pending = pending
        return self.cost(pending)

    def accept(self):
        self.calls["accept"] += 1
        self.current = self.pending


class SlowestSyncSimulator(FakeSimulator):
    """As `FakeSimulator`, but the weight syncs overlap one another: the
    step pays the slowest one. So of two alike ops, splitting one
    alone saves nothing (the other's sync stays the longest) and costs
    its relayouts; splitting both saves."""

    def synced(self, syncs) -> float:
        return max(syncs)


def twin_branches_graph():
    """Two alike Dense layers side by side, each an output: data
    parallelism computes 5 ms of each a device and syncs 3.9 ms of
    weights (`SlowestSyncSimulator`); one alone on fewer devices
    computes longer, split by its columns it syncs nothing."""
    inputs = keras.Input(shape=(256,), name="x")
    outputs = [keras.layers.Dense(256, name=n)(inputs) for n in "ab"]
    return build_graph(keras.Model(inputs, outputs), 512)


def mlp_graph(batch: int, units: tuple[int, ...], features: int = 4):
    inputs = keras.Input(shape=(features,), name="x")
    x = inputs
    for i, n in enumerate(units):
        x = keras.layers.Dense(n, name=f"dense_{i}")(x)
    return build_graph(keras.Model(inputs, x), batch)


def exhaustive_optimum(graph, simulator, num_devices):
    spaces = [list(valid_configs(op, num_devices)) for op in graph]
    best = math.inf
    for configs in itertools.product(*spaces):
        strategy = Strategy(
            {op.name: c for op, c in zip(graph, configs)}
        )
        result = simulator.simulate(strategy)
        if result.feasible:
            best = min(best, result.step_ms)
    return best


class SearchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # Big weights, small batch: data parallelism is far from optimal.
        cls.graph = mlp_graph(batch=8, units=(512, 512, 8), features=512)

    def run_search(self, budget=300, seed=0, **kwargs):
        simulator = kwargs.pop("simulator", FakeSimulator(self.graph))
        return search_lib.search(
            self.graph, simulator, 4, budget, seed=seed, verbose=0, **kwargs
        )

    def test_choices_keep_every_op_to_its_own_configs(self):
        # Per op, data parallelism over 4 or over 2 devices, or whole on
        # device 3: whatever the chain proposes stays among them.
        choices = {
            op.name: [ParallelConfig((4, 1), (0, 1, 2, 3)),
                      ParallelConfig((2, 1), (0, 1)),
                      ParallelConfig((1, 1), (3,))]
            for op in self.graph
        }
        result = self.run_search(choices=choices)
        for op in self.graph:
            self.assertIn(result.strategy[op.name], choices[op.name])
        # Started from each op's first config: data parallelism.
        start = Strategy({n: c[0] for n, c in choices.items()})
        self.assertLessEqual(
            result.best_ms, FakeSimulator(self.graph).cost(start).step_ms
        )

    def test_choices_must_cover_every_op_and_not_come_with_a_mesh(self):
        from flexflow_keras.mesh_space import MeshSpec

        first = self.graph.ops[0].name
        with self.assertRaisesRegex(ValueError, "every op"):
            self.run_search(choices={
                first: [ParallelConfig((4, 1), (0, 1, 2, 3))]
            })
        with self.assertRaisesRegex(ValueError, "not both"):
            self.run_search(
                mesh=MeshSpec.first((4,)),
                choices={op.name: [ParallelConfig((4, 1), (0, 1, 2, 3))]
                         for op in self.graph},
            )

    def test_budget_zero_keeps_data_parallelism(self):
        result = self.run_search(budget=0)
        self.assertEqual(result.strategy,
                         Strategy.data_parallel(self.graph, 4))
        self.assertEqual(result.best_ms, result.data_parallel_ms)
        self.assertEqual(result.iterations, 0)

    def test_finds_faster_than_data_parallel(self):
        result = self.run_search()
        self.assertLess(result.best_ms, result.data_parallel_ms)
        self.assertGreater(result.speedup, 1.0)
        expected = FakeSimulator(self.graph).cost(result.strategy).step_ms
        self.assertAlmostEqual(result.best_ms, expected)
        result.strategy.validate(self.graph, 4)

    def test_never_trains_on_one_device_of_several(self):
        # Where one device is fastest (virtual CPU devices sharing the
        # host's cores), neither a proposal nor a start point (an RNN
        # model's expert placement can be one) puts every op on it.
        class OneDeviceFastest(FakeSimulator):
            def cost(inner, strategy):
                used = {d for c in strategy.values() for d in c.device_ids}
                if len(used) == 1:
                    return FakeResult(0.001)
                return super().cost(strategy)

        one = Strategy({op.name: ParallelConfig((1,) * op.rank, (2,))
                        for op in self.graph})
        for budget in (0, 300):
            result = self.run_search(
                budget=budget, simulator=OneDeviceFastest(self.graph),
                candidates=(one,),
            )
            used = {d for c in result.strategy.values()
                    for d in c.device_ids}
            self.assertGreater(len(used), 1, budget)
            self.assertEqual(result.one_device_ms, 0.001)

    def test_never_trains_on_one_device_in_effect(self):
        # Nor on one device but for a small op elsewhere: with the whole
        # forbidden, a search where one device is fastest put every op
        # of keras.io's IMDB LSTM on device 0 but its last Dense.
        def shares(strategy):
            work = {}
            for op in self.graph:
                config = strategy[op.name]
                for d in config.device_ids:
                    work[d] = work.get(d, 0.0) + (
                        op.forward_flops + op.backward_flops
                    ) / config.num_parts
            return max(work.values()) / sum(work.values())

        class NearlyOneDeviceFastest(FakeSimulator):
            def cost(inner, strategy):
                if shares(strategy) >= 0.9:
                    return FakeResult(0.001)
                return super().cost(strategy)

        smallest = min(self.graph, key=lambda op: op.forward_flops)
        nearly = Strategy({
            op.name: ParallelConfig((1,) * op.rank,
                                    (3,) if op is smallest else (2,))
            for op in self.graph})
        self.assertGreaterEqual(shares(nearly), 0.9)
        for budget in (0, 300):
            result = self.run_search(
                budget=budget,
                simulator=NearlyOneDeviceFastest(self.graph),
                candidates=(nearly,),
            )
            self.assertLess(shares(result.strategy), 0.9, budget)

    def test_same_seed_same_result(self):
        a, b = self.run_search(seed=3), self.run_search(seed=3)
        self.assertEqual(a.strategy, b.strategy)
        self.assertEqual(a.best_ms, b.best_ms)
        self.assertEqual(a.accepted, b.accepted)
        self.assertEqual(a.seed, 3)

    def test_uses_delta_simulation(self):
        simulator = FakeSimulator(self.graph)
        result = self.run_search(budget=200, simulator=simulator,
                                 reset_every=0)
        self.assertEqual(simulator.calls["start"], 1)
        self.assertLessEqual(simulator.calls["propose"], 200)
        self.assertEqual(simulator.calls["accept"], result.accepted)

    def test_restarts_from_best_every_budget_over_100(self):
        class Recording(FakeSimulator):
            def start(inner, strategy):
                starts.append(strategy)
                return super().start(strategy)

            def propose(inner, name, config):
                result = super().propose(name, config)
                seen.append(result.step_ms)
                return result

        starts, seen = [], []
        original = Recording.start

        def start(inner, strategy):
            # Every restart resumes from the best strategy seen so far.
            if starts:
                first = inner.cost(starts[0]).step_ms
                self.assertAlmostEqual(inner.cost(strategy).step_ms,
                                       min([first, *seen]))
            return original(inner, strategy)

        Recording.start = start
        result = self.run_search(budget=1000, alpha=0.0, sweep=0,
                                 simulator=Recording(self.graph))
        self.assertGreater(len(starts), 1)
        self.assertLessEqual(len(starts), 1 + 1000 // 10)
        self.assertEqual(result.best_ms, min([result.data_parallel_ms,
                                              *seen]))

    def test_rejects_infeasible_proposals(self):
        dense = self.graph.op("dense_1")
        banned = [(dense.name, c) for c in valid_configs(dense, 4)
                  if c.num_parts < 4]
        simulator = FakeSimulator(self.graph, infeasible=banned)
        result = self.run_search(budget=400, simulator=simulator)
        self.assertEqual(result.strategy["dense_1"].num_parts, 4)
        self.assertTrue(math.isfinite(result.best_ms))

    def test_alpha_zero_accepts_every_feasible_proposal(self):
        simulator = FakeSimulator(self.graph)
        result = self.run_search(budget=100, alpha=0.0, sweep=0,
                                 simulator=simulator)
        self.assertEqual(result.accepted, simulator.calls["propose"])

    def test_huge_alpha_accepts_only_improvements(self):
        class Recording(FakeSimulator):
            def accept(inner):
                steps.append(inner.cost(inner.pending).step_ms)
                super().accept()

        steps = []
        self.run_search(budget=300, alpha=1e9,
                        simulator=Recording(self.graph))
        self.assertEqual(steps, sorted(steps, reverse=True))

    def test_the_sweep_tries_twins_together(self):
        # No move of one Dense alone is faster (the other's sync stays
        # the longest); both split by their columns are. The sweep alone
        # (no chain) finds the pair only through `twin_groups`.
        graph = twin_branches_graph()
        # The budget of the sweep: each op's configs, then the pair's.
        budget = 3 * len(sweep_configs(graph.op("a"), 4))
        sweep_only = dict(budget=budget, sweep=1.0, seed=0, verbose=0)
        found = search_lib.search(graph, SlowestSyncSimulator(graph), 4,
                                  **sweep_only)
        self.assertEqual(found.strategy["a"], found.strategy["b"])
        self.assertGreater(found.strategy["a"].dims[-1], 1)
        self.assertLess(found.best_ms, found.data_parallel_ms)
        with mock.patch.object(search_lib, "twin_groups",
                               lambda graph: ()):
            alone = search_lib.search(graph, SlowestSyncSimulator(graph), 4,
                                      **sweep_only)
        self.assertEqual(alone.best_ms, alone.data_parallel_ms)

    def test_ctrl_c_keeps_best_so_far(self):
        class Interrupting(FakeSimulator):
            def propose(inner, name, config):
                if inner.calls["propose"] == 50:
                    raise KeyboardInterrupt
                return super().propose(name, config)

        result = self.run_search(budget=1000,
                                 simulator=Interrupting(self.graph))
        self.assertTrue(result.interrupted)
        self.assertLess(result.iterations, 1000)
        self.assertLessEqual(result.best_ms, result.data_parallel_ms)
        result.strategy.validate(self.graph, 4)

    def test_progress_lines_and_best_strategy_block(self):
        lines = []
        search_lib.search(self.graph, FakeSimulator(self.graph), 4, 200,
                          seed=0, verbose=2, print_fn=lines.append)
        self.assertRegex(
            lines[0], r"^iter\(100\) cur\([\d.]+\) next\([\d.]+\) "
            r"best\([\d.]+\)$"
        )
        self.assertRegex(lines[1], r"^iter\(200\) ")
        block = lines[2]
        self.assertIn("=========== Best Discovered Strategy ==========",
                      block)
        self.assertRegex(block, r"\[dense_0\] num_dims\(2\) dims\[")
        self.assertRegex(block, r"speed-up over data parallelism: [\d.]+x")

    def test_rejects_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "budget=-1"):
            self.run_search(budget=-1)
        with self.assertRaisesRegex(ValueError, "alpha=-0.5"):
            self.run_search(alpha=-0.5)
        with self.assertRaisesRegex(ValueError, "between 0 and 1.*"
                                    "sweep=1.5"):
            self.run_search(sweep=1.5)


class SweepTest(unittest.TestCase):
    """The first sweep: op after op, heaviest weights first, every degree
    split on the first devices; a faster strategy kept at once."""

    @classmethod
    def setUpClass(cls):
        cls.graph = mlp_graph(batch=8, units=(512, 1024, 8), features=512)
        cls.order = sorted(cls.graph,
                           key=lambda op: -op.trainable_weight_bytes)
        # The sweep as specified, by hand: its proposals (the op's
        # current config is none) and the strategy it ends on.
        fake = FakeSimulator(cls.graph)
        state = Strategy.data_parallel(cls.graph, 4)
        cls.expected = []
        for op in cls.order:
            for config in sweep_configs(op, 4):
                if config == state[op.name]:
                    continue
                cls.expected.append((op.name, config))
                changed = state.replace(op.name, config)
                if fake.cost(changed).step_ms < fake.cost(state).step_ms:
                    state = changed
        cls.swept = state

    def run_sweep(self, budget, sweep=1.0):
        proposals = []

        class Recording(FakeSimulator):
            def propose(inner, name, config):
                proposals.append((name, config))
                return super().propose(name, config)

        result = search_lib.search(self.graph, Recording(self.graph), 4,
                                   budget, seed=0, verbose=0, sweep=sweep)
        return result, proposals

    def test_tries_every_split_heaviest_op_first(self):
        self.assertEqual([op.name for op in self.order],
                         ["dense_1", "dense_0", "dense_2"])
        result, proposals = self.run_sweep(len(self.expected) + 50)
        self.assertEqual(proposals[:len(self.expected)], self.expected)
        self.assertEqual(result.iterations, len(self.expected) + 50)

    def test_ends_on_each_ops_fastest_split_in_turn(self):
        result, _ = self.run_sweep(len(self.expected))  # the sweep only
        self.assertEqual(result.strategy, self.swept)
        self.assertNotEqual(self.swept["dense_1"].dims, (4, 1))
        self.assertLess(result.best_ms, result.data_parallel_ms)

    def test_stops_at_its_share_of_the_budget(self):
        result, proposals = self.run_sweep(40, sweep=0.25)
        self.assertEqual(proposals[:10], self.expected[:10])
        self.assertNotEqual(proposals[10:], self.expected[10:40])
        self.assertEqual(result.iterations, 40)


class ExhaustiveOptimumTest(unittest.TestCase):
    """On a 3-layer MLP on 2 devices, MCMC finds what enumeration finds."""

    def test_matches_exhaustive_optimum_fake_simulator(self):
        graph = mlp_graph(batch=4, units=(64, 64, 2), features=64)
        simulator = FakeSimulator(graph)
        optimum = exhaustive_optimum(graph, simulator, 2)
        result = search_lib.search(graph, FakeSimulator(graph), 2, 2000,
                                   seed=0, verbose=0)
        self.assertAlmostEqual(result.best_ms, optimum, places=9)
        self.assertLess(optimum, result.data_parallel_ms)


class StrategyTableTest(unittest.TestCase):
    def test_rows_per_op_with_time_column(self):
        graph = mlp_graph(batch=8, units=(6, 2))
        strategy = Strategy.data_parallel(graph, 4).replace(
            "dense_1", ParallelConfig((1, 2), (3, 1))
        )
        table = report_lib.strategy_table(
            graph, strategy, {"dense_0": 1.5, "dense_1": 0.25}
        )
        lines = table.splitlines()
        self.assertIn("Op (type)", lines[1])
        self.assertIn("Time (ms)", lines[1])
        self.assertRegex(lines[3], r"dense_0 \(Dense\)\s+\(8, 6\)\s+"
                         r"sample=4\s+0-3\s+1.500")
        self.assertRegex(lines[4], r"dense_1 \(Dense\)\s+\(8, 2\)\s+"
                         r"parameter=2\s+3,1\s+0.250")
        self.assertTrue(all(len(line) <= 98 for line in lines))
        self.assertNotIn("Time", report_lib.strategy_table(graph, strategy))


class RealSimulatorTest(unittest.TestCase):
    """The same optimum check against the package's own simulator."""

    def test_matches_exhaustive_optimum_real_simulator(self):
        from flexflow_keras.machine import machine_from_dict
        from flexflow_keras.simulator import Simulator

        machine = machine_from_dict({
            "name": "v100x2",
            "devices_per_node": 2,
            "device": {"kind": "V100", "peak_tflops": 15.7,
                       "memory_gib": 16, "memory_gbps": 900},
            "intra_node": {"kind": "nvlink", "bandwidth_gbps": 50,
                           "latency_us": 2},
        })
        graph = mlp_graph(batch=16, units=(1024, 1024, 16), features=1024)
        optimum = exhaustive_optimum(graph, Simulator(graph, machine), 2)
        result = search_lib.search(graph, Simulator(graph, machine), 2,
                                   1000, seed=0, verbose=0)
        self.assertAlmostEqual(result.best_ms, optimum, places=9)
        self.assertLess(optimum, result.data_parallel_ms)


class SharedLayerTest(unittest.TestCase):
    """A shared layer's calls run on its weights' mesh: they are searched
    together, so the simulated strategy is the one that runs."""

    def test_calls_of_a_shared_layer_keep_one_config(self):
        import model_zoo
        from flexflow_keras.machine import load_machine
        from flexflow_keras.simulator import Simulator

        graph = build_graph(model_zoo.shared_layer(), 16)
        machine = load_machine("v100x4")
        sim = Simulator(graph, machine)
        calls = 0
        propose_many = sim.propose_many

        def counting(changes):  # propose() comes here too
            nonlocal calls
            if {"shared", "shared#1"} & set(changes):
                calls += 1
                self.assertEqual(sorted(changes), ["shared", "shared#1"])
                self.assertEqual(len(set(changes.values())), 1)
            return propose_many(changes)

        sim.propose_many = counting
        result = search_lib.search(graph, sim, 4, 300, alpha=0.0, seed=1,
                                   verbose=0)
        self.assertGreater(calls, 0)
        self.assertEqual(result.strategy["shared"],
                         result.strategy["shared#1"])
        self.assertEqual(result.best_ms,
                         Simulator(graph, machine).simulate(
                             result.strategy).step_ms)

    def test_untied_initial_strategy_is_tied(self):
        import model_zoo
        from flexflow_keras.machine import load_machine
        from flexflow_keras.simulator import Simulator

        graph = build_graph(model_zoo.shared_layer(), 16)
        initial = Strategy.data_parallel(graph, 4).replace(
            "shared#1", ParallelConfig((1, 1), (2,))
        )
        result = search_lib.search(
            graph, Simulator(graph, load_machine("v100x4")), 4, 0,
            initial=initial, verbose=0,
        )
        self.assertEqual(result.strategy["shared#1"],
                         result.strategy["shared"])


class PropagationTest(unittest.TestCase):
    def test_propagation_only_copies_neighbour_configs(self):
        graph = mlp_graph(batch=8, units=(512, 512, 8), features=512)

        class Recording(FakeSimulator):
            def propose(inner, name, config):
                proposals.append(config)
                return super().propose(name, config)

        proposals = []
        initial = Strategy.data_parallel(graph, 4).replace(
            "dense_1", ParallelConfig((1, 4), (3, 2, 1, 0))
        )
        result = search_lib.search(graph, Recording(graph), 4, 300, seed=0,
                                   verbose=0, propagation=1.0, sweep=0,
                                   initial=initial, reset_every=0)
        result.strategy.validate(graph, 4)
        self.assertTrue(proposals)
        self.assertLessEqual(set(proposals), set(initial.values()))


class ReportTest(unittest.TestCase):
    def make(self, best_ms, data_parallel_ms):
        strategy = Strategy({"d": ParallelConfig((2, 1), (0, 1))})
        return search_lib.SearchResult(strategy, best_ms, data_parallel_ms,
                                       iterations=10, wall_s=0.5)

    def test_speedup_line(self):
        text = report_lib.search_report(self.make(2.0, 5.0))
        self.assertIn("[d] num_dims(2) dims[2,1] device_ids[0,1]", text)
        self.assertIn("speed-up over data parallelism: 2.50x after 10 "
                      "iterations", text)

    def test_data_parallel_that_cannot_split_its_batch_says_so(self):
        """A batch of 1 on 4 devices: the baseline splits other dims,
        and a speed-up over it is not one over splitting the batch."""
        graph = mlp_graph(1, (8, 4))
        result = search_lib.search(graph, FakeSimulator(graph), 4,
                                   budget=0, seed=0, verbose=0)
        self.assertEqual(result.batch_split, (1, 1, 4))
        text = report_lib.search_report(result)
        self.assertIn("(data parallelism: ", text)
        self.assertIn(", where a batch of 1 splits 1 way over 4 devices "
                      "and other dims take the rest); simulated speed-up "
                      "over data parallelism: ", text)
        self.assertNotIn("where a batch",
                         report_lib.search_report(self.make(2.0, 5.0)))

    def test_data_parallel_out_of_memory(self):
        text = report_lib.search_report(self.make(2.0, math.inf))
        self.assertIn("data parallelism does not fit in device memory",
                      text)

    def test_nothing_fits(self):
        text = report_lib.search_report(self.make(math.inf, math.inf))
        self.assertIn("No strategy found fits in device memory", text)
