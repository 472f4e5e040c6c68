"""The models the runtime benches train, with their data and batch size.

Keras and NumPy only (no flexflow_keras), so `jax_dp_worker.py` can run
them on the JAX backend. The builders are `model_zoo.py`'s.
"""

import time

import keras
import numpy as np

import model_zoo

MODELS = {
    "mlp": (
        lambda: model_zoo.mlp(input_dim=256, hidden=(512, 512), classes=10),
        lambda n, r: (r.random((n, 256), dtype=np.float32),
                      r.integers(0, 10, (n,))),
        64,
    ),
    "cnn": (
        lambda: model_zoo.cnn((32, 32, 3), (16, 32), 10, dropout_rate=0.0),
        lambda n, r: (r.random((n, 32, 32, 3), dtype=np.float32),
                      r.integers(0, 10, (n,))),
        64,
    ),
    "transformer": (
        lambda: model_zoo.transformer_block(seq=32, dim=64, heads=4),
        lambda n, r: (r.random((n, 32, 64), dtype=np.float32),
                      r.random((n, 32, 64), dtype=np.float32)),
        32,
    ),
    # Recurrent loops: their time is not proportional to the batch
    # (cost.py's two-batch representatives).
    "lstm": (
        lambda: model_zoo.lstm_model(seq=50, features=32, units=256,
                                     classes=10),
        lambda n, r: (r.random((n, 50, 32), dtype=np.float32),
                      r.integers(0, 10, (n,))),
        64,
    ),
    # Transfer learning: a frozen convolutional base, a trainable head;
    # the step computes no gradient through the base (cost.py's
    # `_with_backward`).
    "frozen": (
        lambda: frozen_base_cnn((32, 32, 3), 10),
        lambda n, r: (r.random((n, 32, 32, 3), dtype=np.float32),
                      r.integers(0, 10, (n,))),
        64,
    ),
}


def frozen_base_cnn(shape, classes):
    """keras.io's transfer-learning shape: a frozen base of three
    convolutions, global pooling, a trainable Dense head."""
    base = keras.Sequential([
        keras.layers.Conv2D(32, 3, activation="relu", padding="same",
                            name="conv1"),
        keras.layers.Conv2D(64, 3, activation="relu", padding="same",
                            name="conv2"),
        keras.layers.MaxPooling2D(name="pool"),
        keras.layers.Conv2D(64, 3, activation="relu", padding="same",
                            name="conv3"),
    ], name="base")
    base.trainable = False
    inputs = keras.Input(shape, name="image")
    x = keras.layers.GlobalAveragePooling2D(name="gap")(base(inputs))
    x = keras.layers.Dense(128, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="frozen_base_cnn")


def loss_of(name):
    if name == "transformer":
        return "mse"
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Timer(keras.callbacks.Callback):
    """Seconds of each epoch."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)
