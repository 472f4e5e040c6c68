"""An ordinary Keras 3 Transformer-encoder script; only the import differs.

Sequence classification on synthetic token sequences: the label says
whether token 1 occurs more often than token 2 (needs attention over the
whole sequence; no download).

    python examples/transformer.py --budget 300
"""

import argparse

import numpy as np

import flexflow_keras as keras  # was: import keras
from flexflow_keras import layers

SEQ_LEN, VOCAB, DIM, HEADS = 32, 16, 32, 4


def make_tokens(samples: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(samples, SEQ_LEN)).astype("int32")
    y = ((x == 1).sum(axis=1) > (x == 2).sum(axis=1)).astype("int32")
    return x, y


def encoder_block(x):
    attended = layers.MultiHeadAttention(HEADS, DIM // HEADS)(x, x)
    x = layers.LayerNormalization()(layers.Add()([x, attended]))
    h = layers.Dense(4 * DIM, activation="relu")(x)
    h = layers.Dense(DIM)(h)
    return layers.LayerNormalization()(layers.Add()([x, h]))


def build_model() -> keras.Model:
    tokens = keras.Input(shape=(SEQ_LEN,), dtype="int32")
    x = layers.Embedding(VOCAB, DIM)(tokens)
    x = encoder_block(x)
    x = encoder_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(tokens, outputs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    x, y = make_tokens(4096, seed=0)
    x_test, y_test = make_tokens(1024, seed=1)
    model = build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
