"""The SOAP search space: every proposal is a config the op can take."""

import math
import random
import unittest

from hand_graphs import hand_graph
from flexflow_keras.search_space import random_config, valid_configs
from flexflow_keras.search_space import twin_groups, valid_dims
from flexflow_keras.strategy import ParallelConfig, validate_config


class SearchSpaceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.graph = hand_graph(batch=8)
        cls.dense = cls.graph.op("dense_0")  # (8, 6): sample, parameter
        cls.relu = cls.graph.op("relu")  # (8, 2): sample only

    def test_valid_dims_of_dense_by_hand(self):
        # Batch 8 -> 1, 2, 4; units 6 -> 1, 2, 3; product <= 4.
        self.assertEqual(
            valid_dims(self.dense, 4),
            [(1, 1), (1, 2), (2, 1), (1, 3), (2, 2), (4, 1)],
        )

    def test_valid_dims_only_on_partitionable_dims(self):
        self.assertEqual(valid_dims(self.relu, 8), [(1, 1), (2, 1), (4, 1),
                                                    (8, 1)])

    def test_valid_configs_count_every_ordered_device_choice(self):
        configs = list(valid_configs(self.dense, 4))
        expected = sum(
            math.perm(4, math.prod(dims)) for dims in valid_dims(self.dense, 4)
        )
        self.assertEqual(len(configs), expected)
        self.assertEqual(len(set(configs)), expected)
        for config in configs:
            validate_config(self.dense, config, 4)

    def test_single_device_placement_on_every_device(self):
        configs = set(valid_configs(self.dense, 4))
        for k in range(4):
            self.assertIn(ParallelConfig((1, 1), (k,)), configs)

    def test_contiguous_placement(self):
        configs = list(valid_configs(self.relu, 4, placement="contiguous"))
        self.assertEqual(
            [(c.dims, c.device_ids) for c in configs],
            [((1, 1), (0,)), ((1, 1), (1,)), ((1, 1), (2,)),
             ((1, 1), (3,)), ((2, 1), (0, 1)), ((2, 1), (1, 2)),
             ((2, 1), (2, 3)), ((4, 1), (0, 1, 2, 3))],
        )

    def test_rejects_unknown_placement(self):
        with self.assertRaisesRegex(ValueError, "placement='ring'"):
            list(valid_configs(self.relu, 4, placement="ring"))

    def test_random_configs_are_valid_and_cover_the_space(self):
        rng = random.Random(0)
        seen = set()
        for _ in range(5000):
            config = random_config(self.dense, 4, rng)
            validate_config(self.dense, config, 4)
            seen.add(config)
        # Covers every degree tuple, every lone device, and permutations.
        self.assertEqual(
            {c.dims for c in seen}, set(valid_dims(self.dense, 4))
        )
        lone = {c.device_ids for c in seen if c.num_parts == 1}
        self.assertEqual(lone, {(0,), (1,), (2,), (3,)})
        self.assertIn(ParallelConfig((2, 1), (3, 0)), seen)

    def test_random_config_is_reproducible(self):
        a = [random_config(self.dense, 4, random.Random(7)) for _ in "ab"]
        self.assertEqual(a[0], a[1])

    def test_random_config_on_a_large_machine(self):
        rng = random.Random(1)
        for op in self.graph:
            for _ in range(200):
                validate_config(op, random_config(op, 64, rng), 64)


class TwinGroupsTest(unittest.TestCase):
    def test_alike_ops_group_and_shared_or_other_ones_do_not(self):
        import keras

        from flexflow_keras.keras_graph import build_graph

        x = keras.Input((8,), name="x")
        shared = keras.layers.Dense(8, name="shared")
        twins = [keras.layers.Dense(8, name=f"twin_{k}")(x) for k in range(3)]
        other = keras.layers.Dense(4, name="other")(x)  # another shape
        calls = [shared(t) for t in twins[:2]]  # one layer called twice
        model = keras.Model(x, [*twins, other, *calls])
        graph = build_graph(model, 16)
        groups = twin_groups(graph)  # in graph order
        self.assertEqual([sorted(g) for g in groups],
                         [["twin_0", "twin_1", "twin_2"]])
        order = [op.name for op in graph]
        self.assertEqual(list(groups[0]), sorted(groups[0], key=order.index))


