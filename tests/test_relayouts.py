"""Relayouts that move a mesh axis between two inner dims compute what
plain Keras computes.

DTensor's all-to-all relayout (TensorFlow 2.21) returns wrong values,
with no error, where a rank-4 tensor's mesh axis moves between two dims
neither of which is the batch dim (`[*, *, *, a1]` to `[*, a1, *, *]`),
forward and in the gradient. A random feature combination found it: a
strategy on a 2 x 2 mesh that splits an image's channels in a Dense and
its rows in the Add after it trained equal to plain Keras on full
batches, but not on a partial last batch (the batch dim then runs whole,
and the move becomes one of those); another, whose pooling splits its
output's channels after a LayerNormalization that split rows, trained to
other weights from its first step (the gradient's move). The package
turns the all-to-all off (`settings.all_gather_relayouts`); with
`DTENSOR_USE_ALL_TO_ALL_RELAYOUT=1` set by hand, every move below and
both strategies fail.
"""

import os
import tempfile
import unittest

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

import flexflow_keras  # noqa: F401  (makes the test devices)
from flexflow_keras import settings
from flexflow_keras.devices import device_names
from flexflow_keras.strategy import ParallelConfig, Strategy
from flexflow_keras.strategy_files import save_strategy
from runtime_support import (
    NUM_DEVICES, assert_own_step_under_strategy,
    assert_same_fit_evaluate_predict, train_plain_and_ours,
)

U = dtensor.UNSHARDED

# (source, target) layouts of a rank-4 tensor on a 2 x 2 mesh whose
# direct move DTensor's all-to-all got wrong (values off by up to 10).
WRONG_BY_ALL_TO_ALL = [
    ((U, U, U, "a1"), (U, "a1", U, U)),
    ((U, U, "a1", U), (U, "a1", U, U)),
    (("a0", "a1", U, U), ("a0", U, U, "a1")),
    ((U, "a1", U, U), (U, U, U, "a1")),
]


# Op name -> config on the 4 test devices, as a 2 x 2 mesh.
CHANNELS_THEN_ROWS = {  # a partial batch moves channels to rows
    "conv": ParallelConfig((2, 1, 1, 1), (0, 1)),
    "drop": ParallelConfig((2, 1, 1, 1), (0, 1)),
    "bn": ParallelConfig((2, 1, 1, 1), (0, 1)),
    "ln": ParallelConfig((2, 1, 1, 1), (0, 1)),
    "dense": ParallelConfig((2, 1, 1, 2), (0, 2, 1, 3)),
    "add": ParallelConfig((1, 2, 1, 1), (0, 2)),
    "pool": ParallelConfig((2, 1), (0, 1)),
    "out": ParallelConfig((2, 1), (0, 1)),
}
ROWS_THEN_POOLED_CHANNELS = {  # the gradient moves channels to rows
    "conv": ParallelConfig((2, 1, 1, 1), (0, 2)),
    "drop": ParallelConfig((2, 2, 1, 1), (0, 1, 2, 3)),
    "bn": ParallelConfig((1, 1, 1, 2), (0, 2)),
    "ln": ParallelConfig((2, 2, 1, 1), (0, 2, 1, 3)),
    "dense": ParallelConfig((2, 1, 1, 1), (0, 2)),
    "add": ParallelConfig((2, 1, 1, 1), (0, 2)),
    "pool": ParallelConfig((2, 2), (0, 2, 1, 3)),
    "out": ParallelConfig((2, 1), (0, 1)),
}


