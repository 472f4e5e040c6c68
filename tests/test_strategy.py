"""Strategy values and their validation against an OpGraph."""

import unittest

from hand_graphs import hand_graph
from flexflow_keras.strategy import ParallelConfig, Strategy, validate_config


class ParallelConfigTest(unittest.TestCase):
    def test_fields_become_int_tuples(self):
        config = ParallelConfig([2, 1], [1, 0])
        self.assertEqual(config.dims, (2, 1))
        self.assertEqual(config.device_ids, (1, 0))
        self.assertEqual(
            str(config), "num_dims(2) dims[2,1] device_ids[1,0]"
        )

    def test_rejects_part_count_mismatch(self):
        with self.assertRaisesRegex(ValueError, "prod\\(dims\\)"):
            ParallelConfig((2, 2), (0, 1, 2))

    def test_rejects_repeated_device(self):
        with self.assertRaisesRegex(ValueError, "distinct"):
            ParallelConfig((2,), (1, 1))

    def test_rejects_zero_degree(self):
        with self.assertRaisesRegex(ValueError, ">= 1"):
            ParallelConfig((0, 1), ())


class ValidateConfigTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.graph = hand_graph()
        cls.dense = cls.graph.op("dense_0")  # output (8, 6)
        cls.relu = cls.graph.op("relu")  # opaque: batch dim only

    def test_accepts_sample_parameter_and_single_device(self):
        for dims, ids in (((2, 1), (3, 0)), ((2, 2), (0, 1, 2, 3)),
                          ((1, 3), (2, 0, 1)), ((1, 1), (3,))):
            validate_config(self.dense, ParallelConfig(dims, ids), 4)

    def test_rejects_wrong_rank_naming_op(self):
        with self.assertRaisesRegex(
            ValueError, "Op 'dense_0'.*2 entries.*Received: dims=\\(2,\\)"
        ):
            validate_config(self.dense, ParallelConfig((2,), (0, 1)), 4)

    def test_rejects_dim_the_op_cannot_split(self):
        with self.assertRaisesRegex(
            ValueError,
            "Op 'relu' \\(Activation\\) cannot split output dim 1.*"
            "Received: dims=\\(1, 2\\).*0 \\(sample\\)",
        ):
            validate_config(self.relu, ParallelConfig((1, 2), (0, 1)), 4)

    def test_rejects_indivisible_degree(self):
        with self.assertRaisesRegex(
            ValueError, "dim 1 has size 6.*4 parts.*dims=\\(1, 4\\)"
        ):
            validate_config(
                self.dense, ParallelConfig((1, 4), (0, 1, 2, 3)), 8
            )

    def test_rejects_devices_the_machine_lacks(self):
        with self.assertRaisesRegex(
            ValueError, "'dense_0' names devices.*device_ids=\\(0, 4\\).*"
            "4 devices"
        ):
            validate_config(self.dense, ParallelConfig((2, 1), (0, 4)), 4)


class StrategyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.graph = hand_graph()

    def test_data_parallel_splits_batch_over_all_devices(self):
        strategy = Strategy.data_parallel(self.graph, 4)
        self.assertEqual(set(strategy), {op.name for op in self.graph})
        for config in strategy.values():
            self.assertEqual(config, ParallelConfig((4, 1), (0, 1, 2, 3)))
        strategy.validate(self.graph, 4)

    def test_data_parallel_splits_the_batch_as_far_as_it_divides(self):
        # 3 devices do not divide batch 8: 2 parts of the batch, and the
        # Dense ops (6 channels) split their channels too; `relu` may
        # split only the batch. Issue 21: never an error.
        strategy = Strategy.data_parallel(self.graph, 3)
        strategy.validate(self.graph, 3)
        self.assertEqual(strategy["dense_0"], ParallelConfig((2, 1), (0, 1)))
        self.assertEqual(strategy["relu"], ParallelConfig((2, 1), (0, 1)))

    def test_replace_returns_new_strategy(self):
        strategy = Strategy.data_parallel(self.graph, 2)
        config = ParallelConfig((1, 1), (1,))
        changed = strategy.replace("dense_1", config)
        self.assertEqual(changed["dense_1"], config)
        self.assertNotEqual(strategy["dense_1"], config)
        self.assertNotEqual(changed, strategy)

    def test_validate_rejects_foreign_ops(self):
        strategy = Strategy.data_parallel(self.graph, 2).replace(
            "conv_9", ParallelConfig((1,), (0,))
        )
        with self.assertRaisesRegex(ValueError, "lacks: \\['conv_9'\\]"):
            strategy.validate(self.graph, 2)

    def test_validate_rejects_missing_ops(self):
        configs = dict(Strategy.data_parallel(self.graph, 2))
        del configs["relu"]
        with self.assertRaisesRegex(ValueError, "no config for ops.*relu"):
            Strategy(configs).validate(self.graph, 2)

    def test_validate_names_the_bad_op(self):
        strategy = Strategy.data_parallel(self.graph, 2).replace(
            "dense_2", ParallelConfig((1, 4), (0, 1, 2, 3))
        )
        with self.assertRaisesRegex(ValueError, "'dense_2'"):
            strategy.validate(self.graph, 4)

    def test_to_text_is_flexflow_form(self):
        strategy = Strategy({"dense_1": ParallelConfig((4, 1), range(4))})
        self.assertEqual(
            strategy.to_text(),
            "[dense_1] num_dims(2) dims[4,1] device_ids[0,1,2,3]\n",
        )
