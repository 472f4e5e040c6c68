"""Scripts that train batch by batch (`train_on_batch`) run under a plan.

Such scripts never call fit(): the classic GAN (a discriminator compiled,
then frozen inside a combined model, the two trained in turn on batches
the script builds), and RL agents that train on replayed batches. They
trained as plain Keras on one device, unsaid, because only fit() planned.
`test_on_batch` and `predict_on_batch` must read the weights the user set
in between, as evaluate() and predict() do.
"""

import unittest

import keras
import numpy as np

import flexflow_keras as fk

from runtime_support import assert_executor_of_its_strategy

NOISE, FEATURES, HALF = 4, 12, 16


def _gan(mod):
    """(generator, discriminator, combined), as the classic GAN script
    builds them: the discriminator compiled before it is frozen."""
    generator = mod.Sequential([
        mod.Input((NOISE,)),
        mod.layers.Dense(8, activation="relu"),
        mod.layers.BatchNormalization(),
        mod.layers.Dense(FEATURES),
    ])
    discriminator = mod.Sequential([
        mod.Input((FEATURES,)),
        mod.layers.Dense(8),
        mod.layers.LeakyReLU(0.2),
        mod.layers.Dropout(0.25),
        mod.layers.Dense(1, activation="sigmoid"),
    ])
    discriminator.compile(optimizer=mod.optimizers.Adam(0.01),
                          loss="binary_crossentropy", metrics=["accuracy"])
    discriminator.trainable = False
    noise = mod.Input((NOISE,))
    combined = mod.Model(noise, discriminator(generator(noise)))
    combined.compile(optimizer=mod.optimizers.Adam(0.01),
                     loss="binary_crossentropy")
    return generator, discriminator, combined


def _train(mod, steps=4):
    """Alternating steps; returns (models, every loss and read-out)."""
    keras.utils.set_random_seed(7)
    generator, discriminator, combined = _gan(mod)
    rng = np.random.default_rng(1)
    real = rng.normal(size=(steps * HALF, FEATURES)).astype("float32")
    labels = np.concatenate([np.ones((HALF, 1)), np.zeros((HALF, 1))])
    out = []
    for step in range(steps):
        fake = generator.predict(
            rng.normal(size=(HALF, NOISE)).astype("float32"), verbose=0)
        batch = np.concatenate([real[step * HALF:(step + 1) * HALF], fake])
        # Keras 3 reads `trainable` when it first traces a step: each
        # model's first call fixes what it trains.
        discriminator.trainable = True
        out.append(discriminator.train_on_batch(batch, labels))
        discriminator.trainable = False
        out.append(combined.train_on_batch(
            rng.normal(size=(HALF, NOISE)).astype("float32"),
            np.ones((HALF, 1))))
    # Weights set by the user between steps: what the next calls read.
    discriminator.set_weights(
        [w * 0.5 for w in discriminator.get_weights()])
    out.append(discriminator.test_on_batch(batch, labels))
    out.append(discriminator.predict_on_batch(batch))
    return (generator, discriminator, combined), out


class TrainOnBatchTest(unittest.TestCase):
    def test_classic_gan_trains_under_its_plans(self):
        plain_models, plain = _train(keras)
        ours_models, ours = _train(fk)
        for a, b in zip(plain, ours):
            np.testing.assert_allclose(np.ravel(b), np.ravel(a),
                                       rtol=1e-5, atol=1e-6)
        for a, b in zip(plain_models, ours_models):
            for wa, wb in zip(a.get_weights(), b.get_weights()):
                np.testing.assert_allclose(wb, wa, rtol=1e-5, atol=1e-6)
        _, discriminator, combined = ours_models
        for model, batch in ((discriminator, 2 * HALF), (combined, HALF)):
            assert_executor_of_its_strategy(self, model)
            self.assertEqual(model.plan.graph.batch_size, batch)
            devices = {d for c in model.strategy.values()
                       for d in c.device_ids}
            self.assertGreater(len(devices), 1, model.name)

    def test_later_batches_of_another_size_keep_the_plan(self):
        keras.utils.set_random_seed(3)
        model = fk.Sequential([fk.Input((FEATURES,)),
                               fk.layers.Dense(8, activation="relu"),
                               fk.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(40, FEATURES)).astype("float32")
        reference = keras.models.clone_model(model)
        reference.set_weights(model.get_weights())
        reference.compile(optimizer="sgd", loss="mse")
        for rows in (slice(0, 16), slice(16, 32), slice(32, 40)):
            got = model.train_on_batch(x[rows], x[rows, :1])
            want = reference.train_on_batch(x[rows], x[rows, :1])
            np.testing.assert_allclose(got, want, rtol=1e-5)
        self.assertEqual(model.plan.graph.batch_size, 16)
        assert_executor_of_its_strategy(self, model)
        for a, b in zip(reference.get_weights(), model.get_weights()):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


if __name__ == "__main__":
    unittest.main()
