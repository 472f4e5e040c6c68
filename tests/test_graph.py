"""Tests for graph.py and op_specs.py: ops, shapes, FLOPs, SOAP dims.

Shapes are checked against Keras's own shape inference; FLOPs against
arithmetic written out here, following the convention in `op_specs`.
"""

import unittest

import keras
import model_zoo
import numpy as np

from flexflow_keras import capabilities
from flexflow_keras.graph import (
    ATTRIBUTE,
    PARAMETER,
    SAMPLE,
    SOAP_KINDS,
    Op,
    OpGraph,
    build_graph,
)

BATCH = 4


def keras_output_shapes(op: Op) -> list[tuple[int, ...]]:
    """Output shapes Keras infers for `op` fed full-batch input shapes."""
    from keras.src.backend import KerasTensor

    values = {
        name: KerasTensor(shape)
        for name, shape in zip(op.inputs, op.input_shapes)
    }
    args, kwargs = op.fill_arguments(values)
    spec = op.layer.compute_output_spec(*args, **kwargs)
    return [tuple(t.shape) for t in keras.tree.flatten(spec)]


def model_output_shapes(
    model: keras.Model, batch: int
) -> list[tuple[int, ...]]:
    return [
        tuple(batch if d is None else d for d in t.shape) for t in model.outputs
    ]


class GraphAssertions(unittest.TestCase):
    """Checks every test model must pass."""

    def assert_consistent(
        self, model: keras.Model, batch: int = BATCH
    ) -> OpGraph:
        graph = build_graph(model, batch)
        for op in graph:
            self.assertEqual(
                [tuple(s) for s in op.output_shapes],
                keras_output_shapes(op),
                msg=op.name,
            )
            for tensor in op.inputs:  # topological order
                producer = graph.producer(tensor)
                if producer is not None:
                    self.assertLess(
                        graph.ops.index(producer), graph.ops.index(op)
                    )
            self.assert_valid_partitioning(op, batch)
        self.assertEqual(
            [graph.tensors[t].shape for t in graph.outputs],
            model_output_shapes(model, batch),
        )
        return graph

    def assert_valid_partitioning(self, op: Op, batch: int) -> None:
        kinds = op.partitionable
        if capabilities.of_type(op.type).replicated_ops:
            self.assertEqual(kinds, {}, msg=op.name)  # runs replicated
        else:
            self.assertEqual(kinds.get(0), SAMPLE, msg=op.name)
        self.assertEqual(op.output_shape[0], batch, msg=op.name)
        self.assertTrue(set(kinds.values()) <= set(SOAP_KINDS))
        self.assertTrue(all(0 <= d < op.rank for d in kinds), msg=op.name)
        parameter_dims = [d for d, k in kinds.items() if k == PARAMETER]
        self.assertLessEqual(len(parameter_dims), 1, msg=op.name)
        for w in op.weights:
            if w.shard_axis is None:
                continue
            # A parameter split cuts the weight where it cuts the output.
            self.assertEqual(
                w.shape[w.shard_axis],
                op.output_shape[op.parameter_dim],
                msg=f"{op.name} {w.path}",
            )


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


