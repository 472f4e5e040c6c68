"""Tests for keras_graph.py and graph.py: the walk from Keras models to
ops and tensors (shapes, order, nesting, shared layers, bad models).

Shapes are checked against Keras's own shape inference (`graph_checks`).
"""

import unittest

import keras
import model_zoo
import numpy as np
from graph_checks import BATCH, GraphAssertions

from flexflow_keras.graph import ATTRIBUTE, PARAMETER, SAMPLE
from flexflow_keras.keras_graph import VARYING_DIM_SIZE, build_graph


class MlpGraphTest(GraphAssertions):
    def test_ops_tensors_and_shapes_match_keras(self):
        graph = self.assert_consistent(model_zoo.mlp())
        self.assertEqual(
            [op.name for op in graph], ["dense_0", "dense_1", "logits"]
        )
        self.assertEqual(graph.inputs, ("x",))
        self.assertEqual(graph.outputs, ("logits:0",))
        self.assertEqual(graph.op("dense_1").inputs, ("dense_0:0",))
        self.assertEqual(graph.op("logits").output_shapes, ((BATCH, 10),))
        self.assertEqual(
            graph.successors(graph.op("dense_0")), (graph.op("dense_1"),)
        )

    def test_dense_flops_match_hand_count(self):
        op = build_graph(model_zoo.mlp(), BATCH).op("dense_0")
        matmul = 2 * BATCH * 32 * 64  # multiply-add = 2 FLOPs
        bias = BATCH * 64
        relu = BATCH * 64
        self.assertTrue(op.flops_exact)
        self.assertEqual(op.forward_flops, matmul + bias + relu)
        # data grad + kernel grad (a matmul each), bias grad, relu grad
        self.assertEqual(op.backward_flops, 2 * matmul + bias + relu)
        linear = build_graph(model_zoo.mlp(), BATCH).op("logits")
        self.assertEqual(linear.forward_flops, 2 * BATCH * 64 * 10 + BATCH * 10)

    def test_dense_splits_units_and_shards_kernel_columns(self):
        op = build_graph(model_zoo.mlp(), BATCH).op("dense_0")
        self.assertEqual(op.partitionable, {0: SAMPLE, 1: PARAMETER})
        axes = {w.path: w.shard_axis for w in op.weights}
        self.assertEqual(axes, {"dense_0/kernel": 1, "dense_0/bias": 0})

    def test_weight_bytes_count_all_variables(self):
        graph = build_graph(model_zoo.mlp(), BATCH)
        params = (32 * 64 + 64) + (64 * 64 + 64) + (64 * 10 + 10)
        self.assertEqual(graph.weight_bytes, params * 4)

    def test_rank3_dense_flops_and_middle_dim_attribute(self):
        inputs = keras.Input(shape=(5, 6))
        outputs = keras.layers.Dense(7, use_bias=False, name="d")(inputs)
        graph = self.assert_consistent(keras.Model(inputs, outputs))
        op = graph.op("d")
        self.assertEqual(op.forward_flops, 2 * BATCH * 5 * 6 * 7)
        self.assertEqual(op.backward_flops, 4 * BATCH * 5 * 6 * 7)
        self.assertEqual(
            op.partitionable, {0: SAMPLE, 1: ATTRIBUTE, 2: PARAMETER}
        )

    def test_rejects_bad_batch_size(self):
        with self.assertRaisesRegex(ValueError, "Received: batch_size=0"):
            build_graph(model_zoo.mlp(), 0)

