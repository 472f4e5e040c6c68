"""The package's own work takes nothing from the user's random streams
(nor from Keras's counters that number unnamed layers and models).

A script seeded once (`keras.utils.set_random_seed`) that compiles and
fits a model, then draws data or builds a second model, must get what it
gets on plain Keras. Tracing, probing, measuring, searching and building
executors drew from Python's `random`, NumPy, TensorFlow's op seeds and
so Keras's initializers (keras.io's `endpoint_layer_pattern.py`: its
second model started from other weights). `user_random.kept()` puts the
streams back (and drops TensorFlow's eager random kernels the package
drew from, whose streams advanced); each test starts with nothing
measured, as a new user's first run; checked here for data parallelism, a model running its own
step and a strategy over several meshes (the layer-by-layer executor).
"""

import os
import random
import tempfile
import unittest

import keras
import numpy as np
import tensorflow as tf

import flexflow_keras as fk
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.strategy_files import save_strategy
from runtime_support import fresh_caches, several_meshes


def _next_draws() -> dict:
    """The next value of every stream a script draws from."""
    return {
        "python": random.random(),
        "numpy": float(np.random.random()),
        "tensorflow": float(tf.random.uniform(())),
        "keras.random": float(keras.random.uniform(())),
        "initializer": keras.initializers.GlorotUniform()((3,)).numpy(),
    }


def _name_counters() -> dict:
    """Keras's counters of auto-named objects (layers, models, optimizers,
    variables), prefix -> last number given."""
    from keras.src.backend.common import global_state

    return dict(global_state.get_global_attribute("object_name_uids") or {})


# Numbered by Keras's `_symbolic_build`, which the runtime calls at the
# first step and plain Keras's fit on TensorFlow skips (it builds in the
# trace): the symbolic batch, never seen by a script.
_UNSEEN_NAMES = {"keras_tensor", "scratch_graph"}


def _names_taken(before: dict) -> dict:
    """Per prefix, how many auto names were given since `before`."""
    after = _name_counters()
    return {prefix: number - before.get(prefix, 0)
            for prefix, number in after.items()
            if number != before.get(prefix, 0)
            and prefix not in _UNSEEN_NAMES}


def _subclassed(mod):
    """A subclassed model, built by fit(), whose custom layer makes its
    initializer as it builds (its seed drawn from Python's `random`
    then), with Dropout."""

    class Scaled(mod.layers.Layer):
        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1], 8),
                                     initializer="random_normal")

        def call(self, x):
            return mod.ops.matmul(x, self.w)

    class Regressor(mod.Model):
        def __init__(self):
            super().__init__()
            self.scaled = Scaled()
            self.dropout = mod.layers.Dropout(0.2)
            self.out = mod.layers.Dense(1)

        def call(self, x, training=False):
            return self.out(self.dropout(self.scaled(x), training=training))

    return Regressor()


def _train(mod, own_step=False, strategy_path=None, subclassed=False):
    keras.utils.set_random_seed(3)
    names = _name_counters()
    x = np.random.random((64, 8)).astype("float32")
    y = np.random.random((64, 1)).astype("float32")
    if subclassed:
        model = _subclassed(mod)
    else:
        inputs = mod.Input((8,))
        h = mod.layers.Dense(
            8, activity_regularizer="l2" if own_step else None
        )(inputs)
        model = mod.Model(inputs, mod.layers.Dense(1)(h))
    options = {}
    if strategy_path is not None and mod is fk:
        save_strategy(several_meshes(build_graph(model, 16)), strategy_path)
        options = {"import_strategy": strategy_path}
    model.compile(optimizer="adam", loss="mse", **options)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    after = _next_draws()
    second = keras.layers.Dense(4)
    second.build((None, 8))
    after["second model's kernel"] = second.kernel.numpy()
    # The script's next layers and models are numbered as on plain Keras
    # (`dense_2`, not `dense_3`): the package's own Keras objects
    # (traced inputs, calibration's model) took numbers.
    after["auto names taken"] = _names_taken(names)
    return model, after


class UserRandomTest(unittest.TestCase):
    def setUp(self):
        # Nothing measured yet: measuring op costs draws from
        # TensorFlow's eager random ops, whose kernels keep their streams
        # per seed pair (a first run's later `tf.random` draws differed
        # from plain Keras's).
        fresh_caches(self)

    def check(self, **options):
        _, plain = _train(keras, **options)
        ours, got = _train(fk, **options)
        devices = {d for c in ours.strategy.values() for d in c.device_ids}
        self.assertGreater(len(devices), 1)  # it ran under a strategy
        for name, value in plain.items():
            if isinstance(value, dict):
                self.assertEqual(got[name], value, msg=name)
            else:
                np.testing.assert_array_equal(got[name], value,
                                              err_msg=name)
        return ours

    def test_data_parallel(self):
        self.check()

    def test_own_step(self):
        self.check(own_step=True)

    def test_subclassed_model_built_by_fit(self):
        # Its layers are built as Keras's fit builds them, outside the
        # package's blocks: the seed the custom layer's initializer drew
        # stays drawn (before, the block put it back, and every later
        # draw of the script repeated it).
        self.check(subclassed=True)

    def test_several_meshes(self):
        with tempfile.TemporaryDirectory() as folder:
            ours = self.check(
                strategy_path=os.path.join(folder, "strategy.txt")
            )
        self.assertGreater(len(ours.strategy_executor.segments), 1)


