"""The live machine model: shared compute, fixed step cost, measured
collectives, and the runtime's cost of strategies over several meshes.

The simulator's picture of the attached devices is measured
(`calibration.py`); these tests fix the figures by hand and check what
the simulator does with them, and that measuring and caching work.
"""

import os
import tempfile
import unittest
from unittest import mock

import model_zoo

from flexflow_keras import calibration, devices
from flexflow_keras.cost import CostModel
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.machine import LinkGroup, MachineModel, load_machine
from flexflow_keras.simulator import Simulator
from flexflow_keras.strategy import ParallelConfig, Strategy
from flexflow_keras import taskgraph
from flexflow_keras.taskgraph import ring_allgather_ms, ring_allreduce_ms


def machine(**kwargs):
    base = load_machine("v100x4")
    return MachineModel(
        "test", base.devices[0], 1, 4, LinkGroup("host", 10.0, 0.01),
        **kwargs,
    )


def simulate(m, strategy_of, graph=None):
    graph = graph or build_graph(model_zoo.mlp(), 64)
    sim = Simulator(graph, m, cost_model=CostModel(m, mode="analytic"))
    return sim, sim.simulate(strategy_of(graph))


def data_parallel(graph):
    return Strategy.data_parallel(graph, 4)


class SharedComputeTest(unittest.TestCase):
    def test_devices_sharing_one_compute_resource_run_one_at_a_time(self):
        _, alone = simulate(machine(), data_parallel)
        _, shared = simulate(machine(compute_groups=1), data_parallel)
        # Each device's busy time is the same; shared, they add up.
        self.assertEqual(alone.busy_ms, shared.busy_ms)
        self.assertGreaterEqual(shared.step_ms, sum(shared.busy_ms) * 0.99)
        self.assertLess(alone.step_ms, shared.step_ms)

    def test_compute_resource_mapping(self):
        m = machine(compute_groups=2)
        self.assertEqual([m.compute_resource(d) for d in range(4)],
                         [0, 1, 0, 1])
        self.assertEqual(machine().compute_resource(3), 3)
        with self.assertRaisesRegex(ValueError, "compute_groups"):
            machine(compute_groups=0)


class FixedCostsTest(unittest.TestCase):
    def test_step_overhead_is_added_once(self):
        _, plain = simulate(machine(), data_parallel)
        _, loaded = simulate(machine(step_overhead_ms=2.5), data_parallel)
        self.assertAlmostEqual(loaded.step_ms - plain.step_ms, 2.5)

    def test_measured_collectives_replace_the_ring(self):
        # Over 4 devices of 10 GB/s, 0.01 ms links: a ring all-reduce
        # takes 6 steps of a quarter, a ring all-gather 3 of a part. The
        # live machine measures both (its links are fitted to DTensor's
        # all-gather per part, so a relayout on its mesh takes one step).
        devices, num_bytes, hop = (0, 1, 2, 3), 4e6, 0.01
        for name, collective, ring_ms in (
            ("allreduce", ring_allreduce_ms,
             6 * (hop + num_bytes / 4 / 10e9 * 1e3)),
            ("allgather", ring_allgather_ms,
             3 * (hop + num_bytes / 10e9 * 1e3)),
        ):
            with self.subTest(name):
                ms, links = collective(machine(**{name: (0.5, 2.0)}),
                                       devices, num_bytes)
                self.assertAlmostEqual(ms, 0.5 + num_bytes / 2e9 * 1e3)
                ring, ring_links = collective(machine(), devices, num_bytes)
                self.assertEqual(links, ring_links)
                self.assertAlmostEqual(ring, ring_ms)