class FillArgumentsTest(GraphAssertions):
    def test_by_position_tells_one_tensor_apart(self):
        # `mha(x, x)` and a keyword call: by position each argument gets
        # its own value; by name, one tensor gets one value.
        import keras

        from flexflow_keras.keras_graph import fill_arguments

        x = keras.Input((4, 6), name="x")
        y = keras.Input((5, 6), name="y")
        a = keras.layers.MultiHeadAttention(2, 3, name="self")(x, x)
        b = keras.layers.MultiHeadAttention(2, 3, name="cross")(
            query=a, value=y, key=y)
        graph = build_graph(keras.Model([x, y], b), 2)
        args, _ = fill_arguments(graph.op("self"), ["query", "value"])
        self.assertEqual(args, ("query", "value"))
        by_name = fill_arguments(graph.op("self"), {"x": "both"})[0]
        self.assertEqual(by_name, ("both", "both"))
        cross = graph.op("cross")
        _, kwargs = fill_arguments(cross, ["k", "q", "v"])
        self.assertEqual(kwargs, {"key": "k", "query": "q", "value": "v"})


class MultiInputGraphTest(GraphAssertions):
    def test_two_input_concat(self):
        graph = self.assert_consistent(model_zoo.two_input_concat())
        self.assertEqual(graph.inputs, ("a", "b"))
        concat = graph.op("concat")
        self.assertEqual(concat.inputs, ("dense_a:0", "dense_b:0"))
        self.assertEqual(concat.output_shape, (BATCH, 32))
        self.assertEqual(concat.forward_flops, 0)
        self.assertEqual(concat.partitionable, {0: SAMPLE})  # dim 1 joined
        self.assertEqual(
            {p.name for p in graph.predecessors(concat)},
            {"dense_a", "dense_b"},
        )

    def test_multi_output_model(self):
        inputs = keras.Input(shape=(6,), name="x")
        h = keras.layers.Dense(8, name="trunk")(inputs)
        a = keras.layers.Dense(2, name="head_a")(h)
        b = keras.layers.Dense(3, name="head_b")(h)
        graph = self.assert_consistent(keras.Model(inputs, [a, b]))
        self.assertEqual(graph.outputs, ("head_a:0", "head_b:0"))
        self.assertEqual(
            {op.name for op in graph.consumers("trunk:0")},
            {"head_a", "head_b"},
        )

    def test_multi_output_layer_is_sample_only(self):
        inputs = keras.Input(shape=(5, 3))
        seq, h, c = keras.layers.LSTM(
            4, return_sequences=True, return_state=True, name="lstm"
        )(inputs)
        graph = self.assert_consistent(keras.Model(inputs, [seq, h, c]))
        op = graph.op("lstm")
        self.assertEqual(op.outputs, ("lstm:0", "lstm:1", "lstm:2"))
        self.assertEqual(
            op.output_shapes, ((BATCH, 5, 4), (BATCH, 4), (BATCH, 4))
        )
        self.assertEqual(op.partitionable, {0: SAMPLE})

class NestedGraphTest(GraphAssertions):
    def test_sequential_submodel_is_flattened(self):
        graph = self.assert_consistent(model_zoo.nested("sequential"))
        self.assertEqual(
            [op.name for op in graph], ["pre", "inner/a", "inner/b", "head"]
        )
        self.assertEqual(graph.op("inner/a").inputs, ("pre:0",))
        self.assertEqual(graph.op("head").inputs, ("inner/b:0",))

    def test_functional_submodel_is_flattened(self):
        graph = self.assert_consistent(model_zoo.nested("functional"))
        self.assertEqual(
            [op.name for op in graph], ["pre", "inner/a", "inner/b", "head"]
        )
        self.assertEqual(graph.op("head").inputs, ("inner/b:0",))

    def test_rejects_unknown_kind(self):
        with self.assertRaisesRegex(ValueError, "Received: kind='x'"):
            model_zoo.nested("x")

