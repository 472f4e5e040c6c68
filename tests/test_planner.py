"""The compile-time pipeline (`planner.make_plan`): import, data
parallelism, search, export, the one-mesh rule and optimizer slots."""

import os
import tempfile
import unittest

import keras

import model_zoo
from flexflow_keras import planner
from flexflow_keras.optimizer_slots import optimizer_slots
from flexflow_keras.search_space import is_one_mesh
from flexflow_keras.settings import Settings
from flexflow_keras.strategy import ParallelConfig, Strategy
from flexflow_keras.strategy_files import load_strategy, save_strategy


def _mlp():
    keras.backend.clear_session()
    return model_zoo.mlp()


def _data_parallel_plan(model, **kwargs):
    return planner.make_plan(
        model, 64, Settings(search_budget=0, machine="v100x4"), verbose=0,
        **kwargs,
    )


class MakePlanTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()

    def test_budget_zero_keeps_data_parallelism(self):
        plan = _data_parallel_plan(_mlp())
        self.assertEqual(plan.source, "data_parallel")
        self.assertIsNone(plan.search_result)
        self.assertEqual(plan.strategy,
                         Strategy.data_parallel(plan.graph, 4))
        self.assertGreater(plan.step_ms, 0)
        self.assertEqual(set(plan.per_op_ms), {op.name for op in plan.graph})

    def test_search_exports_what_it_found(self):
        model = _mlp()
        path = os.path.join(self.dir, "s.txt")
        lines = []
        plan = planner.make_plan(
            model, 64, Settings(search_budget=200, search_seed=0,
                                machine="v100x4", export_strategy=path),
            verbose=1, print_fn=lines.append,
        )
        self.assertEqual(plan.source, "search")
        self.assertEqual(plan.search_result.iterations, 200)
        self.assertEqual(load_strategy(path, plan.graph, 4), plan.strategy)
        self.assertTrue(any("Best Discovered Strategy" in line
                            for line in lines))
        self.assertLessEqual(plan.step_ms,
                             plan.search_result.data_parallel_ms)

    def test_imported_strategy_skips_the_search(self):
        model = _mlp()
        graph = _data_parallel_plan(model).graph
        strategy = Strategy.data_parallel(graph, 4).replace(
            graph.ops[0].name, ParallelConfig((1, 4), (3, 2, 1, 0))
        )
        path = os.path.join(self.dir, "in.pb")
        save_strategy(strategy, path)
        plan = planner.make_plan(
            model, 64, Settings(machine="v100x4", import_strategy=path),
            verbose=0,
        )
        self.assertEqual(plan.source, "import")
        self.assertEqual(plan.strategy, strategy)

    def test_shared_layer_keeps_one_mesh(self):
        keras.backend.clear_session()
        model = model_zoo.shared_layer()
        plan = planner.make_plan(
            model, 16, Settings(search_budget=300, search_seed=1,
                                machine="v100x4"),
            verbose=0,
        )
        self.assertTrue(is_one_mesh(plan.strategy, 4))  # v100x4
        self.assertEqual(plan.strategy["shared"], plan.strategy["shared#1"])

    def test_slots_override_prices_optimizer_memory(self):
        model = _mlp()
        sgd = _data_parallel_plan(model, slots=0)
        adam = _data_parallel_plan(model, slots=2)
        self.assertEqual(sgd.strategy, adam.strategy)
        self.assertEqual(
            optimizer_slots(keras.optimizers.Adam()), 2
        )
        self.assertEqual(optimizer_slots(keras.optimizers.SGD()), 0)
        self.assertEqual(
            optimizer_slots(keras.optimizers.SGD(momentum=0.9)), 1
        )
        self.assertEqual(
            optimizer_slots(keras.optimizers.Adam(amsgrad=True)), 3
        )
        # Optimizer state counts in the simulated step (its updates).
        self.assertGreater(adam.step_ms, sgd.step_ms)

    def test_one_device_is_planned_without_search_or_measuring(self):
        # One device holds one strategy (Keras's own step): no op is
        # timed, nothing searched; an export still writes it.
        from unittest import mock

        from flexflow_keras import machine as machine_lib
        from flexflow_keras import simulator

        one = machine_lib.MachineModel(
            "v100x1", machine_lib._V100, 1, 1,
            machine_lib.LinkGroup("nvlink", 50.0, 0.002),
        )
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "one.txt")
            with mock.patch.object(machine_lib, "load_machine",
                                   return_value=one), \
                    mock.patch.object(simulator, "Simulator",
                                      side_effect=AssertionError("priced")):
                plan = planner.make_plan(
                    _mlp(), 64, Settings(search_budget=500,
                                         export_strategy=path), verbose=0,
                )
            self.assertEqual(plan.strategy,
                             Strategy.data_parallel(plan.graph, 1))
            self.assertIsNone(plan.search_result)
            self.assertEqual(load_strategy(path, plan.graph, 1),
                             plan.strategy)

    def test_search_candidates(self):
        # The expert strategy, then data parallelism over each smaller
        # count of devices dividing the machine's; none on one mesh.
        graph = _data_parallel_plan(_mlp()).graph
        expert, *fewer = planner.search_candidates(graph, 8)
        expert.validate(graph, 8)
        self.assertEqual(fewer, [Strategy.data_parallel(graph, 2),
                                 Strategy.data_parallel(graph, 4)])
        for strategy in fewer:
            strategy.validate(graph, 8)
        self.assertEqual(len(planner.search_candidates(graph, 2)), 1)
        self.assertEqual(planner.search_candidates(graph, 4, 4), ())