class SeveralMeshesTest(unittest.TestCase):
    """On the live machine, a strategy over several meshes pays two calls
    per segment, the gather and the loss function, two copy calls into
    each segment after the first, and recomputes every forward
    (runtime/step.py)."""

    def split_strategy(self, graph):
        configs = {}
        for k, op in enumerate(graph):
            if k == 1:  # one op alone on device 2: three segments
                configs[op.name] = ParallelConfig((1,) * op.rank, (2,))
            else:
                configs[op.name] = ParallelConfig(
                    (4,) + (1,) * (op.rank - 1), (0, 1, 2, 3)
                )
        return Strategy(configs)

    def test_priced_only_on_live_machines_and_several_meshes(self):
        live = machine(live=True, call_overhead_ms=1.0, compute_groups=1)
        sim, one = simulate(live, data_parallel)
        _, ideal = simulate(machine(compute_groups=1), data_parallel)
        self.assertAlmostEqual(one.step_ms, ideal.step_ms)  # one mesh
        graph = sim.graph
        strategy = self.split_strategy(graph)
        several = sim.simulate(strategy)
        preset = Simulator(
            graph, machine(compute_groups=1),
            cost_model=CostModel(machine(), mode="analytic"),
        ).simulate(strategy)
        recompute = sum(
            sim.cost.op_cost(op, strategy[op.name], d)[0]
            for op in graph for d in strategy[op.name].device_ids
        )
        # Three segments: 2 x 3 segment functions, the gather and the
        # loss, less the call in the step overhead; 2 x 2 copy calls.
        self.assertAlmostEqual(
            several.step_ms - preset.step_ms, 11 * 1.0 + recompute, places=6
        )

    def test_delta_simulation_prices_it_alike(self):
        live = machine(live=True, call_overhead_ms=1.0, compute_groups=1)
        sim, _ = simulate(live, data_parallel)
        graph = sim.graph
        sim.start(data_parallel(graph))
        strategy = self.split_strategy(graph)
        name = graph.ops[1].name
        delta = sim.propose(name, strategy[name])
        full = sim.simulate(Strategy({
            **{op.name: data_parallel(graph)[op.name] for op in graph},
            name: strategy[name],
        }))
        self.assertEqual(delta.step_ms, full.step_ms)


class RegionCopiesTest(unittest.TestCase):
    """Between meshes the runtime copies regions with plain ops
    (runtime/moves.py), which the live machine prices by its measured
    `copy` figures; on one mesh DTensor relays out, priced as its
    all-gather (the machine's `allgather`, else a ring over the links)."""

    def edge(self, m, producer, consumer):
        graph = build_graph(model_zoo.mlp(), 64)
        a, b = graph.ops[0], graph.ops[1]
        piece = taskgraph.edge_piece(m, a, 0, producer(a), b, 1,
                                     consumer(b), 0)
        forward = [(ms, label[2]) for ms, label in
                   zip(piece.durations_ms, piece.labels)
                   if label[0] == taskgraph.XFER_FWD]
        return forward, a.output_bytes

    def test_copies_between_meshes_take_the_copy_figures(self):
        m = machine(copy=(0.05, 4.0))
        rows = lambda op: ParallelConfig(  # noqa: E731
            (2,) + (1,) * (op.rank - 1), (0, 1))
        other = lambda op: ParallelConfig(  # noqa: E731
            (2,) + (1,) * (op.rank - 1), (2, 3))
        forward, whole = self.edge(m, rows, other)
        self.assertEqual(len(forward), 2)  # part i: device i -> 2 + i
        for ms, (_, frm, to) in forward:
            self.assertEqual(to, frm + 2)
            self.assertAlmostEqual(ms, 0.05 + whole / 2 / 4e9 * 1e3)
        # Without the figures, the links price the same pieces.
        linked, _ = self.edge(machine(), rows, other)
        for ms, _ in linked:
            self.assertAlmostEqual(ms, 0.01 + whole / 2 / 10e9 * 1e3)

    def test_relayouts_on_one_mesh_keep_the_links(self):
        m = machine(copy=(0.05, 4.0))
        rows = lambda op: ParallelConfig(  # noqa: E731
            (4,) + (1,) * (op.rank - 1), (0, 1, 2, 3))
        columns = lambda op: ParallelConfig(  # noqa: E731
            (1,) * (op.rank - 1) + (4,), (0, 1, 2, 3))
        forward, _ = self.edge(m, columns, rows)
        linked, _ = self.edge(machine(), columns, rows)
        self.assertEqual(len(forward), 1)  # one all-gather over the mesh
        self.assertEqual(forward, linked)

    def test_copies_leaving_a_node_keep_the_network(self):
        base = load_machine("v100x4")
        m = MachineModel(
            "two", base.devices[0], 2, 2, LinkGroup("host", 10.0, 0.01),
            LinkGroup("ethernet", 1.0, 0.5), copy=(0.05, 4.0),
        )
        self.assertEqual(m.copy_route(0, 2), m.route(0, 2))
        inside = m.copy_route(0, 1)
        self.assertEqual(inside.links, m.route(0, 1).links)
        self.assertEqual((inside.latency_ms, inside.bandwidth_gbps),
                         (0.05, 4.0))
        self.assertEqual(machine().copy_route(0, 1), machine().route(0, 1))