class SharedLayerGraphTest(GraphAssertions):
    def test_second_call_shares_weights_counted_once(self):
        graph = self.assert_consistent(model_zoo.shared_layer())
        self.assertEqual(
            [op.name for op in graph], ["shared", "shared#1", "add", "head"]
        )
        self.assertEqual(graph.op("shared").inputs, ("x1",))
        self.assertEqual(graph.op("shared#1").inputs, ("x2",))
        self.assertEqual(graph.op("shared#1").shares_weights_with, "shared")
        self.assertIsNone(graph.op("shared").shares_weights_with)
        params = (8 * 16 + 16) + (16 * 1 + 1)
        self.assertEqual(graph.weight_bytes, params * 4)
        self.assertEqual(
            sum(op.weight_bytes for op in graph), (params + 8 * 16 + 16) * 4
        )

    def test_add_flops_and_every_dim_splittable(self):
        op = build_graph(model_zoo.shared_layer(), BATCH).op("add")
        self.assertEqual(op.forward_flops, BATCH * 16)
        self.assertEqual(op.backward_flops, 0)  # gradient is a copy
        self.assertEqual(op.partitionable, {0: SAMPLE, 1: ATTRIBUTE})

class EmbeddingGraphTest(GraphAssertions):
    def test_dlrm_ops_and_shapes(self):
        graph = self.assert_consistent(model_zoo.dlrm())
        self.assertEqual(len(graph), 2 + 8 + 8 + 1 + 2)
        self.assertEqual(graph.inputs[0], "dense")
        self.assertEqual(graph.op("concat").output_shape, (BATCH, 8 + 8 * 8))
        self.assertEqual(len(graph.op("concat").inputs), 9)

    def test_embedding_flops_and_parameter_dim(self):
        op = build_graph(model_zoo.dlrm(), BATCH).op("embedding_0")
        self.assertEqual(op.output_shape, (BATCH, 1, 8))
        self.assertEqual(op.forward_flops, 0)  # a gather
        self.assertEqual(op.backward_flops, BATCH * 8)  # scatter-add
        self.assertEqual(
            op.partitionable, {0: SAMPLE, 1: ATTRIBUTE, 2: PARAMETER}
        )
        self.assertEqual(op.weights[0].shard_axis, 1)
        self.assertEqual(op.weights[0].shape, (100, 8))

    def test_case_study_dlrm_builds_without_weight_values(self):
        model = model_zoo.dlrm(
            8,
            1_000_000,
            64,
            64,
            (512, 512, 64),
            (1024, 1024, 1024, 1),
            defer_weights=True,
        )
        graph = build_graph(model, 8)
        self.assertEqual(graph.op("concat").output_shape, (8, 576))
        tables = 8 * 1_000_000 * 64
        mlps = sum(
            i * o + o
            for i, o in [
                (64, 512),
                (512, 512),
                (512, 64),
                (576, 1024),
                (1024, 1024),
                (1024, 1024),
                (1024, 1),
            ]
        )
        self.assertEqual(graph.weight_bytes, (tables + mlps) * 4)
        table = model.get_layer("embedding_0").embeddings
        self.assertIsNone(table._value)  # never allocated
        # Nor by the next stateless scope anything in the process closes
        # (Keras initializes every deferred variable there).
        with keras.StatelessScope():
            pass
        self.assertIsNone(table._value)

