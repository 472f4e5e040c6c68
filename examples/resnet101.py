"""ResNet-101 (`keras.applications`, `weights=None`), as in FlexFlow's evaluation; only the import line differs from a plain Keras script.

Synthetic ImageNet-shaped data (224x224x3, 1000 classes; no download).
compile()/fit() search a strategy for the devices (or for the machine
named by `--machine`, e.g. `p100x16`) and train under it.

    python examples/resnet101.py [--small] [--epochs 1] [--budget 1000]
        [--export resnet101.pb | --import strategies/resnet101_p100x16.pb]

`--small` (32x32 images, 10 classes) runs in seconds on a CPU.
"""

import argparse

import numpy as np

import flexflow_keras as keras  # was: import keras

FULL = dict(image=224, classes=1000, batch=64, samples=128)
SMALL = dict(image=32, classes=10, batch=16, samples=32)


def build_model(small: bool = False) -> keras.Model:
    size = SMALL if small else FULL
    return keras.applications.ResNet101(
        weights=None, input_shape=(size["image"], size["image"], 3),
        classes=size["classes"],
    )


def make_data(samples: int, small: bool, seed: int = 0):
    size = SMALL if small else FULL
    rng = np.random.default_rng(seed)
    x = rng.random((samples, size["image"], size["image"], 3), "float32")
    return x, rng.integers(0, size["classes"], samples)


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
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=batch, epochs=args.epochs, verbose=2)


if __name__ == "__main__":
    main()
