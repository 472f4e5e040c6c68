"""The simulator prices only the gradients the model's step computes.

The step takes the loss's gradient with respect to the trainable
weights, so TensorFlow computes no gradient of a model input (a first
layer's input) and none through a frozen base. `Op.gradient_inputs`
says which inputs get one; the roofline, the measured costs and the
task graph's gradient transfers follow it.
"""

import os
import tempfile
import unittest

import keras
import tensorflow as tf

from flexflow_keras import cost
from flexflow_keras.cost import CostModel, measured_cost_model
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.machine import DeviceSpec, load_machine
from flexflow_keras.strategy import ParallelConfig
from flexflow_keras.taskgraph import overlap_array

# Compute bound: 1 TFLOP/s, a huge bandwidth, 0.01 ms a launch.
SPEC = DeviceSpec("T", 0, 1e12, 2**30, 1e6, 0.01)


def frozen_base_model(features=64):
    """A frozen two-layer base inside a model, then two trainable Dense."""
    base = keras.Sequential(
        [keras.layers.Dense(features, name="b1"),
         keras.layers.ReLU(name="relu"),
         keras.layers.Dense(features, name="b2")], name="base")
    base.trainable = False
    x = keras.Input((features,), name="x")
    h = keras.layers.Dense(features, name="head1")(base(x))
    y = keras.layers.Dense(features, name="head2")(h)
    return keras.Model(x, y)


class GraphTest(unittest.TestCase):
    def test_first_layer_and_frozen_base_get_no_input_gradient(self):
        graph = build_graph(frozen_base_model(), 32)
        found = {op.name: (op.gradient_inputs, op.has_backward)
                 for op in graph}
        self.assertEqual(found, {
            "base/b1": ((False,), False),
            "base/relu": ((False,), False),
            "base/b2": ((False,), False),
            "head1": ((False,), True),  # its weights' gradient only
            "head2": ((True,), True),
        })

    def test_integer_ids_and_a_shared_layer(self):
        ids = keras.Input((10,), dtype="int32", name="ids")
        e = keras.layers.Embedding(100, 8, name="emb")(ids)
        x = keras.Input((10, 8), name="x")
        shared = keras.layers.Dense(8, name="shared")
        y = keras.layers.Add(name="add")([shared(e), shared(x)])
        graph = build_graph(keras.Model([ids, x], y), 4)
        found = {op.name: op.gradient_inputs for op in graph}
        self.assertEqual(found, {
            "emb": (False,),
            "shared": (True,),  # after the Embedding's weights
            "shared#1": (False,),  # the model input
            "add": (True, True),
        })


class AnalyticTest(unittest.TestCase):
    def test_backward_prices_only_the_computed_gradients(self):
        graph = build_graph(frozen_base_model(256), 64)
        model = CostModel(load_machine("v100x4"), mode="analytic")
        whole = ParallelConfig((1, 1), (0,))

        def backward(name):
            return model.op_cost(graph.op(name), whole, SPEC)[1]

        op = graph.op("head2")
        # Both kernels, as before.
        self.assertAlmostEqual(backward("head2"),
                               op.backward_flops / 1e9 + 0.02)
        # The weights' kernel only: half the FLOPs, one launch.
        self.assertAlmostEqual(backward("head1"),
                               op.backward_flops / 2 / 1e9 + 0.01)
        for name in ("base/b1", "base/relu", "base/b2"):
            self.assertEqual(backward(name), 0.0)

    def test_no_gradient_transfer_into_a_frozen_op(self):
        graph = build_graph(frozen_base_model(), 32)
        producer, frozen = graph.op("base/b1"), graph.op("base/relu")
        trainable = graph.op("head2")
        split, batch = (1, 2), (2, 1)
        # Batch to channels: a layout move, a gradient back unless none.
        rows = overlap_array(producer, 0, split, frozen, 0, batch, False)
        self.assertTrue((rows[:, 2] > 0).any())
        self.assertTrue((rows[:, 3] == 0).all())
        rows = overlap_array(graph.op("head1"), 0, split, trainable, 0,
                             batch, False)
        self.assertTrue((rows[:, 3] > 0).any())


