"""Simulator: hand-checked step times, memory, delta == full, traces."""

import contextlib
import json
import math
import os
import random
import tempfile
import unittest
from unittest import mock

import model_zoo
import pytest

from array import array

from flexflow_keras import schedule, search_space
from flexflow_keras.cost import CostModel
from flexflow_keras.graph import (
    PARAMETER,
    SAMPLE,
    Op,
    OpGraph,
    TensorInfo,
    WeightInfo,
)
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.machine import load_machine, machine_from_dict
from flexflow_keras.simulator import Simulator
from flexflow_keras.strategy import ParallelConfig, Strategy
from flexflow_keras.taskgraph import ring_allreduce_ms
from flexflow_keras.trace import write_trace


def machine(nodes=1, per_node=2, gbps=1.0, latency_us=0.0, nic_gbps=0.5,
            memory_gib=16.0):
    return machine_from_dict({
        "num_nodes": nodes, "devices_per_node": per_node,
        "device": {"kind": "T", "peak_tflops": 1.0,
                   "memory_gib": memory_gib, "memory_gbps": 100.0},
        "intra_node": {"kind": "nvlink", "bandwidth_gbps": gbps,
                       "latency_us": latency_us},
        "inter_node": {"bandwidth_gbps": nic_gbps,
                       "latency_us": latency_us},
    })


class FixedCost(CostModel):
    """Costs given per op name: (forward_ms, backward_ms); fixed update."""

    def __init__(self, machine, costs, update_ms=0.0):
        super().__init__(machine, mode="analytic")
        self.costs, self.fixed_update_ms = costs, update_ms

    def op_cost(self, op, config, device):
        return self.costs[op.name]

    def update_ms(self, num_bytes, slots, device):
        return self.fixed_update_ms


def chain(batch=8, features=125, weights=()):
    """x -> a -> b, elementwise ops of shape (batch, features)."""
    shape = (batch, features)
    tensors = {"x": TensorInfo("x", shape, "float32")}
    ops = []
    src = "x"
    for name in ("a", "b"):
        ops.append(Op(name, "Relu", (src,), (f"{name}:0",), (shape,),
                      (shape,), "float32", weights=weights,
                      partitionable={0: SAMPLE}))
        src = f"{name}:0"
        tensors[src] = TensorInfo(src, shape, "float32", name)
    return OpGraph(tuple(ops), tensors, ("x",), (src,), batch)


def dense_graph(batch=8, features=100, units=100):
    shape_in, shape_out = (batch, features), (batch, units)
    op = Op("dense", "Dense", ("x",), ("dense:0",), (shape_in,),
            (shape_out,), "float32",
            (WeightInfo("dense/kernel", (features, units), "float32", True,
                        1),
             WeightInfo("dense/bias", (units,), "float32", True, 0)),
            forward_flops=2.0 * batch * features * units,
            backward_flops=4.0 * batch * features * units,
            partitionable={0: SAMPLE, 1: PARAMETER})
    tensors = {"x": TensorInfo("x", shape_in, "float32"),
               "dense:0": TensorInfo("dense:0", shape_out, "float32",
                                     "dense")}
    return OpGraph((op,), tensors, ("x",), ("dense:0",), batch)


def place(graph, placement):
    return Strategy({
        op.name: ParallelConfig((1,) * op.rank, (placement[op.name],))
        for op in graph
    })


