"""A subclassed model whose `call()` cannot run on Keras's symbolic
tensors trains split over the batch as one op, equal to plain Keras.

keras.io's `tensorflow_numpy_models` computes with TensorFlow NumPy
(`tnp.matmul`) on its own weights, and a model may call `tf.*` ops
between its layers: neither runs on a `KerasTensor`, so its trace
failed and the script trained as plain Keras on one device. Keras calls
such a model on symbolic inputs through its `compute_output_spec`
(TensorFlow placeholders); the graph is then that one call, an op whose
batch the search splits, as a custom layer's
(`keras_graph._as_one_op`). A Dropout layer inside it draws its mask
while the batch is split. A call that also needs the batch size as a
number is made one op on each batch size it is planned for.

A model whose `build()` makes the layers its `call()` uses is built
before its trace, as Keras's first call builds it: before, its trace
failed on the missing layers.
"""

import unittest

import keras
import numpy as np
import tensorflow as tf
import tensorflow.experimental.numpy as tnp

import flexflow_keras as fk
from flexflow_keras import keras_graph

from runtime_support import (
    assert_own_step_under_strategy, assert_same_runs, fresh_caches,
    train_plain_and_ours,
)

ROWS, FEATURES, BATCH = 64, 6, 16


def build(mod):
    class NumpyNetwork(mod.Model):
        def build(self, input_shape):
            self.kernel = self.add_weight(
                shape=(input_shape[-1], 8), initializer="glorot_normal",
                name="kernel")
            self.head = mod.layers.Dense(1, name="head")
            self.dropout = mod.layers.Dropout(0.3, seed=4)

        def call(self, inputs, training=False):
            h = tnp.maximum(tnp.matmul(inputs, self.kernel), 0.0)
            h = tf.concat([h, tf.square(inputs)], axis=-1)
            return self.head(self.dropout(h, training=training))

    model = NumpyNetwork(name="numpy_network")
    options = {"search_budget": 50} if mod is fk else {}
    model.compile(optimizer="adam", loss="mse",
                  metrics=[keras.metrics.MeanAbsoluteError()], **options)
    return model


def build_token(mod):
    """A class token repeated `tf.shape(x)[0]` times by a TensorFlow op
    (no symbolic trace), and a flatten to `(batch, -1)`: on any batch
    size the Dense after it meets an unknown last dim; Keras builds it
    on the first batch."""

    class TokenNetwork(mod.Model):
        def build(self, input_shape):
            self.token = self.add_weight(shape=(1, 1, input_shape[-1]),
                                         initializer="ones", name="token")
            self.dense = mod.layers.Dense(4, name="dense")
            self.head = mod.layers.Dense(1, name="head")

        def call(self, inputs):
            token = tf.repeat(self.token, tf.shape(inputs)[0], axis=0)
            h = self.dense(tf.concat([token, inputs], axis=1))
            return self.head(tf.reshape(h, (tf.shape(h)[0], -1)))

    model = TokenNetwork(name="token_network")
    options = {"search_budget": 50} if mod is fk else {}
    model.compile(optimizer="sgd", loss="mse", **options)
    return model


