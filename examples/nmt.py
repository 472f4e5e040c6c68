"""NMT, FlexFlow's translation model (LSTM encoder-decoder with attention); only the import line differs from a plain Keras script.

Synthetic sentence pairs (vocabulary 32,000, length 40; no download):
2 encoder and 2 decoder LSTM layers, dot-product attention over the
encoder states, and a softmax over the target vocabulary.
compile()/fit() search a strategy for the devices (or for the machine
named by `--machine`, e.g. `p100x16`) and train under it.

    python examples/nmt.py [--small] [--epochs 1] [--budget 1000]
        [--export nmt.pb | --import strategies/nmt_p100x16.pb]

`--small` (vocabulary 1,000, length 10, width 32) runs in seconds on a CPU.
"""

import argparse

import numpy as np

import flexflow_keras as keras  # was: import keras
from flexflow_keras import layers

FULL = dict(vocab=32000, seq=40, units=1024, batch=64, samples=256)
SMALL = dict(vocab=1000, seq=10, units=32, batch=32, samples=128)


def build_model(small: bool = False) -> keras.Model:
    size = SMALL if small else FULL
    source = keras.Input((size["seq"],), dtype="int32", name="source")
    target = keras.Input((size["seq"],), dtype="int32", name="target_in")
    enc = layers.Embedding(size["vocab"], size["units"],
                           name="source_embed")(source)
    for i in range(2):
        enc = layers.LSTM(size["units"], return_sequences=True,
                          name=f"encoder_{i}")(enc)
    dec = layers.Embedding(size["vocab"], size["units"],
                           name="target_embed")(target)
    for i in range(2):
        dec = layers.LSTM(size["units"], return_sequences=True,
                          name=f"decoder_{i}")(dec)
    context = layers.Attention(name="attention")([dec, enc])
    x = layers.Concatenate(name="attend")([dec, context])
    outputs = layers.Dense(size["vocab"], activation="softmax",
                           name="softmax")(x)
    return keras.Model([source, target], outputs, name="nmt")


def make_data(samples: int, small: bool, seed: int = 0):
    size = SMALL if small else FULL
    rng = np.random.default_rng(seed)
    source = rng.integers(0, size["vocab"], (samples, size["seq"]))
    target = rng.integers(0, size["vocab"], (samples, size["seq"] + 1))
    x = (source.astype("int32"), target[:, :-1].astype("int32"))
    return x, target[:, 1:]


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
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=batch, epochs=args.epochs, verbose=2)


if __name__ == "__main__":
    main()
