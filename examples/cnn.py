"""An ordinary Keras 3 CNN script; only the import line differs.

Classifies synthetic 16x16 images whose class is the quadrant holding a
bright blob (learnable, no download). compile() searches a strategy over
the devices; fit() trains under it.

    python examples/cnn.py --budget 300
"""

import argparse

import numpy as np

import flexflow_keras as keras  # was: import keras
from flexflow_keras import layers


def make_images(samples: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(scale=0.3, size=(samples, 16, 16, 1)).astype("float32")
    y = rng.integers(0, 4, size=samples)
    for i, label in enumerate(y):
        row, col = divmod(int(label), 2)
        r = row * 8 + rng.integers(1, 5)
        c = col * 8 + rng.integers(1, 5)
        x[i, r:r + 3, c:c + 3, 0] += 2.0
    return x, y


def build_model() -> keras.Model:
    inputs = keras.Input(shape=(16, 16, 1))
    h = layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    h = layers.BatchNormalization()(h)
    h = layers.MaxPooling2D()(h)
    h = layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = layers.MaxPooling2D()(h)
    h = layers.Flatten()(h)
    h = layers.Dropout(0.2)(h)
    h = layers.Dense(64, activation="relu")(h)
    outputs = layers.Dense(4, activation="softmax")(h)
    return keras.Model(inputs, outputs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    x, y = make_images(2048, seed=0)
    x_test, y_test = make_images(512, seed=1)
    model = build_model()
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
