"""Published scripts' own steps under a multi-device strategy, equal to
plain Keras (issue 21, item 4): each pattern made the model fail or fall
back to plain Keras before.

- keras.io's WGAN-GP: a custom `compile` with two optimizers, several
  discriminator updates per step (a tape opened after a deferred write got
  no gradients: `deferred.StepVariable` reads are recorded for tapes now),
  and a gradient penalty from an inner tape watching interpolated images
  (DTensor's second-order gradient through relayouts killed the process;
  layer calls inside a nested tape keep DTensor's layouts, and the shape
  ops of the penalty's gradient need a static batch: `ModelStepExecutor.
  _failed` retries with DTensor's replicated switch for a blamed op, then
  with the batch size written in).

Random values come from `keras.random` with seed generators, which draw
what plain Keras draws, so the values are compared.
"""

import unittest

import keras
import numpy as np
import tensorflow as tf

from test_own_step import SAMPLES, train_both


def build_wgan_gp(mod, gradient_penalty=True):
    def discriminator():
        return mod.Sequential([
            mod.Input((8, 8, 1)),
            mod.layers.Conv2D(4, 3, strides=2, padding="same"),
            mod.layers.LeakyReLU(0.2),
            mod.layers.Flatten(),
            mod.layers.Dense(1),
        ], name="discriminator")

    def generator():
        return mod.Sequential([
            mod.Input((4,)),
            mod.layers.Dense(4 * 4 * 4),
            mod.layers.LeakyReLU(0.2),
            mod.layers.Reshape((4, 4, 4)),
            mod.layers.UpSampling2D(),
            mod.layers.Conv2D(1, 3, padding="same", activation="tanh"),
        ], name="generator")

    class WGAN(mod.Model):
        def __init__(self):
            super().__init__()
            self.discriminator = discriminator()
            self.generator = generator()
            self.d_steps = 3
            self.gp_weight = 10.0
            self.seed_generator = keras.random.SeedGenerator(1)

        def compile(self, d_optimizer, g_optimizer):
            super().compile()
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

        def gradient_penalty(self, real, fake):
            batch = tf.shape(real)[0]
            alpha = keras.random.uniform((batch, 1, 1, 1),
                                         seed=self.seed_generator)
            interpolated = real + alpha * (fake - real)
            with tf.GradientTape() as gp_tape:
                gp_tape.watch(interpolated)
                pred = self.discriminator(interpolated, training=True)
            grads = gp_tape.gradient(pred, [interpolated])[0]
            norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
            return tf.reduce_mean((norm - 1.0) ** 2)

        def train_step(self, data):
            real = data[0] if isinstance(data, tuple) else data
            batch = tf.shape(real)[0]
            d_weights = self.discriminator.trainable_variables
            for _ in range(self.d_steps):
                noise = keras.random.normal((batch, 4),
                                            seed=self.seed_generator)
                with tf.GradientTape() as tape:
                    fake = self.generator(noise, training=True)
                    d_loss = tf.reduce_mean(
                        self.discriminator(fake, training=True)
                    ) - tf.reduce_mean(self.discriminator(real, training=True))
                    if gradient_penalty:
                        d_loss += self.gp_weight * self.gradient_penalty(
                            real, fake
                        )
                self.d_optimizer.apply_gradients(
                    zip(tape.gradient(d_loss, d_weights), d_weights)
                )
            noise = keras.random.normal((batch, 4), seed=self.seed_generator)
            g_weights = self.generator.trainable_variables
            with tf.GradientTape() as tape:
                g_loss = -tf.reduce_mean(self.discriminator(
                    self.generator(noise, training=True), training=True
                ))
            self.g_optimizer.apply_gradients(
                zip(tape.gradient(g_loss, g_weights), g_weights)
            )
            return {"d_loss": d_loss, "g_loss": g_loss}

    model = WGAN()
    model.compile(
        d_optimizer=keras.optimizers.Adam(2e-3, beta_1=0.5, beta_2=0.9),
        g_optimizer=keras.optimizers.Adam(2e-3, beta_1=0.5, beta_2=0.9),
    )
    x = np.random.default_rng(0).uniform(
        -1, 1, (SAMPLES, 8, 8, 1)).astype("float32")
    return model, (x, None)


class StepPatternsTest(unittest.TestCase):
    def test_wgan_several_discriminator_updates(self):
        train_both(self, "wgan", lambda mod: build_wgan_gp(mod, False))

    def test_wgan_gradient_penalty(self):
        train_both(self, "wgan_gp", build_wgan_gp)