def build(mod, strategy_path):
    """An image model whose ops can each take a split of their own."""
    layers = mod.layers
    inputs = mod.Input((8, 8, 2))
    x = layers.Conv2D(8, 3, padding="same", name="conv")(inputs)
    x = layers.Dropout(0.25, name="drop")(x)
    x = layers.BatchNormalization(name="bn")(x)
    x = layers.LayerNormalization(name="ln")(x)
    y = layers.Dense(8, activation="relu", name="dense")(x)
    x = layers.Add(name="add")([x, y])
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(1, activation="sigmoid", name="out")(x)
    model = mod.Model(inputs, outputs)
    options = {}
    if mod.__name__ == "flexflow_keras":
        options["import_strategy"] = strategy_path
    model.compile(optimizer=mod.optimizers.SGD(0.1, momentum=0.9),
                  loss="binary_crossentropy", metrics=["accuracy"],
                  **options)
    return model


class AllToAllSwitchTest(unittest.TestCase):
    def test_off_unless_the_user_set_it(self):
        env = {}
        settings.all_gather_relayouts(env)
        self.assertEqual(env, {settings.ALL_TO_ALL_RELAYOUT: "0"})
        env = {settings.ALL_TO_ALL_RELAYOUT: "1"}
        settings.all_gather_relayouts(env)
        self.assertEqual(env, {settings.ALL_TO_ALL_RELAYOUT: "1"})

    def test_moves_between_inner_dims_and_their_gradients(self):
        mesh = dtensor.create_mesh([("a0", 2), ("a1", 2)],
                                   devices=list(device_names()[:4]))
        whole = dtensor.Layout.replicated(mesh, 4)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(4, 4, 4, 4)).astype(np.float32)
        w = rng.normal(size=(4, 4, 4, 4)).astype(np.float32)
        for source, target in WRONG_BY_ALL_TO_ALL:
            with self.subTest(source=source, target=target):
                def moved(a, weights):
                    with tf.GradientTape() as tape:
                        tape.watch(a)
                        h = dtensor.relayout(
                            a * 2.0, dtensor.Layout(list(source), mesh))
                        h = dtensor.relayout(
                            h, dtensor.Layout(list(target), mesh)) + 1.0
                        loss = tf.reduce_sum(
                            dtensor.relayout(h, whole) * weights)
                    return (dtensor.relayout(h, whole),
                            dtensor.relayout(tape.gradient(loss, a), whole))

                values, grads = tf.function(moved)(
                    dtensor.copy_to_mesh(x, whole),
                    dtensor.copy_to_mesh(w, whole))
                np.testing.assert_allclose(
                    dtensor.unpack(values)[0], 2 * x + 1, rtol=1e-6)
                np.testing.assert_allclose(
                    dtensor.unpack(grads)[0], 2 * w, rtol=1e-6)


class StrategiesWithInnerMovesTest(unittest.TestCase):
    def test_train_evaluate_predict_as_plain_keras(self):
        self.assertEqual(NUM_DEVICES, 4)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(36, 8, 8, 2)).astype(np.float32)
        y = (x.mean(axis=(1, 2, 3)) > 0).astype(np.float32)[:, None]

        def train(model):
            # 36 rows in batches of 24: a partial batch of 12 each epoch.
            history = model.fit(x, y, batch_size=24, epochs=2,
                                validation_split=0.25, shuffle=False,
                                verbose=0)
            return [history.history,
                    model.evaluate(x[:13], y[:13], batch_size=24,
                                   verbose=0),
                    model.predict(x[:13], batch_size=24, verbose=0)]

        for name, configs in (("channels then rows", CHANNELS_THEN_ROWS),
                              ("rows then pooled channels",
                               ROWS_THEN_POOLED_CHANNELS)):
            with self.subTest(strategy=name), \
                    tempfile.TemporaryDirectory() as folder:
                path = os.path.join(folder, "strategy.txt")
                save_strategy(Strategy(configs), path)
                runs = train_plain_and_ours(
                    lambda mod: build(mod, path), 3, train)
                assert_own_step_under_strategy(self, runs)
                self.assertEqual(dict(runs["ours"][0].strategy),
                                 configs)
                assert_same_fit_evaluate_predict(self, runs)


if __name__ == "__main__":
    unittest.main()