class CnnGraphTest(GraphAssertions):
    def test_ops_and_shapes_match_keras(self):
        graph = self.assert_consistent(model_zoo.cnn())
        self.assertEqual(
            [op.type for op in graph],
            ["Conv2D", "BatchNormalization", "MaxPooling2D"] * 2
            + ["Flatten", "Dropout", "Dense"],
        )

    def test_conv2d_flops_match_hand_count(self):
        op = build_graph(model_zoo.cnn(), BATCH).op("conv_0")
        outputs = BATCH * 16 * 16 * 8  # same padding keeps 16 x 16
        matmul = 2 * outputs * (3 * 3 * 3)  # 3x3 taps x 3 in-channels
        self.assertEqual(op.forward_flops, matmul + outputs + outputs)
        self.assertEqual(op.backward_flops, 2 * matmul + outputs + outputs)

    def test_strided_grouped_and_dilated_conv_flops(self):
        inputs = keras.Input(shape=(11, 11, 6))
        strided = keras.layers.Conv2D(
            4, (3, 2), strides=2, groups=2, use_bias=False, name="strided"
        )(inputs)
        dilated = keras.layers.Conv2D(
            3, 3, dilation_rate=2, padding="valid", name="dilated"
        )(inputs)
        graph = self.assert_consistent(keras.Model(inputs, [strided, dilated]))
        op = graph.op("strided")
        # valid: (11 - 3) // 2 + 1 = 5 rows, (11 - 2) // 2 + 1 = 5 cols;
        # each output reads 3 x 2 taps of 6 / 2 = 3 channels of its group.
        self.assertEqual(op.output_shape, (BATCH, 5, 5, 4))
        self.assertEqual(op.forward_flops, 2 * BATCH * 5 * 5 * 4 * 3 * 2 * 3)
        op = graph.op("dilated")
        # dilation 2 spans 5 pixels: 11 - 5 + 1 = 7 positions, 9 taps.
        outputs = BATCH * 7 * 7 * 3
        self.assertEqual(op.forward_flops, 2 * outputs * 9 * 6 + outputs)

    def test_conv1d_conv3d_and_depthwise_flops(self):
        x1 = keras.Input(shape=(10, 4))
        x3 = keras.Input(shape=(4, 4, 4, 2))
        x2 = keras.Input(shape=(6, 6, 3))
        c1 = keras.layers.Conv1D(5, 3, padding="causal", name="c1")(x1)
        c3 = keras.layers.Conv3D(2, 2, use_bias=False, name="c3")(x3)
        dw = keras.layers.DepthwiseConv2D(
            3, depth_multiplier=2, use_bias=False, name="dw"
        )(x2)
        graph = self.assert_consistent(keras.Model([x1, x3, x2], [c1, c3, dw]))
        outputs = BATCH * 10 * 5
        self.assertEqual(
            graph.op("c1").forward_flops, 2 * outputs * 3 * 4 + outputs
        )
        self.assertEqual(
            graph.op("c3").forward_flops,
            2 * (BATCH * 3 * 3 * 3 * 2) * (2 * 2 * 2 * 2),
        )
        # each of the 3 * 2 output channels reads 3 x 3 taps of one channel
        self.assertEqual(
            graph.op("dw").forward_flops, 2 * (BATCH * 4 * 4 * 6) * 9
        )
        # Its gradients run only replicated (capabilities.TABLE).
        self.assertEqual(graph.op("dw").partitionable, {})

    def test_conv_is_sample_only(self):
        # DTensor needs a replicated filter and cannot split spatial dims.
        inputs = keras.Input(shape=(4, 8, 8))
        first = keras.layers.Conv2D(
            6, 3, data_format="channels_first", name="first"
        )(inputs)
        grouped = keras.layers.Conv2D(4, 3, groups=2, name="grouped")(
            keras.layers.Permute((2, 3, 1))(inputs)
        )
        graph = build_graph(keras.Model(inputs, [first, grouped]), BATCH)
        graph_cnn = build_graph(model_zoo.cnn(), BATCH)
        for op in (
            graph.op("first"),
            graph.op("grouped"),
            graph_cnn.op("conv_0"),
        ):
            self.assertEqual(op.partitionable, {0: SAMPLE})
            self.assertIsNone(op.parameter_dim)
            self.assertTrue(all(w.shard_axis is None for w in op.weights))

    def test_max_pooling_flops_and_sample_only(self):
        op = build_graph(model_zoo.cnn(), BATCH).op("pool_0")
        outputs = BATCH * 8 * 8 * 8
        self.assertEqual(op.forward_flops, outputs * (4 - 1))  # 2x2 max
        self.assertEqual(op.backward_flops, outputs)
        self.assertEqual(op.partitionable, {0: SAMPLE})

    def test_same_average_pooling_counts_only_inner_window(self):
        inputs = keras.Input(shape=(4, 4, 3))
        pooled = keras.layers.AveragePooling2D(
            3, strides=1, padding="same", name="avg"
        )(inputs)
        op = self.assert_consistent(keras.Model(inputs, pooled)).op("avg")
        # Per axis the 4 windows hold 2, 3, 3, 2 inside elements.
        window = (2 + 3 + 3 + 2) ** 2
        self.assertEqual(op.forward_flops, BATCH * 3 * window)
        self.assertEqual(
            op.backward_flops, BATCH * 3 * window + BATCH * 4 * 4 * 3
        )

    def test_global_pooling_flops_and_channel_attribute(self):
        inputs = keras.Input(shape=(5, 6, 7))
        avg = keras.layers.GlobalAveragePooling2D(name="gap")(inputs)
        mx = keras.layers.GlobalMaxPooling1D(name="gmp")(
            keras.layers.Reshape((30, 7))(inputs)
        )
        graph = self.assert_consistent(keras.Model(inputs, [avg, mx]))
        self.assertEqual(graph.op("gap").forward_flops, BATCH * 7 * 30)
        self.assertEqual(graph.op("gmp").forward_flops, BATCH * 7 * 29)
        for name in ("gap", "gmp"):
            self.assertEqual(
                graph.op(name).partitionable, {0: SAMPLE, 1: ATTRIBUTE}
            )

    def test_batch_norm_flops_and_channel_parameter(self):
        op = build_graph(model_zoo.cnn(), BATCH).op("bn_0")
        elements = BATCH * 16 * 16 * 8
        # statistics + normalize 6, scale 1, shift 1
        self.assertEqual(op.forward_flops, elements * 8)
        # through statistics 7, gamma grad 2, beta grad 1
        self.assertEqual(op.backward_flops, elements * 10)
        self.assertEqual(op.partitionable, {0: SAMPLE, 3: PARAMETER})
        axes = {w.path: w.shard_axis for w in op.weights}
        self.assertEqual(
            axes,
            {
                "bn_0/gamma": 0,
                "bn_0/beta": 0,
                "bn_0/moving_mean": 0,
                "bn_0/moving_variance": 0,
            },
        )

    def test_dropout_flops_depend_on_rate(self):
        kept = build_graph(model_zoo.cnn(dropout_rate=0.0), BATCH)
        dropped = build_graph(model_zoo.cnn(dropout_rate=0.5), BATCH)
        self.assertEqual(kept.op("dropout").forward_flops, 0)
        self.assertEqual(
            dropped.op("dropout").forward_flops, 2 * BATCH * 4 * 4 * 16
        )
        self.assertEqual(
            dropped.op("dropout").partitionable, {0: SAMPLE, 1: ATTRIBUTE}
        )


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


