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
from runtime_support import assert_same_fit_evaluate_predict, \
    train_plain_and_ours

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


class EpochEndWriter(keras.callbacks.Callback):
    """Halves the output kernel at each epoch's end (between epochs: the
    next epoch must start from it)."""

    def on_epoch_end(self, epoch, logs=None):
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


def _counted(method, sizes):
    """`Transfers.<method>` patched to record each call's pair count in
    `sizes`."""
    real = getattr(Transfers, method)

    def counting(transfers, pairs):
        sizes.append(len(pairs))
        return real(transfers, pairs)

    return mock.patch.object(Transfers, method, counting)


def _two_heads(mod):
    """Two models sharing their first layer (a GAN's discriminator and
    the combined model, say), each compiled on its own."""
    inputs = mod.Input((8,), name="x")
    shared = mod.layers.Dense(16, activation="tanh", name="shared")
    a = mod.Model(inputs, mod.layers.Dense(4, name="head_a")(shared(inputs)))
    b = mod.Model(inputs, mod.layers.Dense(2, name="head_b")(shared(inputs)))
    a.compile(optimizer="adam", loss="mse")
    b.compile(optimizer="sgd", loss="mse")
    return a, b


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
        x, y = _data()
        counts = []
        for callbacks in ([], [Empty()]):
            model = _build(fk, search_budget=0)
            copies.clear()
            with _counted("copy_out", copies):
                model.fit(x, y, batch_size=BATCH, epochs=EPOCHS,
                          verbose=0, callbacks=callbacks)
            counts.append(list(copies))
        self.assertEqual(counts[0], counts[1])
        # One full copy per epoch end, none per batch.
        self.assertLessEqual(len(counts[0]), 2 * EPOCHS + 2, counts[0])

    def test_a_write_between_epochs_is_trained_from(self):
        # An epoch's start copies Keras values in only when one was
        # written since the last copy; this write is such a one.
        self.fit_both(EpochEndWriter, search_budget=0)
        import tempfile, os

        with tempfile.TemporaryDirectory() as folder:
            path = _placed(os.path.join(folder, "s.txt"))
            ours, _ = self.fit_both(EpochEndWriter, import_strategy=path)
        self.assertIsInstance(ours.strategy_executor, step.Executor)

    def test_epoch_starts_copy_nothing_in_when_nothing_was_written(self):
        copied_in = []
        x, y = _data()
        model = _build(fk, search_budget=0)
        with _counted("copy_in", copied_in):
            model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0)
        self.assertIsInstance(model.strategy_executor,
                              model_step.ModelStepExecutor)
        weights = len(model.weights) + len(model.optimizer.variables)
        # Metric state (reset at each epoch) only: never the weights.
        self.assertLess(max(copied_in, default=0), weights, copied_in)

    def test_models_sharing_a_layer_see_each_others_training(self):
        # Each model's executor holds the shared layer's weights; what one
        # trains reaches the Keras variables at its epoch's end, and the
        # other must copy it in before its next step.
        x, y = _data()
        rng = np.random.default_rng(1)
        y2 = rng.normal(size=(SAMPLES, 2)).astype("float32")
        results = []
        for mod, kw in ((keras, {}), (fk, {})):
            keras.utils.set_random_seed(5)
            a, b = _two_heads(mod)
            for _ in range(2):
                a.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                      verbose=0)
                b.fit(x, y2, batch_size=BATCH, epochs=1, shuffle=False,
                      verbose=0)
            for _ in range(2):
                a.train_on_batch(x[:BATCH], y[:BATCH])
                b.train_on_batch(x[:BATCH], y2[:BATCH])
            results.append(a.get_weights() + b.get_weights())
        for expected, got in zip(*results):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)

    def test_a_write_in_a_users_function_is_trained_from(self):
        # Writes inside a graph are not seen one by one: a variable once
        # written there is copied in at every epoch start from then on.
        import tensorflow as tf

        x, y = _data()
        finals = []
        for mod in (keras, fk):
            keras.utils.set_random_seed(3)
            model = _build(mod) if mod is keras else _build(
                mod, search_budget=0)
            kernel = model.get_layer("out").kernel
            halve = tf.function(lambda: kernel.assign(kernel * 0.5))
            for _ in range(2):
                model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                          verbose=0)
                halve()
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                      verbose=0)
            finals.append(model.get_weights())
        for expected, got in zip(*finals):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


class SwappedAveragesTest(unittest.TestCase):
    """`SwapEMAWeights` writes the weights' and the averages' tf.Variables
    directly (not through `assign`): validation, evaluate and predict run
    on the averages, training on the trained weights, as in Keras."""

    def run_both(self, **compile_kw):
        x, y = _data()
        xv, yv = x[:16] + 0.5, y[:16]

        def build(mod):
            inputs = mod.Input((8,), name="x")
            h = mod.layers.Dense(16, activation="relu", name="hidden")(inputs)
            h = mod.layers.Dropout(0.25, seed=2)(h)
            model = mod.Model(inputs, mod.layers.Dense(4, name="out")(h))
            model.compile(optimizer=keras.optimizers.Adam(
                0.01, use_ema=True, ema_momentum=0.9), loss="mse",
                **(compile_kw if mod is fk else {}))
            return model

        def train(model):
            history = model.fit(
                x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                validation_data=(xv, yv),
                callbacks=[keras.callbacks.SwapEMAWeights(
                    swap_on_epoch=True)]).history
            return [history, model.evaluate(xv, yv, verbose=0),
                    model.predict(xv, verbose=0)]

        runs = train_plain_and_ours(build, 3, train)
        assert_same_fit_evaluate_predict(self, runs)
        return runs["ours"][0]

    def test_averages_are_validated_and_trained_apart(self):
        # `use_ema` runs Keras's own apply: the model's own step, under a
        # strategy from the one-mesh space.
        ours = self.run_both(search_budget=50)
        self.assertIsInstance(ours.strategy_executor,
                              model_step.ModelStepExecutor)