class ReplicatedOnTheMeshTest(unittest.TestCase):
    def test_each_mesh_device_computes_an_unsplit_op_whole(self):
        def with_unsplit(graph):
            strategy = data_parallel(graph)
            op = graph.ops[1]
            return strategy.replace(
                op.name, ParallelConfig((1,) * op.rank, (0,))
            )

        live = machine(live=True, compute_groups=1)
        sim, replicated = simulate(live, with_unsplit)
        _, ideal = simulate(machine(compute_groups=1), with_unsplit)
        op = sim.graph.ops[1]
        config = with_unsplit(sim.graph)[op.name]
        whole = sum(sim.cost.op_cost(op, config, 0))
        whole += sim.cost.update_ms(op.trainable_weight_bytes, 0, 0)
        self.assertAlmostEqual(
            replicated.step_ms - ideal.step_ms, 3 * whole, places=6
        )
        _, parallel = simulate(machine(live=True), with_unsplit)
        _, parallel_ideal = simulate(machine(), with_unsplit)
        self.assertAlmostEqual(parallel.step_ms, parallel_ideal.step_ms)


class OneDeviceTest(unittest.TestCase):
    def test_search_keeps_several_devices_and_says_one_is_faster(self):
        from flexflow_keras import search

        m = machine(live=True, compute_groups=1, call_overhead_ms=0.5,
                    allreduce=(0.3, 1.0))
        graph = build_graph(model_zoo.mlp(), 64)
        sim = Simulator(graph, m, cost_model=CostModel(m, mode="analytic"))
        lines = []
        result = search.search(graph, sim, 4, budget=300, seed=0,
                               print_fn=lines.append)
        used = {d for c in result.strategy.values() for d in c.device_ids}
        self.assertGreater(len(used), 1)
        self.assertLess(result.one_device_ms, result.best_ms)
        self.assertIn("On one device the simulator finds", lines[-1])


class CalibrationCacheTest(unittest.TestCase):
    def setUp(self):
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)
        self.path = os.path.join(folder.name, "live.json")
        self.found = calibration.Calibration(
            1, 0.1, 2.0, 0.2, 1.5, 0.4, 3.0, 0.02, 8.0, 0.05, 4.0
        )

    def test_measured_once_then_read(self):
        names = ("CPU:0", "CPU:1")
        with mock.patch.object(calibration, "measure",
                               return_value=self.found) as measure:
            first = calibration.live_calibration(names, self.path)
            again = calibration.live_calibration(names, self.path)
        self.assertEqual(measure.call_count, 1)
        self.assertEqual(first, self.found)
        self.assertEqual(again, self.found)

    def test_one_device_or_turned_off_measures_nothing(self):
        with mock.patch.object(calibration, "measure",
                               side_effect=AssertionError("measured")):
            self.assertIsNone(
                calibration.live_calibration(("CPU:0",), self.path)
            )
            with mock.patch.dict(os.environ,
                                 {"FLEXFLOW_KERAS_CALIBRATE": "0"}):
                self.assertIsNone(calibration.live_calibration(
                    ("CPU:0", "CPU:1"), self.path
                ))

    def test_measure_on_the_attached_devices(self):
        names = devices.device_names()
        found = calibration.measure(names)
        self.assertTrue(1 <= found.compute_groups <= len(names))
        for value in (found.link_gbps, found.allreduce_gbps,
                      found.call_overhead_ms, found.step_overhead_ms,
                      found.update_gbps, found.copy_gbps):
            self.assertGreater(value, 0)
        self.assertGreaterEqual(found.link_latency_ms, 0)
        self.assertGreaterEqual(found.copy_latency_ms, 0)
        self.assertGreaterEqual(found.allreduce_latency_ms, 0)


if __name__ == "__main__":
    unittest.main()
