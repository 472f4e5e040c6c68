"""Slices whose bounds are known only at run time (`x[:, h:h + 8]` with a
tensor `h`: Keras's `RandomCrop`) compute what TensorFlow computes under
DTensor (`op_rules.plain_slice`): DTensor's `StridedSlice` with such
bounds gave an empty slice on every device, replicated or split, and a
model with RandomCrop failed its first step and trained as plain Keras
(keras.io's TokenLearner).
"""

import unittest

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

import flexflow_keras as fk
from flexflow_keras.runtime import op_rules

from runtime_support import (
    assert_own_step_under_strategy, assert_same_runs, train_plain_and_ours,
)

BASE = np.arange(4 * 10 * 10 * 3, dtype="float32").reshape(4, 10, 10, 3)


def _mesh():
    devices = [f"CPU:{i}" for i in range(2)]
    return dtensor.create_mesh([("b", 2)], devices=devices,
                               device_type="CPU")


def build(mod):
    images = mod.Input((12, 12, 3))
    h = mod.layers.RandomCrop(8, 8, seed=3, name="crop")(images)
    h = mod.layers.Conv2D(4, 3, name="conv")(h)
    h = mod.layers.Flatten(name="flat")(h)
    model = mod.Model(images, mod.layers.Dense(2, name="out")(h))
    options = {"search_budget": 0} if mod is fk else {}
    model.compile(optimizer="sgd", loss="mse", **options)
    return model


class RunTimeSlicesTest(unittest.TestCase):
    def test_slices_equal_numpy_on_a_mesh(self):
        mesh = _mesh()
        specs = {
            "h:h+8": lambda x, s: x[:, s:s + 8, s:s + 8, :],
            "s:": lambda x, s: x[:, s:],
            ":s, ...": lambda x, s: x[..., :s, :],
            "-s:": lambda x, s: x[:, -s:],
        }
        wants = {
            "h:h+8": BASE[:, 1:9, 1:9, :], "s:": BASE[:, 1:],
            ":s, ...": BASE[..., :1, :], "-s:": BASE[:, -1:],
        }
        for sharding in ("unsharded", "b"):
            layout = dtensor.Layout(
                [sharding] + ["unsharded"] * 3, mesh)
            x = dtensor.relayout(dtensor.copy_to_mesh(
                tf.constant(BASE), dtensor.Layout.replicated(mesh, 4)),
                layout)
            start = dtensor.copy_to_mesh(
                tf.constant(1), dtensor.Layout.replicated(mesh, 0))
            for name, spec in specs.items():
                with self.subTest(sharding=sharding, spec=name), \
                        op_rules.substitutes(mesh):
                    total = tf.function(
                        lambda x, s, spec=spec: tf.reduce_sum(spec(x, s)))
                    got = float(dtensor.unpack(total(x, start))[0])
                    self.assertEqual(got, float(wants[name].sum()))

    def test_other_indexing_is_left_to_tensorflow(self):
        x = tf.constant(BASE)
        self.assertIsNone(op_rules.plain_slice(x, (slice(None), 1)))
        self.assertIsNone(op_rules.plain_slice(x, slice(0, 2)))
        self.assertIsNone(op_rules.plain_slice(
            x, slice(tf.constant(0), None, 2)))

    def test_random_crop_trains_under_the_strategy_equal_to_keras(self):
        rng = np.random.default_rng(0)
        x = rng.random((64, 12, 12, 3)).astype("float32")
        y = rng.random((64, 2)).astype("float32")
        runs = train_plain_and_ours(
            build, 1, lambda model: model.fit(
                x, y, batch_size=16, epochs=2, shuffle=False,
                verbose=0).history)
        assert_own_step_under_strategy(self, runs)
        assert_same_runs(self, runs)


if __name__ == "__main__":
    unittest.main()
