"""DLRM, FlexFlow's recommendation case study; only the import line differs from a plain Keras script.

8 embedding tables of 1,000,000 x 64, bottom MLP 512-512-64 and top
MLP 1024-1024-1024-1 on synthetic clicks (no download). The full tables
take 2 GB.
compile()/fit() search a strategy for the devices (or for the machine
named by `--machine`, e.g. `v100x4`) and train under it.

    python examples/dlrm.py [--small] [--epochs 1] [--budget 1000]
        [--export dlrm.pb | --import strategies/dlrm_v100x4.pb]

`--small` (8 tables of 1,000 x 16, narrow MLPs) runs in seconds on a CPU.
"""

import argparse

import numpy as np

import flexflow_keras as keras  # was: import keras
from flexflow_keras import layers

FULL = dict(tables=8, rows=1_000_000, dim=64, dense=64, bottom=(512, 512, 64),
            top=(1024, 1024, 1024, 1), batch=1024, samples=2048)
SMALL = dict(tables=8, rows=1000, dim=16, dense=16, bottom=(32, 16),
             top=(64, 1), batch=64, samples=256)


def build_model(small: bool = False) -> keras.Model:
    size = SMALL if small else FULL
    dense = keras.Input((size["dense"],), name="dense")
    x = dense
    for j, units in enumerate(size["bottom"]):
        x = layers.Dense(units, activation="relu", name=f"bottom_{j}")(x)
    features, sparse = [x], []
    for i in range(size["tables"]):
        ids = keras.Input((1,), dtype="int32", name=f"sparse_{i}")
        sparse.append(ids)
        e = layers.Embedding(size["rows"], size["dim"],
                             name=f"embedding_{i}")(ids)
        features.append(layers.Flatten(name=f"flatten_{i}")(e))
    x = layers.Concatenate(name="concat")(features)
    for j, units in enumerate(size["top"]):
        last = j == len(size["top"]) - 1
        x = layers.Dense(units, activation=None if last else "relu",
                         name=f"top_{j}")(x)
    return keras.Model([dense, *sparse], x, name="dlrm")


def make_data(samples: int, small: bool, seed: int = 0):
    size = SMALL if small else FULL
    rng = np.random.default_rng(seed)
    x = [rng.random((samples, size["dense"]), "float32")]
    x += [rng.integers(0, size["rows"], (samples, 1)).astype("int32")
          for _ in range(size["tables"])]
    return x, rng.integers(0, 2, (samples, 1)).astype("float32")


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
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.BinaryCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=batch, epochs=args.epochs, verbose=2)


if __name__ == "__main__":
    main()
