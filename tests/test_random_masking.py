"""A masked autoencoder's own steps, which sort random draws to pick the
tokens they hide, train and evaluate under their strategy, equal to
plain Keras.

keras.io's masked image modeling (MAE) draws `tf.random.uniform` per
patch, takes `tf.argsort` of it, and gathers the unmasked patches
(`tf.gather(..., batch_dims=1)`) into an encoder built on
`keras.Input((None, dim))`. Its first `evaluate` failed in DTensor
("SPMD expansion resulted in op output inconsistent with the provided
layout. Expected shape: <512,64> got shape: <256,64>") and the model
ran as plain Keras from then on: `tf.argsort` calls TensorFlow's
`nn_ops.top_k`, which DTensor laid out with its values whole and its
indices split along the batch (as the gather wanted them), an output
pair its TopKV2 rule cannot expand. `tf.math.top_k` already ran whole
on every device (`op_rules.whole_on`); `nn_ops.top_k`, behind
`tf.sort` and `tf.argsort`, now does too.
"""

import os
import tempfile
import unittest
from unittest import mock

import numpy as np
import tensorflow as tf

from runtime_support import (
    assert_own_step_under_strategy, relative_error, train_plain_and_ours,
)

PATCHES, AREA, DIM, HIDDEN = 12, 6, 16, 32
KEPT = 8  # patches the encoder sees; the loss is on the other 4
ROWS, BATCH = 48, 16


def build(mod, import_strategy=None, loss_on="hidden"):
    """MAE, small. `loss_on`: "hidden" (MAE's loss: the patches the
    encoder did not see) or "all" (every patch rebuilt: then the sorted
    indices feed only the encoder's gather, the case DTensor failed)."""
    layers = mod.layers

    class RandomMasking(layers.Layer):
        """MAE's patch encoder: projects patches, keeps a random
        `KEPT` of them (argsort of uniform draws) for the encoder."""

        def build(self, input_shape):
            self.projection = layers.Dense(DIM, name="projection")

        def call(self, patches):
            batch = tf.shape(patches)[0]
            order = tf.argsort(tf.random.uniform((batch, PATCHES)), axis=-1)
            kept, hidden = order[:, :KEPT], order[:, KEPT:]
            embedded = self.projection(patches)
            return (tf.gather(embedded, kept, axis=1, batch_dims=1),
                    hidden)

    tokens = mod.Input((None, DIM))  # as MAE's encoder: any length
    x = layers.LayerNormalization(name="norm")(tokens)
    x = layers.Dense(HIDDEN, activation="gelu", name="widen")(x)
    x = layers.Dropout(0.1, name="drop")(x)
    x = layers.Dense(DIM, name="narrow")(x)
    encoder = mod.Model(tokens, layers.Add(name="skip")([x, tokens]),
                        name="encoder")
    given = mod.Input((KEPT, DIM))
    decoded = layers.Dense(PATCHES * AREA, name="decode")(
        layers.Flatten(name="flat")(given))
    decoder = mod.Model(
        given, layers.Reshape((PATCHES, AREA), name="unflat")(decoded),
        name="decoder")

    class MaskedAutoencoder(mod.Model):
        def __init__(self):
            super().__init__()
            self.masking = RandomMasking()
            self.encoder, self.decoder = encoder, decoder

        def losses_of(self, patches):
            kept, hidden = self.masking(patches)
            rebuilt = self.decoder(self.encoder(kept))
            if loss_on == "all":
                return self.compute_loss(y=patches, y_pred=rebuilt), \
                    patches, rebuilt
            target = tf.gather(patches, hidden, axis=1, batch_dims=1)
            guess = tf.gather(rebuilt, hidden, axis=1, batch_dims=1)
            return self.compute_loss(y=target, y_pred=guess), target, guess

        def train_step(self, patches):
            with tf.GradientTape() as tape:
                loss, target, guess = self.losses_of(patches)
            variables = self.trainable_variables
            self.optimizer.apply_gradients(
                zip(tape.gradient(loss, variables), variables))
            return self.tracked(target, guess)

        def test_step(self, patches):
            _, target, guess = self.losses_of(patches)
            return self.tracked(target, guess)

        def tracked(self, target, guess):
            for metric in self.metrics:
                metric.update_state(target, guess)
            return {metric.name: metric.result() for metric in self.metrics}

    model = MaskedAutoencoder()
    options = {} if import_strategy is None else {
        "import_strategy": import_strategy}
    model.compile(optimizer=mod.optimizers.Adam(1e-2), loss="mse",
                  metrics=["mae"], **options)
    return model


