"""TensorFlow's stateful random ops in a model's own step draw what plain
Keras draws (`runtime/stateful_draws.py`).

keras.io's VAE samples with `tf.random.normal` in a layer, its WGAN-GP
and DCGAN draw latents and mixing weights with `tf.random.normal/
uniform` in `train_step`. DTensor refuses those ops; the step runs their
stateless twins with the key and counter each op's kernel would have in
plain Keras's traced step, so training equals plain Keras's from the
same seed. The model below combines them with a Keras Dropout (drawn
from a seed generator), an explicit op seed, an integer draw,
`tf.nn.dropout`, a partial last batch and a `test_step` that draws too.
"""

import unittest
from unittest import mock

import keras
import numpy as np
import tensorflow as tf

import flexflow_keras as fk
import runtime_support as support
from flexflow_keras.runtime import stateful_draws

BATCH = 16
ROWS = 88  # 5 whole batches and one of 8 rows


def build(mod):
    class Sampling(mod.layers.Layer):
        """keras.io VAE's sampling layer: an unseeded tf.random.normal."""

        def call(self, inputs):
            mean, log_var = inputs
            epsilon = tf.random.normal(shape=tf.shape(mean))
            return mean + tf.exp(0.5 * log_var) * epsilon

    class NoisyVAE(mod.Model):
        def __init__(self):
            super().__init__()
            self.hidden = mod.layers.Dense(16, activation="relu")
            self.dropout = mod.layers.Dropout(0.25)
            self.mean = mod.layers.Dense(4)
            self.log_var = mod.layers.Dense(4)
            self.sampling = Sampling()
            self.decoder = mod.layers.Dense(8)
            self.tracker = keras.metrics.Mean(name="loss")

        def call(self, x, training=False):
            h = self.dropout(self.hidden(x), training=training)
            z = self.sampling([self.mean(h), self.log_var(h)])
            return self.decoder(z)

        def losses_of(self, x, training):
            # WGAN-GP's mixing weights: seeded op, minval and maxval.
            alpha = tf.random.uniform([tf.shape(x)[0], 1], 0.2, 0.8,
                                      seed=11)
            # Rows whose reconstruction counts: integer draws.
            kept = tf.random.uniform([tf.shape(x)[0]], 0, 4, dtype=tf.int32)
            noisy = tf.nn.dropout(alpha * x, rate=0.1)
            errors = tf.reduce_mean(
                tf.square(self(noisy, training=training) - x), axis=1)
            weights = tf.cast(kept > 0, errors.dtype)
            return tf.reduce_sum(errors * weights) / tf.reduce_sum(
                weights + 1e-3)

        def train_step(self, data):
            x, _ = data
            with tf.GradientTape() as tape:
                loss = self.losses_of(x, training=True)
            weights = self.trainable_weights
            self.optimizer.apply_gradients(
                zip(tape.gradient(loss, weights), weights))
            self.tracker.update_state(loss)
            return {"loss": self.tracker.result()}

        def test_step(self, data):
            x, _ = data
            self.tracker.update_state(self.losses_of(x, training=False))
            return {"loss": self.tracker.result()}

        @property
        def metrics(self):
            return [self.tracker]

    model = NoisyVAE()
    options = {"search_budget": 50} if mod is fk else {}
    model.compile(optimizer="adam", **options)
    return model


def data(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 8)).astype("float32")
    return x, np.zeros((ROWS, 1), "float32")


def train(model):
    return model.fit(*data(0), batch_size=BATCH, epochs=2, shuffle=False,
                     validation_data=data(1), verbose=0).history


class StatefulDrawsTest(unittest.TestCase):
    def test_equal_to_plain_keras(self):
        runs = support.train_plain_and_ours(build, 3, train)
        support.assert_own_step_under_strategy(self, runs)
        executor = runs["ours"][0].strategy_executor
        self.assertGreater(len(executor.mesh.local_devices()), 1)
        support.assert_same_runs(self, runs)
        # Each draw has a slot of its own, per step kind: 4 in the train
        # step (Sampling's, alpha, kept, tf.nn.dropout), 4 in the test
        # step.
        counters = executor._random_state.read_value().numpy()
        per_kind = stateful_draws.SLOTS_PER_KIND
        self.assertEqual(np.count_nonzero(counters[:per_kind]), 4)
        self.assertEqual(np.count_nonzero(counters[per_kind:]), 4)

    def test_differs_from_plain_keras_with_counters_kept(self):
        """The comparison above can fail: with every draw's counter left
        where it started (each step draws the same numbers), training
        differs."""
        with mock.patch.object(stateful_draws, "_COUNTER_PER_ELEMENT", 0):
            runs = support.train_plain_and_ours(build, 3, train)
        support.assert_own_step_under_strategy(self, runs)
        with self.assertRaises(AssertionError):
            support.assert_same_runs(self, runs)