class HandCheckedTest(unittest.TestCase):
    def test_two_ops_on_two_devices_with_a_transfer(self):
        graph, m = chain(), machine(gbps=1.0, latency_us=10.0)
        costs = {"a": (1.0, 2.0), "b": (3.0, 4.0)}
        sim = Simulator(graph, m, FixedCost(m, costs))
        result = sim.simulate(place(graph, {"a": 0, "b": 1}))
        # 8 x 125 float32 = 4000 bytes: 0.010 ms latency + 4000 / 1e6 ms.
        transfer_ms = 0.010 + 0.004
        self.assertAlmostEqual(
            result.step_ms, 1.0 + transfer_ms + 3.0 + 4.0 + transfer_ms + 2.0
        )
        self.assertEqual(result.busy_ms, (3.0, 7.0))
        self.assertEqual(result.comm_bytes, 8000.0)

    def test_two_ops_on_one_device_need_no_transfer(self):
        graph, m = chain(), machine()
        costs = {"a": (1.0, 2.0), "b": (3.0, 4.0)}
        result = Simulator(graph, m, FixedCost(m, costs)).simulate(
            place(graph, {"a": 1, "b": 1})
        )
        self.assertEqual(result.step_ms, 10.0)
        self.assertEqual(result.busy_ms, (0.0, 10.0))
        self.assertEqual(result.comm_bytes, 0.0)

    def test_data_parallel_halves_overlap_on_two_devices(self):
        graph, m = chain(), machine()
        costs = {"a": (1.0, 2.0), "b": (3.0, 4.0)}
        result = Simulator(graph, m, FixedCost(m, costs)).simulate(
            Strategy.data_parallel(graph, 2)
        )
        self.assertEqual(result.step_ms, 10.0)  # parts run side by side
        self.assertEqual(result.busy_ms, (10.0, 10.0))

    def test_allreduce_matches_ring_formula(self):
        graph = dense_graph()
        weight_bytes = (100 * 100 + 100) * 4
        for nodes, per_node, gbps in ((1, 4, 1.0), (2, 2, 0.5)):
            m = machine(nodes, per_node, gbps=1.0, nic_gbps=0.5)
            p = m.num_devices
            sync_ms = 2 * (p - 1) / p * weight_bytes / (gbps * 1e6)
            ms, _ = ring_allreduce_ms(m, tuple(range(p)), weight_bytes)
            self.assertAlmostEqual(ms, sync_ms)
            sim = Simulator(graph, m, FixedCost(m, {"dense": (1.0, 2.0)},
                                                update_ms=0.5))
            result = sim.simulate(Strategy.data_parallel(graph, p))
            self.assertAlmostEqual(result.step_ms, 1 + 2 + sync_ms + 0.5)
            self.assertEqual(result.comm_bytes, 2 * (p - 1) * weight_bytes)

    def test_allreduce_pays_latency_per_step(self):
        m = machine(1, 4, gbps=1.0, latency_us=5.0)
        ms, links = ring_allreduce_ms(m, (0, 1, 2, 3), 4000.0)
        self.assertAlmostEqual(ms, 6 * (0.005 + 1000 / 1e6))
        self.assertEqual(len(links), 4)

    def test_parameter_split_syncs_nothing(self):
        graph, m = dense_graph(), machine(1, 2)
        sim = Simulator(graph, m, FixedCost(m, {"dense": (1.0, 2.0)}, 0.5))
        split = Strategy({"dense": ParallelConfig((1, 2), (0, 1))})
        result = sim.simulate(split)
        self.assertEqual(result.step_ms, 3.5)
        self.assertEqual(result.comm_bytes, 0.0)

    def test_data_parallel_step_grows_with_weight_bytes(self):
        m = load_machine("v100x4")
        steps = []
        for units in (64, 256, 1024, 4096):
            graph = dense_graph(batch=64, features=units, units=units)
            sim = Simulator(graph, m)
            steps.append(sim.simulate(Strategy.data_parallel(graph, 4))
                         .step_ms)
        self.assertEqual(steps, sorted(steps))
        self.assertGreater(steps[-1], 10 * steps[0])


class MemoryTest(unittest.TestCase):
    def setUp(self):
        model = model_zoo.mlp(input_dim=32, hidden=(64,), classes=10)
        self.graph = build_graph(model, 8)
        self.m = load_machine("v100x4")

    def memory(self, strategy, slots):
        sim = Simulator(self.graph, self.m, optimizer_slots=slots)
        return sim.simulate(strategy).peak_memory_bytes

    def test_mlp_on_one_device_sgd_and_adam(self):
        # Weights (32*64 + 64) + (64*10 + 10) = 2762 floats = 11048 B.
        # Outputs kept for backward: 8*64 + 8*10 = 592 floats = 2368 B.
        one = place(self.graph, {"dense_0": 0, "logits": 0})
        self.assertEqual(self.memory(one, 0)[0], 2 * 11048 + 2368)
        self.assertEqual(self.memory(one, 2)[0], 4 * 11048 + 2368)
        self.assertEqual(self.memory(one, 2)[1:], (0, 0, 0))

    def test_three_slots_and_a_bad_count(self):
        one = place(self.graph, {"dense_0": 0, "logits": 0})
        self.assertEqual(self.memory(one, 3)[0], 5 * 11048 + 2368)
        with self.assertRaisesRegex(ValueError, "optimizer_slots=-1"):
            Simulator(self.graph, self.m, optimizer_slots=-1)

    def test_mlp_data_parallel_replicates_weights(self):
        dp = Strategy.data_parallel(self.graph, 2)
        self.assertEqual(self.memory(dp, 1)[:2], (3 * 11048 + 1184,) * 2)

    def test_parameter_split_shards_weights_and_slots(self):
        split = Strategy({
            "dense_0": ParallelConfig((1, 2), (0, 1)),
            "logits": ParallelConfig((1, 1), (0,)),
        })
        # dense_0: 2112 floats halved = 4224 B a device, output halved
        # (256 floats = 1024 B); device 0 receives device 1's half.
        # logits: 650 floats = 2600 B on device 0, output 320 B.
        got = self.memory(split, 2)
        self.assertEqual(got[0], 4 * (4224 + 2600) + 1024 + 320 + 1024)
        self.assertEqual(got[1], 4 * 4224 + 1024)

    def test_over_capacity_is_infeasible(self):
        m = machine(memory_gib=1e-6)  # 1073 bytes
        result = Simulator(dense_graph(), m).simulate(
            Strategy.data_parallel(dense_graph(), 2)
        )
        self.assertFalse(result.feasible)
        self.assertTrue(math.isfinite(result.step_ms))


