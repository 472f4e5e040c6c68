"""What a part reads of its inputs: the simulator's geometry is the
runtime's layout (one rule, `partition.split_input_dims`)."""

import random
import unittest

import keras

import model_zoo
from flexflow_keras import cost, devices, partition, search_space
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.runtime import layouts
from flexflow_keras.strategy import ParallelConfig, Strategy

NUM_DEVICES = 4


def single_op_graph(layer, input_shape, batch=8):
    inputs = keras.Input(input_shape)
    model = keras.Model(inputs, layer(inputs))
    graph = build_graph(model, batch)
    return graph, graph.ops[0]


class InputRegionTest(unittest.TestCase):
    def test_batchnorm_channel_split_reads_its_channels(self):
        _, op = single_op_graph(keras.layers.BatchNormalization(), (4, 4, 8))
        config = ParallelConfig((1, 1, 1, 4), (0, 1, 2, 3))
        rect = partition.part_rects(op.output_shape, config.dims)[1]
        self.assertEqual(partition.input_region(op, 0, rect),
                         ((0, 8), (0, 4), (0, 4), (2, 4)))
        self.assertEqual(cost.shard_shapes(op, config)[0], ((8, 4, 4, 2),))

    def test_dense_unit_split_reads_every_feature(self):
        _, op = single_op_graph(keras.layers.Dense(8), (6,))
        rect = partition.part_rects(op.output_shape, (2, 2))[3]
        self.assertEqual(partition.input_region(op, 0, rect),
                         ((4, 8), (0, 6)))

    def test_global_pooling_channel_split_reads_the_whole_input(self):
        # Height equals channels (8): a position-by-position mapping
        # would wrongly take a height slice for a channel slice.
        _, op = single_op_graph(keras.layers.GlobalAveragePooling2D(),
                                (8, 3, 8))
        rect = partition.part_rects(op.output_shape, (1, 4))[2]
        self.assertEqual(partition.input_region(op, 0, rect),
                         ((0, 8), (0, 8), (0, 3), (0, 8)))

    def test_convolution_splits_only_the_batch(self):
        _, op = single_op_graph(keras.layers.Conv2D(4, 3, padding="same"),
                                (6, 6, 2))
        rect = partition.part_rects(op.output_shape, (2, 1, 1, 1))[1]
        self.assertEqual(partition.input_region(op, 0, rect),
                         ((4, 8), (0, 6), (0, 6), (0, 2)))


class RuntimeAgreesTest(unittest.TestCase):
    """Part 0's input region is narrower than the input exactly on the
    dims the runtime's input layout shards."""

    def test_random_configs_of_zoo_models(self):
        meshes = layouts.MeshCache(devices.device_names()[:NUM_DEVICES])
        rng = random.Random(0)
        checked = 0
        for build, batch in ((model_zoo.cnn, 8), (model_zoo.transformer_block,
                                                  8), (model_zoo.dlrm, 8)):
            graph = build_graph(build(), batch)
            for _ in range(5):
                strategy = Strategy({
                    op.name: search_space.random_config(op, NUM_DEVICES, rng)
                    for op in graph
                })
                strategy, _ = search_space.tie_shared(graph, strategy)
                for plan in layouts.plan_ops(graph, strategy, meshes):
                    op = plan.op
                    config = strategy[op.name]
                    rect = partition.part_rects(op.output_shape,
                                                config.dims)[0]
                    for k, shape in enumerate(op.input_shapes):
                        layout = plan.input_layout(k, shape, True)
                        sharded = {d for d, spec in
                                   enumerate(layout.sharding_specs)
                                   if spec != layouts.UNSHARDED}
                        region = partition.input_region(op, k, rect)
                        narrow = {d for d, (lo, hi) in enumerate(region)
                                  if hi - lo < shape[d]}
                        self.assertEqual(sharded, narrow, (op.name, config))
                        checked += 1
        self.assertGreater(checked, 100)


if __name__ == "__main__":
    unittest.main()