def patches(seed):
    rows = np.random.default_rng(seed).random((ROWS, PATCHES, AREA))
    return tf.data.Dataset.from_tensor_slices(
        rows.astype("float32")).batch(BATCH)


def train(model):
    history = model.fit(patches(0), epochs=2, verbose=0).history
    return history, model.evaluate(patches(1), verbose=0)


# The encoder's widening Dense split along its output channels, the rest
# along the batch: the kind of plan the search chose for keras.io's MAE.
CHANNELS = "\n".join([
    "[norm] num_dims(3) dims[4,1,1] device_ids[0,1,2,3]",
    "[widen] num_dims(3) dims[1,1,4] device_ids[0,1,2,3]",
    "[drop] num_dims(3) dims[4,1,1] device_ids[0,1,2,3]",
    "[narrow] num_dims(3) dims[4,1,1] device_ids[0,1,2,3]",
    "[skip] num_dims(3) dims[4,1,1] device_ids[0,1,2,3]",
    "[flat] num_dims(2) dims[4,1] device_ids[0,1,2,3]",
    "[decode] num_dims(2) dims[4,1] device_ids[0,1,2,3]",
    "[unflat] num_dims(3) dims[4,1,1] device_ids[0,1,2,3]",
]) + "\n"


class RandomMaskingTest(unittest.TestCase):
    def check(self, runs):
        assert_own_step_under_strategy(self, runs)
        (plain, (history, evaluated), _) = runs["plain"]
        (ours, (got_history, got_evaluated), _) = runs["ours"]
        for key, values in history.items():
            np.testing.assert_allclose(got_history[key], values, rtol=1e-5,
                                       err_msg=key)
        np.testing.assert_allclose(got_evaluated, evaluated, rtol=1e-5)
        # Per weight, as a whole (`relative_error`): Adam moves a weight
        # of near-zero gradient by its rounding noise.
        for weight, a, b in zip(plain.weights, plain.get_weights(),
                                ours.get_weights()):
            self.assertLess(relative_error(b, a), 1e-5, msg=weight.path)

    def test_searched(self):
        for loss_on in ("hidden", "all"):
            with self.subTest(loss_on=loss_on):
                self.check(train_plain_and_ours(
                    lambda mod: build(mod, loss_on=loss_on), 5, train))

    def test_channels_split(self):
        import keras

        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "channels.txt")
            with open(path, "w") as f:
                f.write(CHANNELS)
            self.check(train_plain_and_ours(
                lambda mod: build(mod, path if mod is not keras else None,
                                  loss_on="all"), 5, train))


    def test_plain_keras_after_a_failed_first_test_step_draws_as_keras(self):
        """A first test step DTensor cannot run hands evaluate to Keras's
        own test function (`fallback`). Keras traced it anew for the
        dataset's iterator after the failed batch, and the new trace's
        `tf.random` kernel drew the second batch's masks from the start
        of its stream again: evaluate's loss and MAE 0.5% and 0.8% off
        plain Keras's, under a warning that said the results were plain
        Keras's."""
        from flexflow_keras.runtime import model_step

        run = model_step.ModelStepExecutor.run

        def failing_first_test_step(executor, kind, data):
            if kind == "test" and not executor.__dict__.get("_spoiled"):
                executor._spoiled = True
                executor._last_key = None  # as `run` starts a step
                raise tf.errors.UnknownError(
                    None, None, "spoiled on purpose [[{{node test}}]]")
            return run(executor, kind, data)

        with mock.patch.object(model_step.ModelStepExecutor, "run",
                               failing_first_test_step):
            runs = train_plain_and_ours(build, 5, train)
        told = [m for m in runs["ours"][2] if "plain Keras" in m]
        self.assertEqual(len(told), 1, told)
        self.assertIn("first test step", told[0])
        np.testing.assert_allclose(runs["ours"][1][1], runs["plain"][1][1],
                                   rtol=1e-5)


if __name__ == "__main__":
    unittest.main()