def build_focal(mod):
    """keras.io's focal modulation network in small: a layer keeps a
    tensor of its call as an attribute (`self.gates = ...`), layers pass
    sizes taken with `tf.shape` to the next (which the symbolic trace
    cannot follow, so the model is one op), and Dropout draws inside."""

    class Gated(mod.layers.Layer):
        def __init__(self, dim, **kwargs):
            super().__init__(**kwargs)
            self.dim = dim
            self.proj = mod.layers.Dense(2 * dim + 1, name="proj")
            self.out = mod.layers.Dense(dim, name="out")
            self.drop = mod.layers.Dropout(0.25, seed=3)

        def call(self, x, training=None):
            query, context, self.gates = tf.split(
                self.proj(x), [self.dim, self.dim, 1], axis=-1)
            return self.drop(self.out(query * context * self.gates),
                             training=training)

    class Embed(mod.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.conv = mod.layers.Conv2D(4, 2, strides=2, name="conv")

        def call(self, x):
            x = self.conv(x)
            height, width = tf.shape(x)[1], tf.shape(x)[2]
            channels = tf.shape(x)[3]
            return (tf.reshape(x, (-1, height * width, channels)),
                    height, width, channels)

    class Basic(mod.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = Gated(4)

        def call(self, x, height, width, channels, training=None):
            x = tf.reshape(x, (-1, height, width, channels))
            x = self.block(x, training=training)
            return tf.reshape(x, (-1, height * width, channels))

    class Focal(mod.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embed = Embed()
            self.basic = Basic()
            self.head = mod.layers.Dense(3, name="head")

        def call(self, x, training=None):
            x, height, width, channels = self.embed(x)
            x = self.basic(x, height, width, channels, training=training)
            return self.head(tf.reduce_mean(x, axis=1))

    model = Focal(name="focal")
    options = {"search_budget": 50} if mod is fk else {}
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), **options)
    return model


class LayersMadeInBuild(fk.Model):
    """Layers made in `build()`, Keras ops only in `call()`: traced
    layer by layer once built, as Keras's first call builds it."""

    def build(self, input_shape):
        self.hidden = fk.layers.Dense(8, activation="relu", name="hidden")
        self.out = fk.layers.Dense(1, name="out")

    def call(self, inputs):
        return self.out(self.hidden(fk.ops.square(inputs)))


class OneOpModelTest(unittest.TestCase):
    def test_layers_made_in_build_are_ops(self):
        x = np.ones((ROWS, FEATURES), "float32")
        model = LayersMadeInBuild()
        model.compile(optimizer="sgd", loss="mse", search_budget=10)
        model.fit(x, x[:, :1], batch_size=BATCH, epochs=1, verbose=0)
        self.assertEqual([op.name for op in model.plan.graph],
                         ["square", "hidden", "out"])

    def test_trains_split_over_the_batch_equal_to_plain_keras(self):
        rng = np.random.default_rng(0)
        x = rng.random((ROWS, FEATURES)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        runs = train_plain_and_ours(
            build, 2, lambda model: model.fit(
                x, y, batch_size=BATCH, epochs=2, validation_split=0.25,
                shuffle=False, verbose=0).history)
        assert_own_step_under_strategy(self, runs)
        ours = runs["ours"][0]
        self.assertTrue(keras_graph.is_traced(ours))
        graph = ours.plan.graph
        self.assertEqual([op.name for op in graph], ["numpy_network"])
        config = ours.strategy["numpy_network"]
        self.assertGreater(config.dims[0], 1, config)  # the batch split
        assert_same_runs(self, runs)


    def test_tensor_kept_on_a_layer_and_sizes_passed_between_layers(self):
        """Before, the probe copied the graph tensor `self.gates` kept
        from the trace ("Cannot convert a symbolic tf.Tensor ... to a
        numpy array") and the model trained as plain Keras on one
        device, after two Keras warnings about unbuilt state that only
        the trace caused."""
        fresh_caches(self)  # a cached probe would hide the failure
        rng = np.random.default_rng(2)
        x = rng.random((ROWS, 8, 8, 3)).astype("float32")
        y = rng.integers(0, 3, ROWS)
        runs = train_plain_and_ours(
            build_focal, 5, lambda model: model.fit(
                x, y, batch_size=BATCH, epochs=2, shuffle=False,
                verbose=0).history)
        assert_own_step_under_strategy(self, runs)
        self.assertFalse([m for m in runs["ours"][2] if "unbuilt" in m],
                         runs["ours"][2])
        ours = runs["ours"][0]
        self.assertEqual([op.name for op in ours.plan.graph], ["focal"])
        self.assertGreater(ours.strategy["focal"].dims[0], 1)
        assert_same_runs(self, runs)

    def test_traced_on_each_batch_size_where_it_needs_one(self):
        rng = np.random.default_rng(1)
        x = rng.random((ROWS, 5, FEATURES)).astype("float32")
        y = x.mean(axis=(1, 2))[:, None]

        def train(model):
            first = model.fit(x, y, batch_size=BATCH, epochs=2,
                              shuffle=False, verbose=0).history
            second = model.fit(x, y, batch_size=BATCH // 2, epochs=1,
                               shuffle=False, verbose=0).history
            return {key: first[key] + second[key] for key in first}

        runs = train_plain_and_ours(build_token, 2, train)
        assert_own_step_under_strategy(self, runs)
        plans = runs["ours"][0]._flexflow_state.plans
        self.assertEqual(sorted(plans), [BATCH // 2, BATCH])
        for batch, plan in plans.items():
            self.assertEqual([op.name for op in plan.graph],
                             ["token_network"])
            self.assertEqual(plan.graph.op("token_network").input_shapes,
                             ((batch, 5, FEATURES),))
        assert_same_runs(self, runs)


if __name__ == "__main__":
    unittest.main()
