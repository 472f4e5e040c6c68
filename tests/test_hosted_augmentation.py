"""Random augmentations DTensor cannot lay out run on the host.

Keras's RandAugment and AugMix (whose Equalization slices a tensor of a
size known only at run time) and RandomElasticTransform (a reshape to
such a size) fail in DTensor even replicated, so a model with one
trained as plain Keras on one device. Called on the model's inputs,
alone, after other preprocessing layers, or inside a nested
`data_augmentation` model, they now run on the host before each step
(`keras_graph.hosted_nodes`, `runtime/host_prefix.py`), in train steps
with `training=True` and in test and predict steps without, and the
model trains under its strategy, equal to plain Keras: the same draws,
epoch after epoch.
"""

import contextlib
import io
import os
import unittest
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from keras.src.layers.preprocessing.image_preprocessing import aug_mix

from flexflow_keras.keras_graph import function_of, hosted_nodes
from runtime_support import (
    assert_own_step_under_strategy, assert_same_fit_evaluate_predict,
    assert_same_runs, train_plain_and_ours,
)

L = keras.layers
RANGE = (0, 255)


def _images(rows=64, seed=0):
    rng = np.random.default_rng(seed)
    return ((rng.uniform(size=(rows, 16, 16, 3)) * 255).astype("float32"),
            rng.integers(0, 4, size=(rows,)))


AUGMENTATIONS = {
    "RandAugment on the input": lambda mod, x: mod.layers.RandAugment(
        value_range=RANGE, seed=5)(x),
    "AugMix after a RandomFlip": lambda mod, x: mod.layers.AugMix(
        value_range=RANGE, seed=5)(mod.layers.RandomFlip(seed=2)(x)),
    "a data_augmentation model": lambda mod, x: mod.Sequential([
        mod.layers.RandomFlip(seed=2),
        mod.layers.RandomElasticTransform(factor=0.5, scale=0.5, seed=5),
    ], name="data_augmentation")(x),
}


def build(mod, augment):
    inputs = mod.Input((16, 16, 3))
    h = mod.layers.Rescaling(1 / 255.0)(augment(mod, inputs))
    h = mod.layers.Conv2D(8, 3, activation="relu")(h)
    h = mod.layers.Dropout(0.2, seed=3)(h)
    h = mod.layers.GlobalAveragePooling2D()(h)
    model = mod.Model(inputs, mod.layers.Dense(4)(h))
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    return model


@contextlib.contextmanager
def _augmix_chains_fixed():
    """AugMix picks the layers of its chains with Python's `random` when
    its call is traced, so its chains follow how often TensorFlow traces
    the function that calls it: plain Keras's train function is traced
    twice when its first trace makes variables (Dropout's seed state),
    and took the second pick, the host's function once. Either is
    AugMix; the test fixes the picks (always the first layer) to
    compare what the host computes with plain Keras."""

    class Picker:
        @staticmethod
        def choice(options):
            return options[0]

    with mock.patch.object(aug_mix, "py_random", Picker):
        yield


class HostedAugmentationTest(unittest.TestCase):
    def test_trains_under_a_strategy_equal_to_plain_keras(self):
        x, y = _images()

        def train(model):
            history = model.fit(x, y, batch_size=16, epochs=2,
                                validation_split=0.25, shuffle=False,
                                verbose=0).history
            return [history, model.evaluate(x, y, verbose=0),
                    model.predict(x[:16], verbose=0)]

        for case, augment in AUGMENTATIONS.items():
            with self.subTest(case), _augmix_chains_fixed():
                runs = train_plain_and_ours(
                    lambda mod: build(mod, augment), 3, train)
                assert_own_step_under_strategy(self, runs)
                ours = runs["ours"][0]
                self.assertTrue(ours.plan.graph.hosted_inputs)
                devices = {d for c in ours.strategy.values()
                           for d in c.device_ids}
                self.assertGreater(len(devices), 1)
                assert_same_fit_evaluate_predict(self, runs)

    def test_the_layout_table_leaves_the_draws_as_they_were(self):
        """`FLEXFLOW_KERAS_SHOW_LAYOUTS` runs the train step once more to
        read its layouts, its writes undone; the host's augmentation
        drew for it too, and its seed state is put back as well (else
        every later step augmented other images than plain Keras)."""
        x, y = _images()
        with mock.patch.dict(os.environ,
                             {"FLEXFLOW_KERAS_SHOW_LAYOUTS": "1"}), \
                contextlib.redirect_stdout(io.StringIO()) as shown:
            runs = train_plain_and_ours(
                lambda mod: build(mod, AUGMENTATIONS[
                    "RandAugment on the input"]),
                3, lambda model: model.fit(
                    x, y, batch_size=16, epochs=2, shuffle=False,
                    verbose=0).history)
        self.assertIn("layouts in the train step", shown.getvalue())
        assert_own_step_under_strategy(self, runs)
        assert_same_runs(self, runs)

    def test_a_step_calling_it_with_another_training_trains_as_keras(self):
        """A `train_step` that calls the model with `training=False`
        (augmentation off) while the host augments for train steps: the
        model trains as plain Keras, saying why, rather than on augmented
        images plain Keras never sees."""
        x, y = _images()

        def build_own_step(mod):
            class Unaugmented(mod.Model):
                def train_step(self, data):
                    x, y = data
                    with tf.GradientTape() as tape:
                        loss = self.compute_loss(
                            x=x, y=y, y_pred=self(x, training=False))
                    self.optimizer.apply(
                        tape.gradient(loss, self.trainable_variables),
                        self.trainable_variables)
                    return {"loss": loss}

            model = build(mod, AUGMENTATIONS["RandAugment on the input"])
            model = Unaugmented(model.inputs, model.outputs)
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(
                              from_logits=True))
            return model

        runs = train_plain_and_ours(build_own_step, 3, lambda model: [
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                      verbose=0).history,
            model.evaluate(x, y, verbose=0),
            model.predict(x[:16], verbose=0)])
        said = [m for m in runs["ours"][2] if "plain Keras" in m]
        self.assertEqual(len(said), 1, runs["ours"][2])
        self.assertIn("training=False", said[0])
        assert_same_fit_evaluate_predict(self, runs)

    def test_only_on_the_inputs(self):
        """After a layer with weights, an augmentation DTensor cannot
        lay out is no host call: the model trains as plain Keras, saying
        why (`capabilities`' reason)."""
        inputs = keras.Input((16, 16, 3))
        h = L.RandAugment(value_range=RANGE, seed=5)(
            L.Conv2D(3, 1)(inputs))
        model = keras.Model(inputs, L.Dense(4)(L.Flatten()(h)))
        self.assertEqual(hosted_nodes(function_of(model)), [])
        on_input = keras.Model(inputs, L.RandAugment(
            value_range=RANGE, seed=5)(inputs))
        self.assertEqual(len(hosted_nodes(function_of(on_input))), 0,
                         "a model output stays a model output")


if __name__ == "__main__":
    unittest.main()