if __name__ == "__main__":
    unittest.main()


class OneDeviceWhenNothingFitsTest(unittest.TestCase):
    """Virtual CPU devices share the host's memory: when no strategy over
    them fits (keras.io's image_classification_from_scratch was killed for
    memory) but the model on one does, it trains on one device."""

    @staticmethod
    def _machine(memory):
        """4 live virtual CPU devices of `memory` bytes each."""
        from flexflow_keras import machine as machine_lib

        return machine_lib.MachineModel(
            "live", machine_lib.DeviceSpec("CPU", 0, 50e9, memory, 20.0,
                                           0.002),
            1, 4, machine_lib.LinkGroup("host", 10.0, 0.005), live=True,
        )

    def _plan(self, memory):
        from unittest import mock

        from flexflow_keras import machine as machine_lib

        keras.backend.clear_session()
        model = model_zoo.mlp()
        with mock.patch.object(machine_lib, "load_machine",
                               return_value=self._machine(memory)):
            return planner.make_plan(
                model, 64, Settings(search_budget=0, machine="live"),
                verbose=0,
            )

    def test_one_device_when_only_the_whole_host_fits(self):
        import warnings

        from flexflow_keras import simulator

        roomy = self._plan(2**40)
        self.assertEqual(roomy.source, "data_parallel")
        sim = simulator.Simulator(roomy.graph, roomy.machine,
                                  optimizer_slots=optimizer_slots(None))
        spread = max(sim.simulate(roomy.strategy).peak_memory_bytes)
        whole = sim.simulate(Strategy.data_parallel(roomy.graph, 1))
        memory = (whole.peak_memory_bytes[0] + 3) // 4 + 1
        self.assertGreater(spread, memory)  # the four-way plan cannot fit
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = self._plan(memory)
        self.assertEqual(plan.source, "one_device")
        self.assertEqual({c.device_ids for c in plan.strategy.values()},
                         {(0,)})
        self.assertTrue(any("trains on one device" in str(w.message)
                            for w in caught))
        # Not even the whole host: the plan stays as it was.
        self.assertEqual(self._plan(memory // 8).source, "data_parallel")
        # Fits as the simulator counts, not as DTensor holds it on CPU
        # devices (planner.DTENSOR_CPU_MEMORY_FACTOR): one device.
        tight = int(spread * (1 + planner.DTENSOR_CPU_MEMORY_FACTOR) / 2)
        self.assertGreaterEqual(4 * tight, whole.peak_memory_bytes[0])
        self.assertEqual(self._plan(tight).source, "one_device")
        roomier = int(spread * planner.DTENSOR_CPU_MEMORY_FACTOR) + 1
        self.assertEqual(self._plan(roomier).source, "data_parallel")

    def test_a_plan_over_fewer_devices_may_use_their_share_of_the_host(self):
        """The devices share one pool: a plan over 2 of 4 devices that
        needs more than a quarter of the host on each, but less than
        the host in all, keeps its strategy (keras.io's transfer-learning
        guide was sent to one device)."""
        import dataclasses
        import warnings

        from flexflow_keras import simulator

        roomy = self._plan(2**40)
        two = Strategy.data_parallel(roomy.graph, 2)
        plan = dataclasses.replace(roomy, strategy=two, source="search")

        def checked(memory):
            machine = self._machine(memory)
            sim = simulator.Simulator(plan.graph, machine,
                                      optimizer_slots=optimizer_slots(None))
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                return planner._one_device_if_nothing_fits(
                    model_zoo.mlp(), plan, sim, machine)

        sim = simulator.Simulator(plan.graph, roomy.machine,
                                  optimizer_slots=optimizer_slots(None))
        peaks = sim.simulate(two).peak_memory_bytes
        self.assertEqual(sum(1 for p in peaks if p), 2)
        pooled = sum(peaks) * planner.DTENSOR_CPU_MEMORY_FACTOR
        share = int(pooled / 4) + 1  # the host fits the two devices' sum
        self.assertGreater(max(peaks) * planner.DTENSOR_CPU_MEMORY_FACTOR,
                           share)  # but not one device's share
        self.assertEqual(checked(share).source, "search")
        self.assertEqual(checked(int(pooled / 4 * 0.9)).source,
                         "one_device")
