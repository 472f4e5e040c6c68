"""A training loop of the user's own is said once per model, and nothing
the package runs itself is taken for one (`flexflow_keras/own_loops.py`).

keras.io's "Writing a training loop from scratch" trains by
`model(x, training=True)` under a `tf.GradientTape` and `optimizer.apply`:
nothing of the package is involved, and with only the import changed it
ran as plain Keras on one device without a word.
"""

import unittest
import warnings

import keras
import numpy as np
import tensorflow as tf

import flexflow_keras as fk

ROWS, BATCH = 64, 16


def loop_warnings(caught):
    return [str(w.message) for w in caught
            if "GradientTape" in str(w.message)]


def data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(ROWS, 8)).astype("float32"),
            rng.normal(size=(ROWS, 2)).astype("float32"))


def mlp(mod, name):
    inputs = mod.Input((8,))
    hidden = mod.layers.Dense(16, activation="relu")(inputs)
    return mod.Model(inputs, mod.layers.Dense(2)(hidden), name=name)


def train_by_own_loop(model, traced):
    """The guide's loop, eager or in a `tf.function`; returns the losses."""
    optimizer = keras.optimizers.Adam()
    x, y = data()

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply(grads, model.trainable_weights)
        return loss

    step = tf.function(step) if traced else step
    return [float(step(x[i:i + BATCH], y[i:i + BATCH]))
            for i in range(0, ROWS, BATCH)]


class OwnLoopsTest(unittest.TestCase):
    def test_own_loop_is_said_once_and_trains_as_keras(self):
        for traced in (False, True):
            with self.subTest(traced=traced):
                keras.utils.set_random_seed(3)
                plain = train_by_own_loop(mlp(keras, "loop"), traced)
                keras.utils.set_random_seed(3)
                model = mlp(fk, "loop")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    ours = train_by_own_loop(model, traced)
                    train_by_own_loop(model, traced)  # said once
                said = loop_warnings(caught)
                self.assertEqual(len(said), 1, said)
                self.assertIn("Model 'loop'", said[0])
                self.assertIn("train_step", said[0])
                np.testing.assert_allclose(ours, plain, rtol=1e-6)

    def test_our_model_in_a_plain_keras_models_step_names_that_model(self):
        """A plain Keras model (one a script built from `import keras`, or
        from another library) whose own step calls ours under a tape: the
        notice names the outer model and its class as the cause, not a
        loop of the user's own, and fit trains as plain Keras would."""

        def build(mod):
            inner = mlp(mod, "inner")

            class Outer(keras.Model):
                def __init__(self):
                    super().__init__(name="outer")
                    self.inner = inner

                def call(self, x):
                    return self.inner(x)

                def train_step(self, data):
                    x, y = data
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_mean(
                            tf.square(self(x, training=True) - y))
                    grads = tape.gradient(loss, self.trainable_weights)
                    self.optimizer.apply(grads, self.trainable_weights)
                    return {"loss": loss}

            outer = Outer()
            outer.compile(optimizer="adam")
            return outer

        import runtime_support

        x, y = data()
        runs = runtime_support.train_plain_and_ours(
            build, 5, lambda outer: outer.fit(
                x, y, batch_size=BATCH, epochs=2, shuffle=False,
                verbose=0).history["loss"])
        messages = runs["ours"][2]
        said = [m for m in messages if "GradientTape" in m]
        self.assertEqual(len(said), 0, said)
        said = [m for m in messages if "plain Keras model" in m]
        self.assertEqual(len(said), 1, said)
        self.assertIn("Model 'inner'", said[0])
        self.assertIn("'outer' is a plain Keras model", said[0])
        self.assertIn("Outer derives from Keras's Model", said[0])
        np.testing.assert_allclose(runs["ours"][1], runs["plain"][1],
                                   rtol=1e-6)

    def test_autograph_leaves_the_package_as_written(self):
        """A loop in a `tf.function` calls our model as it calls a Keras
        one, unconverted: before, AutoGraph converted our `__call__` and
        what it called, the notice came from its generated file, and
        (where Python formats warnings, not under `catch_warnings`)
        TensorFlow logged "AutoGraph could not transform" for Python's
        warning formatter."""
        from tensorflow.python.autograph.impl import api

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_by_own_loop(mlp(fk, "converted"), traced=True)
        said = [w for w in caught if "GradientTape" in str(w.message)]
        self.assertEqual(len(said), 1, [str(w.message) for w in caught])
        self.assertNotIn("__autograph_generated", said[0].filename)
        self.assertTrue(api.conversion.is_allowlisted(fk.Model.__call__))

    def test_fit_and_own_steps_are_not_taken_for_a_loop(self):
        # compile() searches and probes, fit() traces the model's step,
        # and a GAN-like step calls its sub-models under tapes: none is
        # a loop of the user's own. A call outside them still is.
        class TwoTowers(fk.Model):
            def __init__(self):
                super().__init__()
                self.first = mlp(fk, "first")
                self.second = mlp(fk, "second")

            def call(self, x):
                return self.first(x)

            def train_step(self, data):
                x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(
                        tf.square(self.second(self.first(x)[:, :1] * x) - y))
                weights = self.trainable_weights
                self.optimizer.apply(tape.gradient(loss, weights), weights)
                return {"loss": loss}

        x, y = data()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = TwoTowers()
            model.compile(optimizer="adam", loss="mse", search_budget=20)
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
            model.evaluate(x, y, batch_size=BATCH, verbose=0)
            model.predict(x, batch_size=BATCH, verbose=0)
            model.train_on_batch(x[:BATCH], y[:BATCH])
            model(x)  # no tape: inference
            self.assertEqual(loop_warnings(caught), [])
            with tf.GradientTape():
                model.first(x)
        said = loop_warnings(caught)
        self.assertEqual(len(said), 1, said)
        self.assertIn("Model 'first'", said[0])


if __name__ == "__main__":
    unittest.main()
