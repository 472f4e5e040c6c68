"""Datasets of unknown length train as in plain Keras past the first epoch.

Keras's TensorFlow trainer calls its train function once more at each
epoch's end of such a dataset; the batch is missing, but the step's
seed draws and the optimizer's step count still move on
(`runtime/unfed_step.py`). The executors now make the same moves, on one
mesh (the model's own step) and on several (the layer-by-layer step).
"""

import os
import tempfile
import unittest
import warnings

import keras
import numpy as np
import tensorflow as tf

import flexflow_keras as fk
import runtime_support as support
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.runtime import model_step, step
from flexflow_keras.strategy_files import save_strategy
from runtime_support import fresh_caches, several_meshes

ROWS, BATCH, EPOCHS = 140, 32, 3


def build(mod, steps_per_execution=1):
    inputs = mod.Input((8,), name="x")
    h = mod.layers.Dense(16, activation="relu", name="d1")(inputs)
    h = mod.layers.Dropout(0.25, name="drop")(h)
    outputs = mod.layers.Dense(3, activation="softmax", name="out")(h)
    model = mod.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"],
                  steps_per_execution=steps_per_execution)
    return model


def dataset():
    """A dataset whose length TensorFlow does not know (a filter), with
    a partial last batch."""
    rng = np.random.default_rng(0)
    x = rng.random((ROWS, 8)).astype("float32")
    y = rng.integers(0, 3, ROWS)
    data = tf.data.Dataset.from_tensor_slices((x, y)).filter(
        lambda a, b: True).batch(BATCH)
    assert data.cardinality() == tf.data.UNKNOWN_CARDINALITY
    return data


def fit_both(test, strategy=None, steps_per_execution=1):
    fresh_caches(test)
    histories, models = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for name, mod in (("plain", keras), ("ours", fk)):
            keras.utils.set_random_seed(4)
            model = build(mod, steps_per_execution)
            if mod is fk:
                options = {"search_budget": 0}
                if strategy is not None:
                    path = os.path.join(folder, "strategy.txt")
                    save_strategy(strategy(build_graph(model, BATCH)), path)
                    options = {"import_strategy": path}
                model.compile(optimizer=model.optimizer, loss=model.loss,
                              metrics=["accuracy"],
                              steps_per_execution=steps_per_execution,
                              **options)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                histories[name] = model.fit(dataset(), epochs=EPOCHS,
                                            verbose=0).history
            models[name] = model
    support.assert_not_handed_over(test, [str(w.message) for w in caught])
    support.assert_same_fits(test, histories, models)
    test.assertEqual(int(models["ours"].optimizer.iterations.numpy()),
                     int(models["plain"].optimizer.iterations.numpy()))
    return models["ours"]


class UnfedStepTest(unittest.TestCase):
    def test_one_mesh(self):
        ours = fit_both(self)
        self.assertIsInstance(ours.strategy_executor,
                              model_step.ModelStepExecutor)

    def test_several_meshes(self):
        ours = fit_both(self, several_meshes)
        self.assertIsInstance(ours.strategy_executor, step.Executor)

    def test_several_steps_per_execution(self):
        # Keras's loop over several steps checks for a batch first: no
        # batchless step, nothing to replay.
        fit_both(self, steps_per_execution=2)


if __name__ == "__main__":
    unittest.main()
