"""`tf.print` in a model's step prints what plain Keras prints, once.

DTensor runs every op of the step on every device of the mesh, so a
`tf.print` in a user's `train_step` printed each line once per device,
and one in a custom layer's `call` printed at every run of planning's
cost measurement and probes too (`flexflow_keras/runtime/step_prints.py`).
"""

import os
import tempfile
import unittest

import keras
import numpy as np
import tensorflow as tf

import flexflow_keras as fk
import runtime_support


def build(mod, stream):
    class Noisy(mod.layers.Layer):
        """A layer of the user's that prints its input's mean."""

        def call(self, h):
            tf.print("layer", tf.reduce_mean(h), output_stream=stream)
            return h

    class Printing(mod.Model):
        def train_step(self, data):
            logs = super().train_step(data)
            tf.print("train", {"loss": logs["loss"],
                               "step": self.optimizer.iterations},
                     [1, "a"], sep="|", output_stream=stream)
            return logs

        def test_step(self, data):
            logs = super().test_step(data)
            tf.print("test", logs["loss"], self.layers[1].kernel[0],
                     summarize=2, output_stream=stream)
            return logs

    inputs = mod.Input((6,))
    hidden = Noisy()(mod.layers.Dense(8)(inputs))
    model = Printing(inputs, mod.layers.Dense(1)(hidden))
    options = {"search_budget": 30} if mod is fk else {}
    model.compile(optimizer="sgd", loss="mse", **options)
    return model


def printed_lines(mod):
    """The lines a fit with validation, then predict, print."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)).astype("float32")
    y = rng.normal(size=(40, 1)).astype("float32")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "printed.txt")
        keras.utils.set_random_seed(1)
        model = build(mod, "file://" + path)
        model.fit(x, y, batch_size=16, epochs=1, validation_split=0.2,
                  shuffle=False, verbose=0)
        model.predict(x[:5], verbose=0)
        with open(path) as file:
            return model, file.read().splitlines()


def same_line(ours, plain):
    """Equal words, numbers within float noise."""
    ours, plain = ours.replace("|", " ").split(), plain.replace(
        "|", " ").split()
    if len(ours) != len(plain):
        return False
    for a, b in zip(ours, plain):
        a, b = a.strip("[]{},'"), b.strip("[]{},'")
        try:
            if not np.isclose(float(a), float(b), rtol=1e-5, atol=1e-6):
                return False
        except ValueError:
            if a != b:
                return False
    return True


class StepPrintsTest(unittest.TestCase):
    def test_prints_once_as_in_plain_keras(self):
        runtime_support.fresh_caches(self)  # planning measures the layer
        _, plain = printed_lines(keras)
        model, ours = printed_lines(fk)
        devices = {d for c in model.strategy.values() for d in c.device_ids}
        self.assertGreater(len(devices), 1, model.strategy)
        # 2 train steps, 1 validation step, 1 predict step: the layer
        # prints at each, the train and test steps after.
        self.assertEqual([line.split("|")[0].split()[0] for line in plain],
                         ["layer", "train", "layer", "train", "layer",
                          "test", "layer"])
        self.assertEqual(len(ours), len(plain), ours)
        for our_line, plain_line in zip(ours, plain):
            self.assertTrue(same_line(our_line, plain_line),
                            (our_line, plain_line))


if __name__ == "__main__":
    unittest.main()