class LayerSeedsTest(unittest.TestCase):
    def test_planning_leaves_a_random_layers_seed_where_it_was(self):
        # Measuring RandomFlip's cost runs it, and it draws as it runs
        # (`training` defaults to True): training then started from
        # other flips than plain Keras's.
        fresh_caches(self)
        keras.utils.set_random_seed(3)
        inputs = fk.Input((8, 8, 3))
        flip = fk.layers.RandomFlip("horizontal")
        model = fk.Model(inputs, fk.layers.Dense(2)(flip(inputs)))
        before = flip.generator.state.numpy()
        model.compile(optimizer="sgd", loss="mse", batch_size=16,
                      search_budget=10)
        self.assertIsNotNone(model.strategy)
        np.testing.assert_array_equal(flip.generator.state.numpy(), before)

    def test_a_new_batch_size_leaves_a_recurrent_layers_seed_where_it_was(
            self):
        """Planning for a second batch size inside a fit measures the
        LSTM again by rerunning its traced step, which draws its dropout
        masks without a Python `assign`: the model's own block put the
        seed back, and fit's enclosing block, taking that for a write of
        its own, put the advanced seed back again (96 seeds past plain
        Keras's, other masks from then on)."""
        fresh_caches(self)
        rng = np.random.default_rng(0)
        x = rng.integers(1, 30, (64, 10)).astype("int32")
        y = rng.integers(0, 4, 64)
        runs = {}
        for mod in (keras, fk):
            keras.utils.set_random_seed(4)
            inputs = mod.Input((10,), dtype="int32")
            h = mod.layers.Embedding(30, 8)(inputs)
            h = mod.layers.LSTM(8, dropout=0.2, recurrent_dropout=0.1,
                                seed=3)(h)
            h = mod.layers.Dropout(0.3, seed=1)(h)
            model = mod.Model(inputs, mod.layers.Dense(4)(h))
            model.compile(mod.optimizers.Adam(3e-3),
                          mod.losses.SparseCategoricalCrossentropy(
                              from_logits=True))
            runs[mod] = [
                (model.fit(x, y, batch_size=batch, epochs=1,
                           verbose=0).history["loss"],
                 [v.numpy().tolist() for v in model.non_trainable_variables])
                for batch in (16, 32, 16)]
        for (mine, my_seeds), (plain, seeds) in zip(runs[fk], runs[keras]):
            self.assertEqual(my_seeds, seeds)
            np.testing.assert_allclose(mine, plain, rtol=1e-5)



class DrawnBatches(keras.utils.PyDataset):
    """Batches drawn from Python's `random` on each read, as keras.io's
    metric learning draws its anchor-positive pairs."""

    def __init__(self, x, y, batches):
        super().__init__()
        self.x, self.y, self.batches = x, y, batches
        self.drawn = []

    def __len__(self):
        return self.batches

    def __getitem__(self, index):
        rows = [random.randrange(len(self.x)) for _ in range(16)]
        self.drawn.append(rows)
        return self.x[rows], self.y[rows]


class PyDatasetReadTest(unittest.TestCase):
    def test_reading_the_batch_size_draws_nothing_from_the_script(self):
        """fit() reads a PyDataset's first batch for its size; that read
        drew from Python's `random`, so every batch after it was another
        than plain Keras's (keras.io's metric learning trained on other
        pairs, silently)."""
        rng = np.random.default_rng(1)
        x = rng.normal(size=(200, 8)).astype("float32")
        y = (x[:, :1] > 0).astype("float32")
        seen = {}
        for name, mod in (("plain", keras), ("ours", fk)):
            keras.utils.set_random_seed(5)
            inputs = mod.Input((8,))
            hidden = mod.layers.Dense(16, activation="relu")(inputs)
            model = mod.Model(inputs, mod.layers.Dense(1)(hidden))
            ours = {"search_budget": 10} if mod is fk else {}
            model.compile(optimizer="sgd", loss="mse", **ours)
            data = DrawnBatches(x, y, 6)
            history = model.fit(data, epochs=2, verbose=0).history
            # Keras reads no batch twice but the first; the batches fit
            # trained on, in order, without the package's extra read.
            drawn = data.drawn[1:] if mod is fk else data.drawn
            seen[name] = (history["loss"], drawn)
        self.assertEqual(seen["ours"][1], seen["plain"][1])
        np.testing.assert_allclose(seen["ours"][0], seen["plain"][0],
                                   rtol=1e-5)
