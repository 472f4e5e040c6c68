"""Recurrent layers run as DTensor loops compute what Keras's loop does.

A DTensor step runs RNN layers of Keras's own cells as `rolled_rnn`'s
loop (a while loop over plain tensors with a backward loop of its own),
and any other (a user's cell, `unroll=True`) unrolled
(`runtime/unroll.py`). Both are checked against Keras's rolled loop:
outputs and gradients (inputs, weights) equal, dropout masks included.

Keras 3's
own unrolled TensorFlow loop zeroes a backward layer's masked outputs at
the wrong time steps when `zero_output_for_mask` is on (as
`Bidirectional(return_sequences=True)` sets it): outputs 0.57 off its
rolled loop for an LSTM. Each recurrent layer type, in both directions,
with and without sequences, zeroed outputs and returned states
(Keras's wrong case and its neighbours), is run
rolled and unrolled as the runtime runs it and rolled as plain Keras runs
it, on sequences of several lengths: outputs and gradients equal.
"""

import itertools
import unittest

import keras
import numpy as np
import pytest
import tensorflow as tf

from flexflow_keras.runtime import rolled_rnn
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


def _run(layer_type, how, **options):
    """Outputs and gradients (inputs, weights) of a fresh layer, run
    `how`: "keras" (its rolled loop), "rolled" or "unrolled" (the
    runtime's loops)."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(16, 10, 8)).astype("float32"))
    lengths = rng.integers(2, 11, 16)
    mask = tf.constant(np.arange(10)[None, :] < lengths[:, None])
    keras.utils.set_random_seed(1)
    if layer_type.startswith("Bidirectional"):
        layer = keras.layers.Bidirectional(
            getattr(keras.layers, layer_type.split()[1])(6, **options)
        )
    else:
        layer = getattr(keras.layers, layer_type)(6, **options)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            if how == "keras":
                out = layer(x, mask=mask, training=True)
            else:
                with unrolled(layer, rolled=how == "rolled"):
                    out = layer(x, mask=mask, training=True)
            flat = tf.concat(
                [tf.reshape(o, [-1]) for o in tf.nest.flatten(out)], 0
            )
            weights = tf.sin(tf.range(tf.size(flat), dtype=tf.float32))
            loss = tf.reduce_sum(weights * flat)
        return [flat] + tape.gradient(loss, [x] + layer.trainable_variables)

    return [t.numpy() for t in step(x)]


class _UserCell(keras.layers.Layer):
    """A user's cell: runs unrolled (its body is unknown to DTensor)."""

    state_size = 3

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3))

    def call(self, inputs, states):
        output = tf.tanh(inputs @ self.kernel + states[0])
        return output, [output]


def _assert_same(test, expected, got):
    test.assertEqual(len(expected), len(got))
    for a, b in zip(expected, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


class DTensorLoopTest(unittest.TestCase):
    def check_loops(self, option_sets):
        for layer_type, (backwards, sequences, zeroed, state) in (
            itertools.product(LAYERS, option_sets)
        ):
            options = dict(
                go_backwards=backwards, return_sequences=sequences,
                zero_output_for_mask=zeroed, return_state=state,
            )
            expected = _run(layer_type, "keras", **options)
            for how in ("rolled", "unrolled"):
                with self.subTest(layer=layer_type, how=how, **options):
                    _assert_same(self, expected,
                                 _run(layer_type, how, **options))

    def test_loops_equal_keras_loop(self):
        # Keras's wrong case and the default; the neighbours are slow.
        self.check_loops((OPTIONS[0], OPTIONS[-1]))

    @pytest.mark.slow  # 54 traced loops with gradients: about 2 minutes
    def test_loops_equal_keras_loop_every_option(self):
        self.check_loops(OPTIONS)

    # Slow: test_loops_equal_keras_loop checks the loops; test_rolled_rnn.py
    # trains a Bidirectional LSTM with both dropouts by default; ~38 s
    @pytest.mark.slow
    def test_dropout_and_bidirectional(self):
        """The backward loop reuses the forward's dropout masks, which
        `RNN.call` cleared before the gradient ran (without putting them
        back, new masks are drawn: gradients up to 7 off)."""
        cases = [(kind, dict(return_sequences=True, dropout=0.3,
                             recurrent_dropout=0.2, seed=3))
                 for kind in LAYERS]
        cases += [(f"Bidirectional {kind}", dict(return_sequences=seq))
                  for kind in ("LSTM", "GRU") for seq in (False, True)]
        for layer_type, options in cases:
            with self.subTest(layer=layer_type, **options):
                _assert_same(self, _run(layer_type, "keras", **options),
                             _run(layer_type, "rolled", **options))

    def test_which_loop(self):
        """Rolled, Keras's cells roll; a user's cell or `unroll=True`
        unrolls; Keras is restored after."""
        from keras.src import backend

        before = backend.rnn
        lstm = keras.layers.LSTM(3)
        user = keras.layers.RNN(_UserCell())
        asked = keras.layers.GRU(3, unroll=True)
        stacked = keras.layers.RNN(keras.layers.StackedRNNCells(
            [keras.layers.GRUCell(3), keras.layers.LSTMCell(3)]
        ))
        self.assertEqual(len(rolled_rnn.cells_of(stacked.cell)), 2)
        self.assertIsNone(rolled_rnn.cells_of(user.cell))
        for layer, rolled, unrolls in (
            (lstm, True, False), (user, True, True), (stacked, True, False),
            (asked, True, True), (lstm, False, True),
        ):
            was = layer.unroll
            with unrolled(layer, rolled=rolled):
                self.assertEqual(layer.unroll, unrolls)
                self.assertIsNot(backend.rnn, before)
            self.assertEqual(layer.unroll, was)
        self.assertIs(backend.rnn, before)

    def test_user_cell_unrolled_equals_keras(self):
        x = tf.constant(np.random.default_rng(0).normal(
            size=(4, 5, 2)).astype("float32"))
        layer = keras.layers.RNN(_UserCell(), return_sequences=True)
        expected = layer(x)
        with unrolled(layer, rolled=True):
            got = tf.function(layer)(x)
        np.testing.assert_allclose(got, expected, rtol=1e-6)
