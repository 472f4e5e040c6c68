"""A step of the user's own that uses the gradient of the loss with
respect to its inputs trains under its strategy, equal to plain Keras.

Adversarial training moves each batch along that gradient and trains on
the result (`x + eps * dL/dx`, FGSM without the sign). DTensor refused
such a step ("output layout of Relayout op after layout propagation
does not match layout specified by Relayout op", TF 2.21), and the
model went to plain Keras for good: the gradient of the model input's
relayout (DTensor's `RelayoutLike`) met the input again. Such an input
now gets its gradient whole (`model_step._relaid_gradient_whole`).
"""

import unittest

import numpy as np
import tensorflow as tf

import runtime_support as support
from flexflow_keras.runtime import model_step
from flexflow_keras.strategy import Strategy

ROWS, STEPS, BATCH = 64, 5, 16


def adversarial(mod, body):
    """A model whose `train_step` trains on its batch moved along the
    loss's gradient with respect to it, `body(mod, inputs)` its layers."""

    class Adversarial(mod.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as probe:
                probe.watch(x)
                probe_loss = self.compute_loss(
                    x, y, self(x, training=False))
            x = x + 10.0 * probe.gradient(probe_loss, x)
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x, y, self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss, "probe_loss": probe_loss}

    return lambda inputs: Adversarial(inputs, body(mod, inputs))


def dense_body(mod, inputs):
    h = mod.layers.Dense(8, activation="relu", name="hidden")(inputs)
    h = mod.layers.Dropout(0.25, seed=3, name="drop")(h)
    return mod.layers.Dense(1, name="out")(h)


def gru_body(mod, inputs):
    h = mod.layers.GRU(6, name="gru")(inputs)
    return mod.layers.Dense(1, name="out")(h)


class InputGradientStepTest(unittest.TestCase):
    def fit_both(self, body, shape, make_strategy):
        rng = np.random.default_rng(4)
        x = rng.normal(size=(ROWS,) + shape).astype("float32")
        y = x.reshape(ROWS, -1)[:, :2].mean(axis=1, keepdims=True)

        def build(mod):
            return adversarial(mod, body)(mod.Input(shape, name="x"))

        histories, models, messages = support.fit_plain_and_ours(
            build, make_strategy, BATCH, 3,
            dict(optimizer="adam", loss="mse"), x=x, y=y, epochs=2,
            shuffle=False, verbose=0)
        support.assert_not_handed_over(self, messages, messages)
        self.assertIsInstance(models["ours"].strategy_executor,
                              model_step.ModelStepExecutor)
        support.assert_same_fits(self, histories, models)
        return models["ours"]

    def test_dense(self):
        for name, make in (
                ("data parallel", lambda g: Strategy.data_parallel(g, 4)),
                ("channels split", support.parameter)):
            with self.subTest(strategy=name):
                self.fit_both(dense_body, (6,), make)

    def test_recurrent_loop(self):
        self.fit_both(gru_body, (STEPS, 3),
                      lambda g: Strategy.data_parallel(g, 4))


if __name__ == "__main__":
    unittest.main()
