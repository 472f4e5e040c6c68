"""Sparse input rows (an `Input(sparse=True)` fed `tf.SparseTensor`s, as a
bag of words or TF-IDF from `TextVectorization(sparse=True)`) train under
the strategy equal to plain Keras.

DTensor takes dense tensors only: the first step failed on the sparse
tensor's indices and the model trained as plain Keras on one device. The
runtime feeds the dense rows (`variables.densified`).
"""

import os
import tempfile
import unittest

import numpy as np
import tensorflow as tf

import flexflow_keras as fk
from flexflow_keras.runtime import model_step, step
from flexflow_keras.strategy import ParallelConfig, Strategy
from flexflow_keras.strategy_files import save_strategy
from runtime_support import (
    assert_not_handed_over, assert_same_fit_evaluate_predict,
    train_plain_and_ours,
)

ROWS, WORDS, FEATURES = 96, 40, 5


def _data():
    rng = np.random.default_rng(0)
    bag = ((rng.uniform(size=(ROWS, WORDS)) > 0.85)
           * rng.uniform(0.5, 2.0, size=(ROWS, WORDS))).astype("float32")
    side = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    labels = rng.integers(0, 3, size=(ROWS,))
    return bag, side, labels


def _dataset(bag, side, labels):
    return tf.data.Dataset.from_tensor_slices(
        ((tf.sparse.from_dense(bag), side), labels)).batch(16)


def _build(mod):
    words = mod.Input((WORDS,), sparse=True, name="words")
    side = mod.Input((FEATURES,), name="side")
    h = mod.layers.Dense(16, activation="relu", name="hidden")(words)
    s = mod.layers.Dense(8, activation="tanh", name="side_dense")(side)
    h = mod.layers.Concatenate(name="concat")([h, s])
    h = mod.layers.Dropout(0.25, seed=2, name="drop")(h)
    model = mod.Model([words, side],
                      mod.layers.Dense(3, activation="softmax",
                                       name="out")(h))
    return model


class SparseInputsTest(unittest.TestCase):
    def run_both(self, **compile_kw):
        bag, side, labels = _data()
        train_rows = _dataset(bag[:64], side[:64], labels[:64])
        valid = _dataset(bag[64:], side[64:], labels[64:])

        def build(mod):
            model = _build(mod)
            model.compile(optimizer="adam",
                          loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"],
                          **(compile_kw if mod is fk else {}))
            return model

        def train(model):
            history = model.fit(train_rows, epochs=2, validation_data=valid,
                                verbose=0).history
            return [history, model.evaluate(valid, verbose=0),
                    model.predict(valid, verbose=0)]

        runs = train_plain_and_ours(build, 3, train)
        assert_not_handed_over(self, runs["ours"][2])
        assert_same_fit_evaluate_predict(self, runs)
        return runs["ours"][0]

    def test_one_mesh(self):
        # Data parallelism: one mesh whatever the machine measures (a
        # search may place the two layers on meshes of their own).
        ours = self.run_both(search_budget=0)
        self.assertIsInstance(ours.strategy_executor,
                              model_step.ModelStepExecutor)

    def test_several_meshes(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "s.txt")
            save_strategy(Strategy({
                "hidden": ParallelConfig((2, 1), (0, 1)),
                "out": ParallelConfig((2, 1), (2, 3)),
            }), path)
            ours = self.run_both(import_strategy=path)
        self.assertIsInstance(ours.strategy_executor, step.Executor)
