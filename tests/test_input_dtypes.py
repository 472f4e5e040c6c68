"""Boolean, uint8 and int8 input and target arrays train under a strategy
equal to plain Keras (issue 21).

keras.io's sequence-to-sequence addition model feeds one-hot boolean
arrays; Keras's accuracy then takes `argmax` of the targets without a
cast, and DTensor's ArgMax split its output without slicing its
replicated input ("Expected shape: <128,3> got shape: <32,3>"): the model
fell back to plain Keras at its first step (`op_rules`: argmax output
pinned whole).
"""

import unittest

import numpy as np

from test_own_step import SAMPLES, train_both


def _one_hot(rng, shape, classes, dtype):
    return np.eye(classes, dtype=dtype)[rng.integers(0, classes, shape)]


def build_seq2seq_bool(mod):
    # keras.io's addition_rnn, small.
    rng = np.random.default_rng(0)
    x = _one_hot(rng, (SAMPLES, 5), 4, bool)
    y = _one_hot(rng, (SAMPLES, 3), 4, bool)
    model = mod.Sequential([
        mod.Input((5, 4)),
        mod.layers.LSTM(8),
        mod.layers.RepeatVector(3),
        mod.layers.LSTM(8, return_sequences=True),
        mod.layers.Dense(4, activation="softmax"),
    ])
    model.compile(optimizer="adam", loss="categorical_crossentropy",
                  metrics=["accuracy"])
    return model, (x, y)


def build_uint8_images_int8_labels(mod):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (SAMPLES, 6, 6, 1)).astype("uint8")
    y = rng.integers(0, 3, (SAMPLES,)).astype("int8")
    inputs = mod.Input((6, 6, 1))
    h = mod.layers.Rescaling(1 / 255)(inputs)
    h = mod.layers.Flatten()(h)
    h = mod.layers.Dense(16, activation="relu")(h)
    outputs = mod.layers.Dense(3)(h)
    model = mod.Model(inputs, outputs)
    model.compile(
        optimizer="adam",
        loss=mod.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model, (x, y)


def build_int8_one_hot_targets(mod):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(SAMPLES, 8)).astype("float32")
    y = _one_hot(rng, (SAMPLES,), 4, "int8")
    inputs = mod.Input((8,))
    outputs = mod.layers.Dense(4, activation="softmax")(
        mod.layers.Dense(16, activation="relu")(inputs)
    )
    model = mod.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="categorical_crossentropy",
                  metrics=["accuracy", "categorical_accuracy"])
    return model, (x, y)


class InputDtypesTest(unittest.TestCase):
    def test_bool_uint8_int8(self):
        for name, build in (
            ("seq2seq_bool", build_seq2seq_bool),
            ("uint8_images_int8_labels", build_uint8_images_int8_labels),
            ("int8_one_hot_targets", build_int8_one_hot_targets),
        ):
            with self.subTest(model=name):
                train_both(self, name, build)
