"""A bidirectional LSTM text classifier, as in the Keras example; only the
import differs.

As in keras.io/examples/nlp/bidirectional_lstm_imdb: integer token
sequences of any length (`keras.Input(shape=(None,))`), an `Embedding`
with `mask_zero=True` so padding is skipped, two stacked
`Bidirectional(LSTM)` layers and a sigmoid. The IMDB reviews are replaced
by synthetic ones (nothing is downloaded): a review is positive when it
holds more "good" than "bad" tokens, padded at the end to a fixed
length. With flexflow_keras, fit() trains under a searched strategy on 4
virtual CPUs without a GPU.

    python examples/bidirectional_lstm.py --budget 200
"""

import argparse

import numpy as np

import flexflow_keras as keras  # was: import keras
from flexflow_keras import layers

MAX_FEATURES = 200  # vocabulary size
MAXLEN = 24  # tokens per review (padded)
GOOD, BAD = range(2, 12), range(12, 22)


def make_reviews(samples: int, seed: int):
    rng = np.random.default_rng(seed)
    x = np.zeros((samples, MAXLEN), dtype="int32")
    y = np.zeros((samples,), dtype="float32")
    for i in range(samples):
        length = rng.integers(8, MAXLEN + 1)
        tokens = rng.integers(22, MAX_FEATURES, length)
        good, bad = rng.integers(0, 4, 2)
        spots = rng.choice(length, good + bad, replace=False)
        tokens[spots[:good]] = rng.choice(GOOD, good)
        tokens[spots[good:]] = rng.choice(BAD, bad)
        x[i, :length] = tokens  # 0 pads the end
        y[i] = float(good > bad)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    x_train, y_train = make_reviews(2048, seed=0)
    x_val, y_val = make_reviews(512, seed=1)

    inputs = keras.Input(shape=(None,), dtype="int32")
    x = layers.Embedding(MAX_FEATURES, 32, mask_zero=True)(inputs)
    x = layers.Bidirectional(layers.LSTM(16, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(16))(x)
    outputs = layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="binary_crossentropy",
                  metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=args.batch_size,
              epochs=args.epochs, validation_data=(x_val, y_val), verbose=2)
    loss, accuracy = model.evaluate(x_val, y_val, verbose=0)
    print(f"test loss {loss:.4f}  test accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