class TransformerGraphTest(GraphAssertions):
    def test_ops_and_shapes_match_keras(self):
        graph = self.assert_consistent(model_zoo.transformer_block())
        self.assertEqual(
            [op.type for op in graph],
            [
                "MultiHeadAttention",
                "Add",
                "LayerNormalization",
                "Dense",
                "Dense",
                "Add",
                "LayerNormalization",
            ],
        )

    def test_attention_flops_match_hand_count(self):
        op = build_graph(model_zoo.transformer_block(), BATCH).op("attention")
        seq, dim, heads, key_dim = 16, 32, 4, 8
        rows = BATCH * seq
        projection = 2 * rows * dim * heads * key_dim + rows * dim
        scale = rows * heads * key_dim
        scores = BATCH * heads * seq * seq
        matmuls = 2 * scores * key_dim + 2 * scores * key_dim
        softmax = 5 * scores
        self.assertEqual(
            op.forward_flops, 4 * projection + scale + matmuls + softmax
        )
        backward = (
            4 * (2 * (projection - rows * dim) + rows * dim)
            + scale
            + 2 * matmuls
            + 4 * scores
        )
        self.assertEqual(op.backward_flops, backward)
        self.assertEqual(op.partitionable, {0: SAMPLE, 1: ATTRIBUTE})
        self.assertTrue(all(w.shard_axis is None for w in op.weights))

    def test_cross_attention_uses_key_length(self):
        q = keras.Input(shape=(3, 8))
        v = keras.Input(shape=(5, 6))
        out = keras.layers.MultiHeadAttention(2, 4, use_bias=False, name="mha")(
            q, v
        )
        op = self.assert_consistent(keras.Model([q, v], out)).op("mha")
        q_rows, k_rows = BATCH * 3, BATCH * 5
        projections = 2 * (q_rows * 8 * 8 + 2 * k_rows * 6 * 8 + q_rows * 8 * 8)
        scores = BATCH * 2 * 3 * 5
        expected = projections + q_rows * 8 + 2 * scores * 8 + 5 * scores
        self.assertEqual(op.forward_flops, expected)

    def test_attention_dropout_and_scores_output(self):
        x = keras.Input(shape=(6, 8))
        out, scores = keras.layers.MultiHeadAttention(
            2, 4, dropout=0.1, use_bias=False, name="mha"
        )(x, x, return_attention_scores=True)
        graph = self.assert_consistent(keras.Model(x, [out, scores]))
        op = graph.op("mha")
        self.assertEqual(op.output_shapes, ((BATCH, 6, 8), (BATCH, 2, 6, 6)))
        rows = BATCH * 6
        scores_n = BATCH * 2 * 6 * 6
        expected = (
            4 * 2 * rows * 8 * 8  # four 8 -> 2 x 4 projections
            + rows * 8  # query scaling
            + 2 * scores_n * (4 + 4)
            + 5 * scores_n  # matmuls, softmax
            + 2 * scores_n  # dropout on the scores
        )
        self.assertEqual(op.forward_flops, expected)
        self.assertEqual(op.partitionable, {0: SAMPLE})  # two outputs

    def test_layer_norm_flops_and_sequence_attribute(self):
        op = build_graph(model_zoo.transformer_block(), BATCH).op("norm_1")
        elements = BATCH * 16 * 32
        self.assertEqual(op.forward_flops, elements * (6 + 1 + 1))
        self.assertEqual(op.backward_flops, elements * (7 + 2 + 1))
        self.assertEqual(op.partitionable, {0: SAMPLE, 1: ATTRIBUTE})

    def test_feed_forward_splits_sequence_and_units(self):
        graph = build_graph(model_zoo.transformer_block(), BATCH)
        self.assertEqual(
            graph.op("ff_1").partitionable,
            {0: SAMPLE, 1: ATTRIBUTE, 2: PARAMETER},
        )
        self.assertEqual(
            graph.op("add_2").partitionable,
            {0: SAMPLE, 1: ATTRIBUTE, 2: ATTRIBUTE},
        )


