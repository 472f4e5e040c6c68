"""AlexNet, as in FlexFlow's evaluation (MLSys'19, Table 3); only the
import line differs from a plain Keras script.

Synthetic ImageNet-shaped data (224x224x3, 1000 classes; no download).
compile() searches a strategy for the devices (or the machine given by
`--machine`, e.g. `p100x16`); fit() trains under it.

    python examples/alexnet.py [--small] [--epochs 1] [--budget 1000]
        [--export alexnet.pb | --import strategies/alexnet_p100x16.pb]

`--small` (64x64 images, 10 classes, narrower layers) runs in seconds on
a CPU.
"""

import argparse

import numpy as np

import flexflow_keras as keras  # was: import keras
from flexflow_keras import layers

FULL = dict(image=224, classes=1000, width=1, fc=4096, batch=256, samples=512)
SMALL = dict(image=64, classes=10, width=8, fc=256, batch=32, samples=128)


def build_model(small: bool = False) -> keras.Model:
    size = SMALL if small else FULL
    w = size["width"]
    inputs = keras.Input((size["image"], size["image"], 3), name="image")
    x = layers.Conv2D(64 // w, 11, 4, padding="same", activation="relu",
                      name="conv1")(inputs)
    x = layers.MaxPooling2D(3, 2, name="pool1")(x)
    x = layers.Conv2D(192 // w, 5, padding="same", activation="relu",
                      name="conv2")(x)
    x = layers.MaxPooling2D(3, 2, name="pool2")(x)
    for i, filters in enumerate((384, 256, 256)):
        x = layers.Conv2D(filters // w, 3, padding="same",
                          activation="relu", name=f"conv{i + 3}")(x)
    x = layers.MaxPooling2D(3, 2, name="pool5")(x)
    x = layers.Flatten(name="flatten")(x)
    for i in (6, 7):
        x = layers.Dense(size["fc"], activation="relu", name=f"fc{i}")(x)
    outputs = layers.Dense(size["classes"], activation="softmax",
                           name="fc8")(x)
    return keras.Model(inputs, outputs, name="alexnet")


def make_data(samples: int, small: bool, seed: int = 0):
    size = SMALL if small else FULL
    rng = np.random.default_rng(seed)
    x = rng.random((samples, size["image"], size["image"], 3), "float32")
    y = rng.integers(0, size["classes"], samples)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None)
    args = parser.parse_args()
    size = SMALL if args.small else FULL
    batch = args.batch_size or size["batch"]
    x, y = make_data(args.samples or size["samples"], args.small)
    model = build_model(args.small)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=batch, epochs=args.epochs, verbose=2)


if __name__ == "__main__":
    main()
