"""Tests for op_specs.py and op_specs_sequence.py: each layer type's
FLOPs and the SOAP dims it may split.

FLOPs are checked against arithmetic written out here, following the
convention in `op_specs`; shapes against Keras (`graph_checks`).
"""

import unittest

import keras
import model_zoo
from graph_checks import BATCH, GraphAssertions

from flexflow_keras import cost, op_specs
from flexflow_keras.graph import ATTRIBUTE, PARAMETER, SAMPLE
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.strategy import ParallelConfig


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
        # Split by the batch only (capabilities.TABLE; its gradients
        # through runtime/depthwise.py).
        self.assertEqual(graph.op("dw").partitionable, {0: "sample"})

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

    def test_attention_part_under_a_sequence_split_projects_keys_whole(self):
        # Each of 4 sequence parts projects its quarter of the queries
        # but every key and value: more than a quarter of the FLOPs.
        q = keras.Input(shape=(8, 8), name="q")
        v = keras.Input(shape=(12, 6), name="v")
        for name, call in (
            ("positional", lambda mha: mha(q, v)),
            ("keyword", lambda mha: mha(query=q, value=v, key=v)),
        ):
            with self.subTest(name):
                mha = keras.layers.MultiHeadAttention(
                    2, 4, use_bias=False, name="mha")
                op = build_graph(keras.Model([q, v], call(mha)),
                                 BATCH).op("mha")
                config = ParallelConfig((1, 4, 1), (0, 1, 2, 3))
                ins, out = cost.shard_shapes(op, config)
                part = op_specs.part_flops(op, ins, out)
                q_rows, k_rows = BATCH * 8 // 4, BATCH * 12
                projections = 2 * (q_rows * 8 * 8 + 2 * k_rows * 6 * 8
                                   + q_rows * 8 * 8)
                scores = BATCH * 2 * (8 // 4) * 12
                expected = (projections + q_rows * 8 + 2 * scores * 8
                            + 5 * scores)
                self.assertEqual(part[0], expected)
                self.assertGreater(part[0], op.forward_flops / 4)
                # A batch split's part is an even share.
                batch = ParallelConfig((4, 1, 1), (0, 1, 2, 3))
                ins, out = cost.shard_shapes(op, batch)
                self.assertEqual(op_specs.part_flops(op, ins, out),
                                 (op.forward_flops / 4,
                                  op.backward_flops / 4))

    def test_even_share_ops_have_no_part_rule(self):
        x = keras.Input(shape=(8,))
        op = build_graph(keras.Model(x, keras.layers.Dense(4, name="d")(x)),
                         BATCH).op("d")
        ins, out = cost.shard_shapes(op, ParallelConfig((2, 1), (0, 1)))
        self.assertIsNone(op_specs.part_flops(op, ins, out))

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


if __name__ == "__main__":
    unittest.main()