class CustomLayer(keras.layers.Layer):
    """A layer op_specs has no rule for."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], 3), name="w")

    def call(self, x):
        return keras.ops.matmul(x, self.w)

class OpaqueAndInvalidModelTest(unittest.TestCase):
    def test_unknown_layer_is_opaque_and_sample_only(self):
        inputs = keras.Input(shape=(5,))
        x = CustomLayer(name="custom")(inputs)
        op = build_graph(keras.Model(inputs, x), BATCH).op("custom")
        self.assertEqual(op.type, "CustomLayer")
        self.assertFalse(op.flops_exact)
        self.assertGreater(op.forward_flops, 0)
        self.assertEqual(op.partitionable, {0: SAMPLE})
        self.assertEqual(op.weights[0].shape, (5, 3))
        self.assertIsNone(op.weights[0].shard_axis)

    def test_non_batch_none_dim_is_varying(self):
        # Priced at VARYING_DIM_SIZE, and never split downstream.
        inputs = keras.Input(shape=(None, 3), name="x")
        model = keras.Model(inputs, keras.layers.Dense(2, name="d")(inputs))
        graph = build_graph(model, BATCH)
        self.assertEqual(graph.tensors["x"].shape, (BATCH, VARYING_DIM_SIZE, 3))
        self.assertEqual(graph.tensors["x"].varying, (1,))
        self.assertEqual(graph.op("d").output_shape, (BATCH, VARYING_DIM_SIZE, 2))
        self.assertEqual(graph.tensors["d:0"].varying, (1,))
        self.assertNotIn(1, graph.op("d").partitionable)
        self.assertIn(2, graph.op("d").partitionable)

    def test_fixed_batch_input_must_match_batch_size(self):
        inputs = keras.Input(shape=(3,), batch_size=8, name="x")
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        self.assertEqual(build_graph(model, 8).tensors["x"].shape, (8, 3))
        with self.assertRaisesRegex(
            ValueError, "'x' has a fixed batch size of 8.*batch_size=4"
        ):
            build_graph(model, 4)

    def test_subclassed_model_is_rejected(self):
        class Subclassed(keras.Model):
            def __init__(self):
                super().__init__(name="sub")
                self.dense = keras.layers.Dense(3)

            def call(self, x):
                return self.dense(x)

        model = Subclassed()
        model(np.zeros((2, 4), "float32"))
        with self.assertRaisesRegex(
            ValueError, "Model 'sub' has no graph.*Received: a Subclassed"
        ):
            build_graph(model, BATCH)

class ApplicationsGraphTest(GraphAssertions):
    def test_resnet50(self):
        model = keras.applications.ResNet50(weights=None)
        graph = self.assert_consistent(model, batch=2)
        self.assertEqual(len(graph), len(model.layers) - 1)
        self.assertTrue(all(op.flops_exact for op in graph))
        conv1 = graph.op("conv1_conv")
        # 7x7 stride 2 on the padded 230x230x3 image -> 112x112x64, bias.
        outputs = 2 * 112 * 112 * 64
        self.assertEqual(conv1.forward_flops, 2 * outputs * 7 * 7 * 3 + outputs)
        # He et al. (2016) give 3.8e9 multiply-adds per image for ResNet-50
        # v1 (Keras's: stride on the 1x1 conv; v1.5 has 4.1e9).
        macs = (
            sum(
                op.forward_flops
                for op in graph
                if op.type in ("Conv2D", "Dense")
            )
            / 2
            / 2
        )
        self.assertAlmostEqual(macs / 1e9, 3.8, delta=0.1)
        for op in graph:
            if op.type in ("Conv2D", "MaxPooling2D", "ZeroPadding2D"):
                self.assertEqual(op.partitionable, {0: SAMPLE})
            if op.type == "BatchNormalization":
                self.assertEqual(op.partitionable, {0: SAMPLE, 3: PARAMETER})

    def test_inception_v3(self):
        model = keras.applications.InceptionV3(weights=None)
        graph = self.assert_consistent(model, batch=2)
        self.assertEqual(len(graph), len(model.layers) - 1)
        self.assertTrue(all(op.flops_exact for op in graph))
        pool = next(op for op in graph if op.type == "AveragePooling2D")
        self.assertEqual(pool.input_shapes, ((2, 35, 35, 192),))
        # 3x3 stride 1 same: per axis 2 + 33 * 3 + 2 inner elements.
        window = (2 + 33 * 3 + 2) ** 2
        self.assertEqual(pool.forward_flops, 2 * 192 * window)
        concat = graph.ops[[op.type for op in graph].index("Concatenate")]
        self.assertEqual(
            concat.partitionable, {0: SAMPLE, 1: ATTRIBUTE, 2: ATTRIBUTE}
        )


if __name__ == "__main__":
    unittest.main()