class RecurrentGraphTest(GraphAssertions):
    def test_lstm_flops_match_hand_count(self):
        graph = self.assert_consistent(model_zoo.lstm_model())
        op = graph.op("lstm_1")
        steps, features, units = 10, 8, 16
        gates = 2 * (features + units) * 4 * units  # x W + h U, 4 gates
        # add the two products 4U, bias 4U, activations 4U, cell state
        # f*c + i*g 3U, tanh(c) and o * tanh(c) 2U.
        arithmetic = 4 * units + 4 * units + 4 * units + 3 * units + 2 * units
        self.assertEqual(op.forward_flops, BATCH * steps * (gates + arithmetic))
        self.assertEqual(
            op.backward_flops, BATCH * steps * (2 * gates + arithmetic)
        )
        self.assertEqual(op.partitionable, {0: SAMPLE})
        self.assertEqual(graph.op("lstm_2").output_shape, (BATCH, 16))

    def test_gru_flops_match_hand_count(self):
        inputs = keras.Input(shape=(5, 3))
        out = keras.layers.GRU(4, name="gru")(inputs)
        op = self.assert_consistent(keras.Model(inputs, out)).op("gru")
        units = 4
        gates = 2 * (3 + units) * 3 * units
        bias = 2 * 3 * units  # reset_after: input and recurrent biases
        self.assertEqual(
            op.forward_flops, BATCH * 5 * (gates + 11 * units + bias)
        )
        self.assertEqual(op.partitionable, {0: SAMPLE})

    def test_simple_rnn_flops(self):
        inputs = keras.Input(shape=(5, 3))
        out = keras.layers.SimpleRNN(4, name="rnn")(inputs)
        op = self.assert_consistent(keras.Model(inputs, out)).op("rnn")
        # x W + h U, add them, bias, tanh: per step and sample
        per_step = 2 * (3 + 4) * 4 + 4 + 4 + 4
        self.assertEqual(op.forward_flops, BATCH * 5 * per_step)


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