def small_dlrm_graph():
    return build_graph(model_zoo.dlrm(), 16)


class DeltaTest(unittest.TestCase):
    def assert_delta_equals_full(self, graph, machine_name, count, seed):
        m = load_machine(machine_name)
        n = m.num_devices
        sim = Simulator(graph, m, optimizer_slots=2)
        full = Simulator(graph, m, optimizer_slots=2)
        rng = random.Random(seed)
        strategy = Strategy.data_parallel(graph, n)
        sim.start(strategy)
        ops = list(graph.ops)
        for _ in range(count):
            op = rng.choice(ops)
            config = search_space.random_config(op, n, rng)
            got = sim.propose(op.name, config)
            candidate = strategy.replace(op.name, config)
            want = full.simulate(candidate)
            self.assertTrue(
                math.isclose(got.step_ms, want.step_ms, rel_tol=1e-9),
                (op.name, config, got.step_ms, want.step_ms),
            )
            self.assertEqual(got.peak_memory_bytes, want.peak_memory_bytes)
            self.assertEqual(got.feasible, want.feasible)
            self.assertAlmostEqual(got.comm_bytes, want.comm_bytes)
            for a, b in zip(got.busy_ms, want.busy_ms):
                self.assertTrue(math.isclose(a, b, rel_tol=1e-9))
            if rng.random() < 0.5:
                sim.accept()
                strategy = candidate

    def test_mlp(self):
        graph = build_graph(model_zoo.mlp(), 16)
        self.assert_delta_equals_full(graph, "v100x4", 600, 0)

    def test_cnn_across_nodes(self):
        graph = build_graph(model_zoo.cnn(), 16)
        self.assert_delta_equals_full(graph, "p100x16", 500, 1)

    def test_shared_layer(self):
        graph = build_graph(model_zoo.shared_layer(), 8)
        self.assert_delta_equals_full(graph, "h100x8", 600, 2)

    def test_dlrm(self):
        self.assert_delta_equals_full(small_dlrm_graph(), "v100x4", 600, 3)

    def test_two_input_concat(self):
        graph = build_graph(model_zoo.two_input_concat(), 64)
        self.assert_delta_equals_full(graph, "k80x64", 400, 4)

    def test_several_ops_at_once(self):
        graph = build_graph(model_zoo.transformer_block(), 16)
        m = load_machine("p100x16")
        sim, full = Simulator(graph, m), Simulator(graph, m)
        rng = random.Random(6)
        strategy = Strategy.data_parallel(graph, m.num_devices)
        sim.start(strategy)
        for _ in range(150):
            changes = {
                op.name: search_space.random_config(op, m.num_devices, rng)
                for op in rng.sample(graph.ops, rng.randint(1, 3))
            }
            candidate = strategy
            for name, config in changes.items():
                candidate = candidate.replace(name, config)
            self.assertEqual(sim.propose_many(changes),
                             full.simulate(candidate))
            if rng.random() < 0.5:
                sim.accept()
                strategy = candidate

    def test_bounded_piece_cache_stays_exact(self):
        graph, m = build_graph(model_zoo.cnn(), 16), load_machine("p100x16")
        sim, full = Simulator(graph, m), Simulator(graph, m)
        sim._cache.max_tasks = 200  # evicts on nearly every proposal
        rng = random.Random(5)
        strategy = Strategy.data_parallel(graph, m.num_devices)
        sim.start(strategy)
        for _ in range(150):
            op = rng.choice(graph.ops)
            config = search_space.random_config(op, m.num_devices, rng)
            candidate = strategy.replace(op.name, config)
            self.assertEqual(sim.propose(op.name, config),
                             full.simulate(candidate))
            self.assertTrue(sim._cache.num_tasks <= 200
                            or len(sim._cache) == 1)
            if rng.random() < 0.5:
                sim.accept()
                strategy = candidate

    def test_propose_before_start_is_an_error(self):
        graph, m = chain(), machine()
        with self.assertRaisesRegex(ValueError, "Call `start"):
            Simulator(graph, m).propose("a", ParallelConfig((1, 1), (0,)))

    def test_wrong_rank_is_an_error(self):
        graph, m = chain(), machine()
        sim = Simulator(graph, m)
        sim.start(Strategy.data_parallel(graph, 2))
        with self.assertRaisesRegex(ValueError, "Received: dims=\\(2,\\)"):
            sim.propose("a", ParallelConfig((2,), (0, 1)))


