"""Recurrent layers unrolled for DTensor compute what Keras's loop does.

A DTensor step runs RNN layers unrolled (`runtime/unroll.py`). Keras 3's
own unrolled TensorFlow loop zeroes a backward layer's masked outputs at
the wrong time steps when `zero_output_for_mask` is on (as
`Bidirectional(return_sequences=True)` sets it): outputs 0.57 off its
rolled loop for an LSTM. Each recurrent layer type, in both directions,
with and without sequences, zeroed outputs and returned states
(Keras's wrong case and its neighbours), is run
unrolled as the runtime runs it and rolled as plain Keras runs it, on
sequences of several lengths: outputs and gradients equal.
"""

import itertools
import unittest

import keras
import numpy as np
import tensorflow as tf

from flexflow_keras.runtime.unroll import unrolled

LAYERS = ("LSTM", "GRU", "SimpleRNN")
# (go_backwards, return_sequences, zero_output_for_mask, return_state):
# Keras's wrong case, its neighbours, and the default.
OPTIONS = (
    (True, True, True, False),
    (True, True, True, True),
    (True, False, True, True),
    (False, True, True, False),
    (True, True, False, False),
    (False, False, False, False),
)


def _run(layer_type, unroll, **options):
    """Outputs and gradients (inputs, weights) of a fresh layer."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(16, 10, 8)).astype("float32"))
    lengths = rng.integers(2, 11, 16)
    mask = tf.constant(np.arange(10)[None, :] < lengths[:, None])
    keras.utils.set_random_seed(1)
    layer = getattr(keras.layers, layer_type)(6, **options)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            if unroll:
                with unrolled(layer):
                    out = layer(x, mask=mask)
            else:
                out = layer(x, mask=mask)
            flat = tf.concat(
                [tf.reshape(o, [-1]) for o in tf.nest.flatten(out)], 0
            )
            weights = tf.sin(tf.range(tf.size(flat), dtype=tf.float32))
            loss = tf.reduce_sum(weights * flat)
        return [flat] + tape.gradient(loss, [x] + layer.trainable_variables)

    return [t.numpy() for t in step(x)]


class UnrolledMaskTest(unittest.TestCase):
    def test_unrolled_equals_keras_loop(self):
        for layer_type, (backwards, sequences, zeroed, state) in (
            itertools.product(LAYERS, OPTIONS)
        ):
            options = dict(
                go_backwards=backwards, return_sequences=sequences,
                zero_output_for_mask=zeroed, return_state=state,
            )
            with self.subTest(layer=layer_type, **options):
                rolled = _run(layer_type, False, **options)
                ours = _run(layer_type, True, **options)
                for a, b in zip(rolled, ours):
                    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)

    def test_keras_is_restored(self):
        from keras.src import backend

        before = backend.rnn
        layer = keras.layers.LSTM(3)
        with unrolled(layer):
            self.assertTrue(layer.unroll)
            self.assertIsNot(backend.rnn, before)
        self.assertFalse(layer.unroll)
        self.assertIs(backend.rnn, before)