class KerasOpsGraphTest(GraphAssertions):
    def test_functional_keras_ops_are_ops(self):
        a = keras.Input(shape=(6,), name="a")
        b = keras.Input(shape=(6,), name="b")
        x = keras.ops.add(a, b)
        x = keras.ops.relu(x)
        x = keras.ops.multiply(x, 2.0)
        x = keras.layers.Add(name="merge")([x, a])
        graph = self.assert_consistent(keras.Model([a, b], x))
        self.assertEqual(
            [op.type for op in graph], ["Add", "Relu", "Multiply", "Add"]
        )
        add, relu, scale, merge = graph.ops
        n = BATCH * 6
        self.assertEqual(add.inputs, ("a", "b"))
        self.assertEqual((add.forward_flops, add.backward_flops), (n, 0))
        self.assertEqual((relu.forward_flops, relu.backward_flops), (n, n))
        # x * 2.0: one tensor operand, so one gradient multiply
        self.assertEqual((scale.forward_flops, scale.backward_flops), (n, n))
        self.assertEqual(merge.inputs, (scale.outputs[0], "a"))
        for op in graph:
            self.assertTrue(op.flops_exact)
            self.assertEqual(op.partitionable, {0: SAMPLE, 1: ATTRIBUTE})

    def test_merge_layers_count_per_input(self):
        a, b, c = (keras.Input(shape=(5,)) for _ in range(3))
        outs = [
            keras.layers.Subtract(name="sub")([a, b]),
            keras.layers.Multiply(name="mul")([a, b, c]),
            keras.layers.Average(name="avg")([a, b, c]),
            keras.layers.Maximum(name="max")([a, b, c]),
        ]
        graph = self.assert_consistent(keras.Model([a, b, c], outs))
        n = BATCH * 5
        flops = {op.name: (op.forward_flops, op.backward_flops) for op in graph}
        self.assertEqual(flops["sub"], (n, n))  # negate the second
        # 2 multiplies forward; each of 3 grads multiplies the other 2
        self.assertEqual(flops["mul"], (2 * n, 6 * n))
        self.assertEqual(flops["avg"], (3 * n, 3 * n))  # 2 adds + scale
        self.assertEqual(flops["max"], (2 * n, 3 * n))  # a select each

    def test_binary_ops_count_tensor_operands_only(self):
        x = keras.Input(shape=(5,))
        y = keras.Input(shape=(5,))
        outs = [
            keras.ops.subtract(1.0, x),
            keras.ops.subtract(x, y),
            keras.ops.divide(x, y),
            keras.ops.maximum(x, 0.0),
        ]
        graph = self.assert_consistent(keras.Model([x, y], outs))
        n = BATCH * 5
        producers = [graph.producer(t) for t in graph.outputs]
        self.assertEqual(
            [(op.forward_flops, op.backward_flops) for op in producers],
            [
                (n, n),  # 1 - x: only the second operand is a tensor
                (n, n),
                (n, 4 * n),  # g / y, then -g * x / y^2
                (n, n),  # maximum(x, 0): one select
            ],
        )

    def test_matmul_flops(self):
        x = keras.Input(shape=(3, 4))
        y = keras.Input(shape=(4, 5))
        graph = self.assert_consistent(
            keras.Model([x, y], keras.ops.matmul(x, y))
        )
        op = graph.ops[0]
        self.assertEqual(op.forward_flops, 2 * BATCH * 3 * 5 * 4)
        self.assertEqual(op.backward_flops, 4 * BATCH * 3 * 5 * 4)
        self.assertEqual(op.partitionable, {0: SAMPLE})

    def test_softmax_keeps_its_axis_whole(self):
        inputs = keras.Input(shape=(3, 5))
        x = keras.layers.Softmax(axis=1, name="sm")(inputs)
        y = keras.ops.softmax(inputs)
        z = keras.layers.Activation("softmax", name="act")(inputs)
        graph = self.assert_consistent(keras.Model(inputs, [x, y, z]))
        n = BATCH * 3 * 5
        self.assertEqual(graph.op("sm").forward_flops, 5 * n)
        self.assertEqual(graph.op("sm").backward_flops, 4 * n)
        self.assertEqual(
            graph.op("sm").partitionable, {0: SAMPLE, 2: ATTRIBUTE}
        )
        softmax_op = [op for op in graph if op.name not in ("sm", "act")][0]
        self.assertEqual(softmax_op.partitionable, {0: SAMPLE, 1: ATTRIBUTE})
        self.assertEqual(
            graph.op("act").partitionable, {0: SAMPLE, 1: ATTRIBUTE}
        )

    def test_reshape_and_flatten_are_sample_only(self):
        inputs = keras.Input(shape=(4, 6))
        x = keras.layers.Reshape((6, 4), name="reshape")(inputs)
        x = keras.layers.Flatten(name="flatten")(x)
        graph = self.assert_consistent(keras.Model(inputs, x))
        for op in graph:
            self.assertEqual(op.partitionable, {0: SAMPLE})
            self.assertEqual(op.forward_flops, 0)

    def test_reduction_over_batch_has_no_sample_dim(self):
        inputs = keras.Input(shape=(3,))
        x = keras.ops.mean(inputs, axis=0)
        graph = build_graph(keras.Model(inputs, x), BATCH)
        self.assertEqual(graph.ops[0].output_shape, (3,))
        self.assertEqual(graph.ops[0].partitionable, {})


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

    def test_non_batch_none_dim_is_rejected(self):
        inputs = keras.Input(shape=(None, 3))
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        with self.assertRaisesRegex(
            ValueError, r"unknown dimension.*Received: shape=\(None, None, 3\)"
        ):
            build_graph(model, BATCH)

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