class OneMeshTest(unittest.TestCase):
    """Strategies for models that run their own step: one mesh."""

    @classmethod
    def setUpClass(cls):
        from flexflow_keras import search_space

        cls.space = search_space
        cls.graph = hand_graph(batch=8)

    def test_configs_split_one_dim_over_the_same_devices(self):
        dense = self.graph.op("dense_0")  # (8, 6): 6 splits 2 ways only
        # The unsplit config last: the op replicated on the mesh.
        self.assertEqual(self.space.one_mesh_configs(dense, 2), [
            ParallelConfig((2, 1), (0, 1)), ParallelConfig((1, 2), (0, 1)),
            ParallelConfig((1, 1), (0,)),
        ])
        self.assertEqual(self.space.one_mesh_configs(dense, 4), [
            ParallelConfig((4, 1), (0, 1, 2, 3)), ParallelConfig((1, 1), (0,)),
        ])
        self.assertEqual(self.space.one_mesh_configs(dense, 1), [
            ParallelConfig((1, 1), (0,)),
        ])

    def test_devices_are_the_most_every_op_can_split_into(self):
        self.assertEqual(self.space.one_mesh_devices(self.graph, 4), 4)
        # Batch 6: 4 does not divide it; 3 does for every op.
        self.assertEqual(
            self.space.one_mesh_devices(hand_graph(batch=6), 4), 3
        )

    def test_planning_meshes_then_smaller_1d_meshes(self):
        def shapes(parts, num_devices):
            return [(m.shape, m.devices)
                    for m in self.space.planning_meshes(parts, num_devices)]

        self.assertEqual(shapes(4, 4), [((4,), (0, 1, 2, 3)),
                                        ((2, 2), (0, 1, 2, 3)),
                                        ((2,), (0, 1))])
        self.assertEqual(shapes(8, 8)[-2:], [((4,), (0, 1, 2, 3)),
                                             ((2,), (0, 1))])
        self.assertEqual(shapes(3, 4), [((3,), (0, 1, 2))])
        self.assertEqual(shapes(2, 2), [((2,), (0, 1))])
        # Across DTensor clients every mesh holds all devices.
        self.assertEqual(
            [m.shape for m in self.space.planning_meshes(4, 4, fewer=False)],
            [(4,), (2, 2)])

    def test_data_parallel_and_random_strategies_are_one_mesh(self):
        strategy = self.space.one_mesh_data_parallel(self.graph, 4)
        self.assertTrue(self.space.is_one_mesh(strategy))
        rng = random.Random(0)
        for _ in range(50):
            drawn = self.space.random_strategy(self.graph, 4, rng, 2)
            self.assertTrue(self.space.is_one_mesh(drawn), drawn)
            drawn.validate(self.graph, 4)

    def test_is_one_mesh_tells_placements_and_mesh_shapes_apart(self):
        from flexflow_keras.strategy import Strategy

        names = [op.name for op in self.graph]
        same = {n: ParallelConfig((4, 1), (0, 1, 2, 3)) for n in names}
        self.assertTrue(self.space.is_one_mesh(Strategy(same)))
        moved = dict(same, relu=ParallelConfig((4, 1), (1, 0, 2, 3)))
        self.assertFalse(self.space.is_one_mesh(Strategy(moved)))
        grid = dict(same, dense_0=ParallelConfig((2, 2), (0, 1, 2, 3)))
        self.assertFalse(self.space.is_one_mesh(Strategy(grid)))

    def test_search_with_one_mesh_stays_on_it(self):
        from flexflow_keras import machine, search, simulator

        sim = simulator.Simulator(self.graph, machine.load_machine("v100x4"))
        result = search.search(self.graph, sim, 4, budget=200, seed=3,
                               verbose=0, one_mesh_parts=4,
                               propagation=0.5)
        self.assertTrue(self.space.is_one_mesh(result.strategy))
        self.assertLessEqual(
            result.best_ms,
            sim.simulate(
                self.space.one_mesh_data_parallel(self.graph, 4)
            ).step_ms,
        )