def _matmuls(op):
    """MatMul nodes in the traced training function `cost` times `op`
    by (the forward, each gradient)."""
    ins, _ = cost.shard_shapes(op, cost.whole_config(op))
    _, train = cost._step_functions(tf, op, op.layer, ins, True)
    values = cost._random_inputs(tf, op, ins)
    concrete = tf.function(train).get_concrete_function(*values)
    library = concrete.graph.as_graph_def().library.function
    return sum(node.op == "MatMul" for f in library for node in f.node_def)


class MeasuredTest(unittest.TestCase):
    def test_timed_step_computes_the_same_gradients(self):
        graph = build_graph(frozen_base_model(), 32)
        # Forward, the weights' gradient, and the input's for head2.
        self.assertEqual(_matmuls(graph.op("head2")), 3)
        self.assertEqual(_matmuls(graph.op("head1")), 2)

    def test_frozen_op_has_no_backward_and_its_own_key(self):
        graph = build_graph(frozen_base_model(), 32)
        frozen, head = graph.op("base/b2"), graph.op("head2")
        with tempfile.TemporaryDirectory() as folder:
            model = measured_cost_model(os.path.join(folder, "c.json"),
                                        load_machine(None))
            model.warmup, model.repeats = 1, 3
            whole = cost.whole_config(frozen)
            forward, backward = model.op_cost(frozen, whole, 0)
            self.assertGreater(forward, 0.0)
            self.assertEqual(backward, 0.0)
        self.assertIn("input gradients", cost.cache_key(frozen, whole, "T"))
        self.assertNotIn("input gradients", cost.cache_key(head, whole, "T"))
        self.assertIn("input gradients",
                      cost.representative_key(graph.op("head1"), "T"))


def build_frozen_base(mod):
    """A model input of 5 features, a frozen base (Dense 7, Dropout,
    Dense 9), a trainable head (Dense 11, Dense 3): every width its own,
    so a watched tensor's width names it."""
    x = mod.Input((5,), name="x")
    b1 = mod.layers.Dense(7, activation="relu", name="b1")
    b2 = mod.layers.Dense(9, name="b2")
    h = b2(mod.layers.Dropout(0.3, name="drop")(b1(x)))
    b1.trainable = b2.trainable = False
    h = mod.layers.Dense(11, activation="tanh", name="h1")(h)
    return mod.Model(x, mod.layers.Dense(3, name="h2")(h))


class SeveralMeshesTest(unittest.TestCase):
    def test_segments_take_no_gradient_the_step_does_not(self):
        import numpy as np
        from unittest import mock

        import runtime_support as support
        from flexflow_keras.runtime import step

        rng = np.random.default_rng(0)
        x = rng.random((40, 5), dtype=np.float32)
        y = rng.integers(0, 3, (40,))
        watched = []
        watch = tf.GradientTape.watch

        def recording(tape, tensor):
            watched.extend(int(t.shape[-1]) for t in tf.nest.flatten(tensor))
            return watch(tape, tensor)

        with mock.patch.object(step.tf.GradientTape, "watch", recording):
            histories, models, caught = support.fit_plain_and_ours(
                build_frozen_base, support.several_meshes, 8, 0,
                dict(optimizer="adam", loss=keras.losses.
                     SparseCategoricalCrossentropy(from_logits=True)),
                x=x, y=y, epochs=2, shuffle=False, verbose=0)
        self.assertEqual(caught, [])
        self.assertIsInstance(models["ours"].strategy_executor,
                              step.Executor)
        support.assert_same_fits(self, histories, models)
        # The head's input (h1 reads b2's 9) and the model input (5)
        # get no gradient; the head's hidden layer's (11) does.
        self.assertIn(11, watched)
        self.assertFalse({5, 7, 9} & set(watched), watched)


if __name__ == "__main__":
    unittest.main()
