"""A Keras 3 script with its own training step; only the import differs.

As in the Keras guide "Customizing what happens in `fit()`" (TensorFlow
backend): a functional model whose class overrides `train_step` (a
`GradientTape` step with its own loss, metrics and an L2 penalty of its
own) and `test_step`. With flexflow_keras, compile() searches a
strategy and fit() runs *this* step under it, on 4 virtual CPUs without
a GPU. Synthetic data: a fixed random teacher network labels Gaussian
inputs, so nothing is downloaded.

    python examples/custom_train_step.py --budget 200
"""

import argparse

import numpy as np
import tensorflow as tf

import flexflow_keras as keras  # was: import keras
from flexflow_keras import layers


class CustomModel(keras.Model):
    def __init__(self, *args, penalty=1e-4, **kwargs):
        super().__init__(*args, **kwargs)
        self.penalty = penalty
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(
            name="accuracy"
        )
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
            # A penalty the compiled loss does not know about.
            loss += self.penalty * tf.add_n(
                [tf.reduce_sum(tf.square(w)) for w in self.trainable_weights
                 if "kernel" in w.path]
            )
        gradients = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
        self.loss_tracker.update_state(loss)
        self.accuracy.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(),
                "accuracy": self.accuracy.result()}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.loss_tracker.update_state(self.loss_fn(y, y_pred))
        self.accuracy.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(),
                "accuracy": self.accuracy.result()}

    @property
    def metrics(self):
        # Listed so that Keras resets them at the start of each epoch.
        return [self.loss_tracker, self.accuracy]


def make_data(samples: int, features: int, classes: int, seed: int):
    teacher = np.random.default_rng(1234).normal(size=(features, classes))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = np.argmax(np.tanh(x) @ teacher, axis=1)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    x, y = make_data(4096, 32, 10, seed=0)
    x_test, y_test = make_data(1024, 32, 10, seed=1)
    inputs = keras.Input(shape=(32,))
    h = layers.Dense(128, activation="relu")(inputs)
    h = layers.Dense(128, activation="relu")(h)
    outputs = layers.Dense(10, activation="softmax")(h)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
              verbose=2)
    results = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    print(f"test loss {results['loss']:.4f}  "
          f"test accuracy {results['accuracy']:.4f}")


if __name__ == "__main__":
    main()
