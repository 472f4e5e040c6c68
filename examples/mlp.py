"""An ordinary Keras 3 script; only the import line differs.

Trains an MLP classifier on synthetic data (a fixed random teacher network
labels Gaussian inputs, so the task is learnable and needs no download).
With flexflow_keras, compile() searches a parallel strategy over the
devices (4 virtual CPUs without a GPU) and fit() trains under it.

    python examples/mlp.py --budget 500 --export strategies/mlp.txt
"""

import argparse

import numpy as np

import flexflow_keras as keras  # was: import keras
from flexflow_keras import layers


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

    x, y = make_data(4096, 64, 10, seed=0)
    x_test, y_test = make_data(1024, 64, 10, seed=1)  # unseen samples
    inputs = keras.Input(shape=(64,))
    h = layers.Dense(256, activation="relu")(inputs)
    h = layers.Dense(256, activation="relu")(h)
    outputs = layers.Dense(10, activation="softmax")(h)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(
        x, y, batch_size=args.batch_size, epochs=args.epochs,
        validation_split=0.1, verbose=2,
    )
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