@contextlib.contextmanager
def python_scheduler():
    """Runs the schedule in Python even where the C loop is built."""
    saved = schedule._listsched
    schedule._listsched = None
    try:
        yield
    finally:
        schedule._listsched = saved


class PythonSchedulerDeltaTest(DeltaTest):
    """The Python fallback (no C compiler at install) is exact too."""

    def run(self, result=None):
        with python_scheduler():
            return super().run(result)

    def test_simulations_run_the_python_loop(self):
        """The tests of this class exercise the Python loop: a
        simulation here goes through `_python_schedule`."""
        calls = []
        original = schedule._python_schedule

        def counting(*args):
            calls.append(1)
            return original(*args)

        graph, m = chain(), machine()
        with mock.patch.object(schedule, "_python_schedule", counting):
            Simulator(graph, m).simulate(Strategy.data_parallel(graph, 2))
        self.assertGreater(len(calls), 0)


@unittest.skipIf(
    schedule._listsched is None,
    "flexflow_keras._listsched is not built (no C compiler at install)",
)
class CompiledSchedulerTest(unittest.TestCase):
    """The C loop makes bit for bit the Python loop's schedules."""

    def schedules(self, graph, machine_name, proposals, seed):
        """(full, delta) schedules of a random walk, per implementation."""
        m = load_machine(machine_name)
        rng = random.Random(seed)
        strategy = Strategy({
            op.name: search_space.random_config(op, m.num_devices, rng)
            for op in graph
        })
        walk = [
            (op.name, search_space.random_config(op, m.num_devices, rng))
            for op in (rng.choice(graph.ops) for _ in range(proposals))
        ]
        found = []
        for context in (contextlib.nullcontext, python_scheduler):
            with context():
                sim = Simulator(graph, m, None, 2)
                out = [sim._full(strategy)[3]]
                sim.start(strategy)
                for name, config in walk:
                    sim.propose(name, config)
                    out.append(sim._proposal.schedule)
                    sim.accept()
            found.append(out)
        return found

    def assert_same(self, compiled, python):
        self.assertEqual(len(compiled), len(python))
        for c, p in zip(compiled, python):
            self.assertEqual(c.step_ms, p.step_ms)  # bitwise, not close
            self.assertEqual(list(c.order), list(p.order))
            self.assertEqual(list(c.end), list(p.end))
            self.assertEqual(list(c.ready), list(p.ready))
            self.assertEqual(c.restart_pops, p.restart_pops)

    def test_cnn_on_p100x16(self):
        graph = build_graph(model_zoo.cnn(), 32)
        self.assert_same(*self.schedules(graph, "p100x16", 150, 0))

    def test_dlrm_on_v100x4(self):
        self.assert_same(*self.schedules(small_dlrm_graph(), "v100x4",
                                         150, 1))

    def test_shared_layer_on_k80x64(self):
        graph = build_graph(model_zoo.shared_layer(), 64)
        self.assert_same(*self.schedules(graph, "k80x64", 100, 2))

    def test_cycle_is_an_error_in_both(self):
        graph, m = chain(), machine()
        sim = Simulator(graph, m)
        _, _, g, _ = sim._full(place(graph, {"a": 0, "b": 1}))
        g.succ[g.num_ids - 1].append(0)  # last task feeds the first
        g.npred[0] += 1
        g.sources = [t for t in g.sources if t != 0]
        for context in (contextlib.nullcontext, python_scheduler):
            with context(), self.assertRaisesRegex(ValueError, "cycle"):
                schedule.Schedule.run(g, sim._num_resources())

    def test_wrong_array_type_is_an_error(self):
        graph, m = chain(), machine()
        sim = Simulator(graph, m)
        _, _, g, _ = sim._full(place(graph, {"a": 0, "b": 1}))
        g.dur = array("f", g.dur)  # float32: not the float64 expected
        with self.assertRaisesRegex(TypeError, "`dur` must be an array of "
                                    "float64.*received format 'f'"):
            schedule.Schedule.run(g, sim._num_resources())
        g.dur = array("d", [1.0])  # too short
        with self.assertRaisesRegex(TypeError, "at least"):
            schedule.Schedule.run(g, sim._num_resources())


