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
while the batch is split.
"""

import unittest

import keras
import numpy as np
import tensorflow as tf
import tensorflow.experimental.numpy as tnp

import flexflow_keras as fk
from flexflow_keras import keras_graph

from runtime_support import (
    assert_own_step_under_strategy, assert_same_fits, train_plain_and_ours,
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


class OneOpModelTest(unittest.TestCase):
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
        assert_same_fits(self, {k: r[1] for k, r in runs.items()},
                         {k: r[0] for k, r in runs.items()})


if __name__ == "__main__":
    unittest.main()