def splits_model() -> keras.Model:
    """One of each op type with declared non-sample splits; even dims."""
    tokens = keras.Input(shape=(4, 6), name="tokens")
    ids = keras.Input(shape=(4,), dtype="int32", name="ids")
    image = keras.Input(shape=(3, 3, 4), name="image")
    x = keras.layers.Dense(8, name="dense")(tokens)
    x = keras.layers.MultiHeadAttention(2, 4, name="mha")(x, x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    e = keras.layers.Embedding(10, 8, name="embed")(ids)
    x = keras.layers.Add(name="add")([x, e])
    x = keras.layers.Concatenate(axis=1, name="concat")([x, e])
    x = keras.layers.Softmax(axis=1, name="softmax")(x)
    x = keras.layers.Activation("tanh", name="tanh")(x)
    x = keras.ops.multiply(x, 2.0)
    x = keras.layers.Flatten(name="flatten")(x)
    y = keras.layers.BatchNormalization(name="bn")(image)
    y = keras.layers.GlobalAveragePooling2D(name="gap")(y)
    return keras.Model([tokens, ids, image], [x, y])


def run_split(
    op: Op, dim: int, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Output and weight gradients of `op` with output dim `dim` split.

    Splits as a runtime would on 2 DTensor devices: inputs along `dim`
    (sample/attribute) or weights along their shard axes (parameter).
    Returns (split, unsplit) pairs of NumPy arrays.
    """
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    mesh = dtensor.create_mesh([("x", 2)], devices=devices)

    def put(value, split_axis):
        specs = [dtensor.UNSHARDED] * value.ndim
        if split_axis is not None:
            specs[split_axis] = "x"
        whole = dtensor.Layout.replicated(mesh, value.ndim)
        tensor = dtensor.copy_to_mesh(tf.constant(value), whole)
        return dtensor.relayout(tensor, dtensor.Layout(specs, mesh))

    def gather(tensor):
        whole = dtensor.Layout.replicated(mesh, len(tensor.shape))
        return dtensor.unpack(dtensor.relayout(tensor, whole))[0].numpy()

    rng = np.random.default_rng(seed)
    kind = op.partitionable[dim]
    layer = op.layer
    inputs = [
        rng.integers(0, 10, shape).astype("int32")
        if shape[-1] == 4 and op.type == "Embedding"
        else rng.normal(size=shape).astype("float32")
        for shape in op.input_shapes
    ]
    axes = {w.path: w.shard_axis for w in op.weights}
    variables = getattr(layer, "trainable_variables", [])
    state_vars = getattr(layer, "non_trainable_variables", [])
    trainable = [v.numpy() for v in variables]
    others = [v.numpy() for v in state_vars]

    def step(xs, weights, states, split):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            args, kwargs = op.fill_arguments(dict(zip(op.inputs, xs)))
            if getattr(layer, "_call_has_training_arg", False):
                kwargs["training"] = True  # BN: batch statistics
            if hasattr(layer, "stateless_call"):
                y, _ = layer.stateless_call(weights, states, *args, **kwargs)
            else:  # a keras.ops operation: no variables
                y = layer(*args, **kwargs)
            if split:
                specs = [dtensor.UNSHARDED] * op.rank
                specs[dim] = "x"
                y = dtensor.relayout(y, dtensor.Layout(specs, mesh))
            loss = tf.reduce_sum(y * y)
        grads = tape.gradient(loss, weights)
        return y, [tf.convert_to_tensor(g) for g in grads]

    y_ref, g_ref = step(
        [tf.constant(x) for x in inputs],
        [tf.constant(w) for w in trainable],
        [tf.constant(w) for w in others],
        split=False,
    )
    split_inputs = [
        put(
            x,
            dim
            if kind != PARAMETER
            and x.shape[dim : dim + 1] == op.output_shape[dim : dim + 1]
            else None,
        )
        for x in inputs
    ]

    def weight_axis(variable):
        return axes.get(variable.path) if kind == PARAMETER else None

    split_weights = [
        put(w, weight_axis(v)) for v, w in zip(variables, trainable)
    ]
    split_states = [put(w, weight_axis(v)) for v, w in zip(state_vars, others)]
    y, grads = tf.function(step)(
        split_inputs, split_weights, split_states, split=True
    )
    pairs = [(gather(y), y_ref.numpy())]
    pairs += [(gather(g), r.numpy()) for g, r in zip(grads, g_ref)]
    return pairs


class DeclaredSplitsRunOnDTensorTest(unittest.TestCase):
    """Every declared split runs on DTensor and matches the unsplit op.

    Why: the search proposes only declared splits; one the runtime cannot
    execute would fail in `fit()`, long after the search chose it.
    """

    def test_every_declared_split_runs_and_matches(self):
        graph = build_graph(splits_model(), 2)
        checked = 0
        for op in graph:
            for dim, kind in op.partitionable.items():
                if op.output_shape[dim] % 2:
                    continue
                with self.subTest(op=op.name, dim=dim, kind=kind):
                    for got, expected in run_split(op, dim):
                        np.testing.assert_allclose(
                            got, expected, rtol=1e-4, atol=1e-4
                        )
                    checked += 1
        self.assertEqual(checked, 28)


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