@pytest.mark.slow
class DeltaStressTest(unittest.TestCase):
    """Bitwise equality from random start strategies on every preset."""

    def test_every_zoo_model_on_every_preset(self):
        cases = [
            (model_zoo.mlp(), 64, "p100x16"),
            (model_zoo.cnn(), 64, "k80x64"),
            (model_zoo.transformer_block(), 16, "v100x4"),
            (model_zoo.nested(), 16, "h100x8"),
            (model_zoo.shared_layer(), 64, "h100x64"),
            (model_zoo.dlrm(), 64, "h100x64"),
        ]
        for model, batch, name in cases:
            graph, m = build_graph(model, batch), load_machine(name)
            n, rng = m.num_devices, random.Random(7)
            sim, full = Simulator(graph, m, None, 1), Simulator(graph, m,
                                                                None, 1)
            strategy = Strategy({
                op.name: search_space.random_config(op, n, rng)
                for op in graph
            })
            sim.start(strategy)
            for _ in range(1000):
                op = rng.choice(graph.ops)
                config = search_space.random_config(op, n, rng)
                candidate = strategy.replace(op.name, config)
                self.assertEqual(sim.propose(op.name, config),
                                 full.simulate(candidate))
                if rng.random() < 0.5:
                    sim.accept()
                    strategy = candidate


class SharedWeightsTest(unittest.TestCase):
    def test_sharer_syncs_with_owner_once(self):
        graph = build_graph(model_zoo.shared_layer(input_dim=8, units=16), 8)
        m = load_machine("v100x4")
        result = Simulator(graph, m).simulate(
            Strategy.data_parallel(graph, 4)
        )
        shared = (8 * 16 + 16) * 4
        head = (16 + 1) * 4
        self.assertEqual(result.comm_bytes, 2 * 3 * (shared + head))


class TraceTest(unittest.TestCase):
    def test_chrome_trace_has_a_track_per_device_and_link(self):
        graph, m = chain(), machine(gbps=1.0, latency_us=10.0)
        costs = {"a": (1.0, 2.0), "b": (3.0, 4.0)}
        sim = Simulator(graph, m, FixedCost(m, costs))
        strategy = place(graph, {"a": 0, "b": 1})
        trace = json.loads(json.dumps(sim.timeline(strategy)))
        names = {e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "thread_name"}
        self.assertEqual(len(names), m.num_devices + len(m.links))
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        self.assertEqual(len(spans), 6)  # fwd, bwd x 2, two transfers
        end_us = max(e["ts"] + e["dur"] for e in spans)
        self.assertAlmostEqual(end_us, 10.028 * 1e3)
        # A transfer's detail names its tensor and its two devices.
        moves = sorted(e["args"]["detail"].split(" ")[-1] for e in spans
                       if e["cat"].startswith("xfer"))
        self.assertEqual(moves, ["0->1", "1->0"])

    def test_written_trace_loads_back(self):
        graph = build_graph(model_zoo.mlp(), 16)
        sim = Simulator(graph, load_machine("p100x16"))
        sim.start(Strategy.data_parallel(graph, 16))
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            write_trace(path, sim.timeline())
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        phases = {e["ph"] for e in events}
        self.assertEqual(phases, {"M", "X"})
        for e in events:
            if e["ph"] == "X":
                self.assertGreaterEqual(e["dur"], 0)
                self.assertIn(e["pid"], (0, 1))


if __name__ == "__main__":
    unittest.main()
