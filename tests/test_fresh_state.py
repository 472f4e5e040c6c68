"""Callbacks and code between steps see the model as Keras would (issue 21).

A callback reading `optimizer.iterations` or a weight in
`on_train_batch_end` sees each step's values (it saw the last epoch end's:
0, 0, ..., 8, 8, ...), a weight written between steps is what the next
step trains from, and a fit whose callbacks touch no variable copies no
more than before (`runtime/fresh_state.py`).
"""

import unittest
from unittest import mock

import keras
import numpy as np

import flexflow_keras as fk
from flexflow_keras.runtime import model_step, step
from flexflow_keras.runtime.variables import Transfers
from flexflow_keras.strategy import ParallelConfig, Strategy

SAMPLES, BATCH, EPOCHS = 64, 16, 2


class Reader(keras.callbacks.Callback):
    """Reads the step counter and a kernel after every batch."""

    def __init__(self):
        super().__init__()
        self.iterations, self.kernel_sums = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.iterations.append(int(self.model.optimizer.iterations.numpy()))
        kernel = self.model.get_layer("out").kernel
        self.kernel_sums.append(float(np.sum(kernel.numpy())))


class Writer(keras.callbacks.Callback):
    """Halves the output kernel after the third batch of each epoch."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            kernel = self.model.get_layer("out").kernel
            kernel.assign(kernel * 0.5)


class Empty(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass


def _build(mod, **compile_kw):
    inputs = mod.Input((8,), name="x")
    h = mod.layers.Dense(16, activation="relu", name="hidden")(inputs)
    outputs = mod.layers.Dense(4, name="out")(h)
    model = mod.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", **compile_kw)
    return model


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(SAMPLES, 8)).astype("float32"),
            rng.normal(size=(SAMPLES, 4)).astype("float32"))


def _placed(path):
    """Hidden on devices 0, 1 and the output on 2, 3: two meshes."""
    from flexflow_keras.strategy_files import save_strategy

    save_strategy(Strategy({
        "hidden": ParallelConfig((2, 1), (0, 1)),
        "out": ParallelConfig((2, 1), (2, 3)),
    }), path)
    return path


class FreshStateTest(unittest.TestCase):
    def fit_both(self, callback_class, **compile_kw):
        x, y = _data()
        keras.utils.set_random_seed(3)
        plain = _build(keras)
        keras.utils.set_random_seed(3)
        ours = _build(fk, **compile_kw)
        seen = []
        for model in (plain, ours):
            callback = callback_class()
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                      verbose=0, callbacks=[callback])
            seen.append(callback)
        for a, b in zip(plain.get_weights(), ours.get_weights()):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
        return ours, seen

    def test_reads_each_step_one_mesh(self):
        ours, (plain, seen) = self.fit_both(
            Reader, search_budget=0
        )
        self.assertIsInstance(ours.strategy_executor,
                              model_step.ModelStepExecutor)
        steps = EPOCHS * SAMPLES // BATCH
        self.assertEqual(seen.iterations, list(range(1, steps + 1)))
        np.testing.assert_allclose(seen.kernel_sums, plain.kernel_sums,
                                   rtol=1e-5)

    def test_reads_each_step_several_meshes(self):
        import tempfile, os

        with tempfile.TemporaryDirectory() as folder:
            path = _placed(os.path.join(folder, "s.txt"))
            ours, (plain, seen) = self.fit_both(Reader, import_strategy=path)
        self.assertIsInstance(ours.strategy_executor, step.Executor)
        self.assertEqual(seen.iterations, plain.iterations)
        np.testing.assert_allclose(seen.kernel_sums, plain.kernel_sums,
                                   rtol=1e-5)

    def test_writes_between_steps_are_trained_from(self):
        # fit_both compares the final weights with plain Keras's.
        self.fit_both(Writer, search_budget=0)

    def test_an_empty_callback_copies_nothing_more(self):
        copies = []
        real = Transfers.copy_out

        def counting(transfers, pairs):
            copies.append(len(pairs))
            return real(transfers, pairs)

        x, y = _data()
        counts = []
        for callbacks in ([], [Empty()]):
            model = _build(fk, search_budget=0)
            copies.clear()
            with mock.patch.object(Transfers, "copy_out", counting):
                model.fit(x, y, batch_size=BATCH, epochs=EPOCHS,
                          verbose=0, callbacks=callbacks)
            counts.append(list(copies))
        self.assertEqual(counts[0], counts[1])
        # One full copy per epoch end, none per batch.
        self.assertLessEqual(len(counts[0]), 2 * EPOCHS + 2, counts[0])
