"""The SOAP search space: every proposal is a config the op can take."""

import math
import random
import unittest

from hand_graphs import hand_graph
from flexflow_keras.search_space import random_config, valid_configs
from flexflow_keras.search_space import valid_dims
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
