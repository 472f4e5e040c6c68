"""A 6-layer Transformer encoder (d=1024) language model; only the import line differs from a plain Keras script.

Synthetic token sequences (vocabulary 32,000, length 128; no download);
the target is the next token.
compile()/fit() search a strategy for the devices (or for the machine
named by `--machine`, e.g. `p100x16`) and train under it.

    python examples/transformer_encoder.py [--small] [--epochs 1] [--budget 1000]
        [--export transformer_encoder.pb | --import strategies/transformer_encoder_p100x16.pb]

`--small` (2 layers, d=32, vocabulary 1,000, length 16) runs in seconds on a CPU.
"""

import argparse

import numpy as np

import flexflow_keras as keras  # was: import keras
from flexflow_keras import layers

FULL = dict(vocab=32000, seq=128, dim=1024, heads=16, ff=4096, layers=6,
            batch=256, samples=512)
SMALL = dict(vocab=1000, seq=16, dim=32, heads=4, ff=64, layers=2,
             batch=32, samples=128)


def build_model(small: bool = False) -> keras.Model:
    size = SMALL if small else FULL
    tokens = keras.Input((size["seq"],), dtype="int32", name="tokens")
    x = layers.Embedding(size["vocab"], size["dim"], name="embed")(tokens)
    for i in range(size["layers"]):
        a = layers.MultiHeadAttention(
            size["heads"], size["dim"] // size["heads"], name=f"attn_{i}"
        )(x, x)
        x = layers.LayerNormalization(name=f"ln1_{i}")(
            layers.Add(name=f"res1_{i}")([x, a]))
        h = layers.Dense(size["ff"], activation="relu", name=f"ff1_{i}")(x)
        h = layers.Dense(size["dim"], name=f"ff2_{i}")(h)
        x = layers.LayerNormalization(name=f"ln2_{i}")(
            layers.Add(name=f"res2_{i}")([x, h]))
    outputs = layers.Dense(size["vocab"], name="logits")(x)
    return keras.Model(tokens, outputs, name="transformer")


def make_data(samples: int, small: bool, seed: int = 0):
    size = SMALL if small else FULL
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, size["vocab"], (samples, size["seq"] + 1))
    return stream[:, :-1].astype("int32"), stream[:, 1:]


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
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=batch, epochs=args.epochs, verbose=2)


if __name__ == "__main__":
    main()
