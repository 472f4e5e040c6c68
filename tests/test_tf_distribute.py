"""A model in a `tf.distribute` strategy's scope (`tf_distribute.py`).

keras.io's "Multi-GPU distributed training with TensorFlow" builds,
compiles, fits, checkpoints and reloads its model inside
`tf.distribute.MirroredStrategy().scope()`. Such a model trains under its
searched strategy, computing what one-device Keras computes (plain Keras
outside any scope, from the same seed); other strategies keep the model
plain Keras under them, said.
"""

import contextlib
import os
import tempfile
import unittest
import warnings

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import values as distribute_values

import flexflow_keras

RNG = np.random.default_rng(0)
X = RNG.normal(size=(96, 12)).astype("float32")
Y = RNG.integers(0, 4, 96)


def _build(mod):
    """Features that go through the step's own code together: a
    regularizer's loss, BatchNormalization's moving statistics,
    Dropout's seed, a metric object made in the scope."""
    inputs = mod.Input((12,))
    hidden = mod.layers.Dense(24, activation="relu",
                              kernel_regularizer="l2")(inputs)
    hidden = mod.layers.BatchNormalization()(hidden)
    hidden = mod.layers.Dropout(0.3, seed=3)(hidden)
    model = mod.Model(inputs, mod.layers.Dense(4)(hidden))
    model.compile(
        mod.optimizers.Adam(3e-3),
        mod.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[mod.metrics.SparseCategoricalAccuracy(name="acc")])
    return model


def _mirrored(model):
    return [v.path for v in model.variables + model.optimizer.variables
            if isinstance(v.value, distribute_values.DistributedVariable)]


class MirroredScopeTest(unittest.TestCase):

    def _script(self, mod, scope):
        """The guide's course: fit with validation and a checkpoint each
        epoch, evaluate, predict, reload the checkpoint in the scope and
        fit on, then a batch of its own."""
        keras.utils.set_random_seed(7)
        folder = tempfile.mkdtemp()
        data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
        out = {}
        with scope():
            model = _build(mod)
            out["fit"] = model.fit(
                data, epochs=2, verbose=0, validation_data=data.take(2),
                callbacks=[mod.callbacks.ModelCheckpoint(
                    os.path.join(folder, "c-{epoch}.keras"))]).history
            out["evaluate"] = model.evaluate(data, verbose=0)
            out["predict"] = model.predict(X[:40], verbose=0)
            loaded = mod.models.load_model(os.path.join(folder,
                                                        "c-2.keras"))
            out["refit"] = loaded.fit(data, epochs=1, verbose=0).history
            out["batch"] = loaded.train_on_batch(X[:16], Y[:16])
        out["weights"] = loaded.get_weights()
        return model, loaded, out

    def test_mirrored_scope_trains_under_the_search_as_one_device(self):
        strategy = tf.distribute.MirroredStrategy()
        self.assertGreater(strategy.num_replicas_in_sync, 1)
        _, _, expected = self._script(keras, contextlib.nullcontext)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, loaded, got = self._script(flexflow_keras,
                                              strategy.scope)
        said = [str(w.message) for w in caught]
        self.assertEqual([s for s in said if "plain Keras" in s], [])
        taken = [s for s in said if "tf.distribute.MirroredStrategy" in s]
        self.assertEqual(len(taken), 2, said)  # the model, the loaded one
        for each in (model, loaded):
            self.assertIsNotNone(each.strategy_executor)
            self.assertEqual(_mirrored(each), [])
            self.assertIsNone(each._distribute_strategy)
        for key in ("fit", "refit"):
            for name, values in expected[key].items():
                np.testing.assert_allclose(got[key][name], values,
                                           rtol=1e-5, err_msg=name)
        for key in ("evaluate", "predict", "batch"):
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-5,
                                       atol=1e-6, err_msg=key)
        for ours, plain in zip(got["weights"], expected["weights"]):
            np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-6)

    def test_model_built_outside_fitted_inside_the_scope(self):
        keras.utils.set_random_seed(7)
        plain = _build(keras)
        expected = plain.fit(X, Y, batch_size=16, epochs=2,
                             verbose=0).history
        keras.utils.set_random_seed(7)
        model = _build(flexflow_keras)
        with tf.distribute.MirroredStrategy().scope():
            got = model.fit(X, Y, batch_size=16, epochs=2,
                            verbose=0).history
        self.assertIsNotNone(model.strategy_executor)
        np.testing.assert_allclose(got["loss"], expected["loss"],
                                   rtol=1e-5)
        # The scope is the script's again once fit() returned.
        self.assertFalse(tf.distribute.has_strategy())

    def test_scope_is_the_scripts_again_after_each_call(self):
        strategy = tf.distribute.MirroredStrategy()
        with strategy.scope():
            model = _build(flexflow_keras)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.fit(X, Y, batch_size=32, epochs=1, verbose=0)
            self.assertIs(tf.distribute.get_strategy(), strategy)
            made = tf.Variable(1.0)
        self.assertIsInstance(made, distribute_values.MirroredVariable)

    def test_other_strategies_train_as_plain_keras_said_once(self):
        def run(mod):
            keras.utils.set_random_seed(7)
            with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
                model = _build(mod)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    history = model.fit(X, Y, batch_size=16, epochs=2,
                                        verbose=0).history
            return model, history, [str(w.message) for w in caught
                                    if "plain Keras" in str(w.message)]

        _, expected, _ = run(keras)
        model, history, said = run(flexflow_keras)
        self.assertEqual(len(said), 1, said)
        self.assertIn("tf.distribute.OneDeviceStrategy", said[0])
        self.assertIn("outside `strategy.scope()`", said[0])
        self.assertIsNone(model.strategy_executor)
        np.testing.assert_allclose(history["loss"], expected["loss"],
                                   rtol=1e-5)


if __name__ == "__main__":
    unittest.main()
