"""Probability outputs over several device meshes: the loss reads logits.

Keras's crossentropies compute a softmax or sigmoid output's loss from
its logits (`_keras_logits`), not from the clipped probabilities, which
differ once they saturate. The layer-by-layer executor over several
meshes (`runtime/step.py`) passes the loss its outputs through a function
boundary; it used to refuse such a model and train it under data
parallelism instead of its searched strategy (keras.io's IMDB
bidirectional LSTM, whose sigmoid output met it). Now each probability
output's logits travel beside it, and the loss and its gradient come from
them, as in plain Keras.

Each model here has its output layer initialised large enough that its
probabilities saturate, trains 2 epochs with a validation split under an
imported strategy whose ops alternate between devices (0, 1) and (2, 3),
and is compared with plain Keras from the same weights: losses,
validation losses, metrics, weights and predictions within 1e-5.
"""

import unittest

import keras
import numpy as np

from flexflow_keras.runtime import model_step, step
from flexflow_keras.strategy import ParallelConfig, Strategy
from runtime_support import float64, several_meshes
from test_random_draws import BATCH, EPOCHS, RTOL, fit_both

SAMPLES = 64
SATURATING = {"kernel_initializer": keras.initializers.RandomNormal(
    stddev=8.0, seed=3)}


def build_softmax(mod):
    inputs = mod.Input((12,), name="x")
    h = mod.layers.Dense(16, activation="relu", name="d1")(inputs)
    h = mod.layers.Dense(16, activation="tanh", name="d2")(h)
    outputs = mod.layers.Dense(5, activation="softmax", name="probs",
                               **SATURATING)(h)
    model = mod.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 12)).astype("float32")
    return model, (x, rng.integers(0, 5, SAMPLES))


def build_sigmoid(mod):
    inputs = mod.Input((12,), name="x")
    h = mod.layers.Dense(16, activation="relu", name="d1")(inputs)
    h = mod.layers.Dense(16, activation="tanh", name="d2")(h)
    outputs = mod.layers.Dense(1, activation="sigmoid", name="prob",
                               **SATURATING)(h)
    model = mod.Model(inputs, outputs)
    model.compile(optimizer="rmsprop", loss="binary_crossentropy",
                  metrics=["accuracy"])
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, 12)).astype("float32")
    return model, (x, (x[:, 0] > 0).astype("float32"))


def build_two_heads(mod):
    # A softmax head beside a linear one: only one output has logits.
    inputs = mod.Input((12,), name="x")
    h = mod.layers.Dense(16, activation="relu", name="d1")(inputs)
    classes = mod.layers.Dense(3, activation="softmax", name="classes",
                               **SATURATING)(h)
    value = mod.layers.Dense(1, name="value")(h)
    model = mod.Model(inputs, [classes, value])
    model.compile(optimizer="adam",
                  loss=["categorical_crossentropy", "mse"])
    rng = np.random.default_rng(2)
    x = rng.normal(size=(SAMPLES, 12)).astype("float32")
    labels = np.eye(3, dtype="float32")[rng.integers(0, 3, SAMPLES)]
    return model, (x, (labels, x[:, :1]))


class ProbabilityOutputsTest(unittest.TestCase):
    def check(self, build):
        """Equal to plain Keras (`fit_both`), run by the several-mesh
        step, predictions too; returns plain Keras's first epoch loss."""
        ours = fit_both(self, build, several_meshes)
        self.assertIsInstance(ours.strategy_executor, step.Executor)
        self.assertGreater(len(ours.strategy_executor.segments), 1)
        keras.utils.set_random_seed(7)
        plain, (x, y) = build(keras)
        plain.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                  verbose=0, validation_split=0.25)
        for a, b in zip(keras.tree.flatten(plain.predict(x, verbose=0)),
                        keras.tree.flatten(ours.predict(x, verbose=0))):
            np.testing.assert_allclose(b, a, rtol=RTOL, atol=1e-6)
        return plain.history.history

    def test_softmax(self):
        history = self.check(build_softmax)
        # Saturated: a loss from clipped probabilities would differ.
        self.assertGreater(history["loss"][0], 5.0)

    def test_sigmoid(self):
        self.check(build_sigmoid)

    def test_softmax_beside_a_linear_output(self):
        self.check(build_two_heads)


def build_softmax_dropout(mod):
    """Six classes (a degree of 2 divides them), after Dropout."""
    inputs = mod.Input((12,), name="x")
    h = mod.layers.Dense(16, activation="relu", name="d1")(inputs)
    h = mod.layers.Dropout(0.25, seed=4, name="drop")(h)
    outputs = mod.layers.Dense(6, activation="softmax", name="probs",
                               **SATURATING)(h)
    model = mod.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    rng = np.random.default_rng(3)
    x = rng.normal(size=(SAMPLES, 12)).astype("float32")
    return model, (x, rng.integers(0, 6, SAMPLES))


def classes_split(graph) -> Strategy:
    """One mesh over devices (0, 1): every op splits the batch but the
    last, which splits its classes (the softmax's logits arrive split on
    the dim the crossentropy reduces)."""
    configs = {}
    ops = list(graph)
    for op in ops:
        dims = (2,) + (1,) * (max(op.rank, 1) - 1)
        if op is ops[-1]:
            dims = (1,) * (op.rank - 1) + (2,)
        configs[op.name] = ParallelConfig(dims, (0, 1))
    return Strategy(configs)


class ClassesSplitTest(unittest.TestCase):
    """A softmax output split on its classes, in float64.

    The model's step reads the logits Keras keeps beside a softmax
    output. They were left in the op's layout, split on the class dim,
    while the output itself reached the loss whole on that dim; there
    DTensor's SparseSoftmaxCrossEntropyWithLogits gives wrong values in
    float64 and bfloat16 with no error (right in float32): the reported
    loss was 0 or NaN, and with Dropout the weights went elsewhere. Now
    the logits take the output's layout."""

    def test_softmax_split_on_its_classes_in_float64(self):
        with float64():
            ours = fit_both(self, build_softmax_dropout, classes_split)
        self.assertIsInstance(ours.strategy_executor,
                              model_step.ModelStepExecutor)
        last = ours.strategy[list(ours.strategy)[-1]]
        self.assertEqual(last.dims[-1], 2)
