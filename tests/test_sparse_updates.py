"""Embeddings under optimizers that update their tables sparsely.

Adagrad, RMSprop, Adadelta and Adafactor keep an Embedding's
IndexedSlices gradient sparse. On DTensor their update failed the first
step, and the model trained as plain Keras (keras.io's movielens
transformer: a StringLookup's int64 ids into an Embedding, Adagrad):
- with the table split on its columns (`capabilities.for_optimizer`
  keeps such tables whole, and an imported strategy that splits one is
  searched again, with a warning);
- with int64 ids, even under data parallelism (`op_rules.int32_indices`),
  also where the Embedding is called inside a layer of the user's
  (keras.io's English-Spanish Transformer: a positional embedding of
  int64 token ids, RMSprop).
"""

import os
import tempfile
import unittest
import warnings

import keras
import numpy as np
import tensorflow as tf

import flexflow_keras as fk
from flexflow_keras import capabilities
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.runtime import model_step
from flexflow_keras.strategy import ParallelConfig, Strategy
from flexflow_keras.strategy_files import save_strategy
from runtime_support import assert_not_handed_over

ROWS, BATCH = 64, 16
WORDS = [f"w{i}" for i in range(12)]


def build(mod, optimizer):
    """StringLookup ids (int64) -> Embedding -> Flatten -> Dense."""
    ids = mod.Input((4,), dtype="string", name="words")
    lookup = mod.layers.StringLookup(vocabulary=WORDS, name="lookup")
    h = mod.layers.Embedding(len(WORDS) + 1, 8, name="emb")(lookup(ids))
    h = mod.layers.Flatten(name="flat")(h)
    model = mod.Model(ids, mod.layers.Dense(1, name="out")(h))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def build_positional(mod, optimizer):
    """keras.io's `PositionalEmbedding` (token and position Embeddings
    inside a layer of the script's own) on int64 ids."""

    class PositionalEmbedding(mod.layers.Layer):
        def __init__(self, length, vocab, dim, **kwargs):
            super().__init__(**kwargs)
            self.tokens = mod.layers.Embedding(vocab, dim)
            self.positions = mod.layers.Embedding(length, dim)

        def call(self, inputs):
            length = mod.ops.shape(inputs)[-1]
            positions = mod.ops.arange(0, length, 1)
            return self.tokens(inputs) + self.positions(positions)

    ids = mod.Input((4,), dtype="int64", name="ids")
    h = PositionalEmbedding(4, len(WORDS), 8, name="emb")(ids)
    h = mod.layers.Flatten(name="flat")(h)
    model = mod.Model(ids, mod.layers.Dense(1, name="out")(h))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def positional_data():
    rng = np.random.default_rng(0)
    return (rng.integers(0, len(WORDS), (ROWS, 4)),
            rng.random((ROWS, 1)).astype("float32"))


def data():
    rng = np.random.default_rng(0)
    x = tf.constant(rng.choice(WORDS, (ROWS, 4)))
    return x, rng.random((ROWS, 1)).astype("float32")


def fit_both(test, optimizer, strategy=None, build=build, data=data):
    x, y = data()
    histories, models = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for name, mod in (("plain", keras), ("ours", fk)):
            keras.utils.set_random_seed(3)
            model = build(mod, optimizer)
            if mod is fk:
                options = {"search_budget": 0}
                if strategy is not None:
                    path = os.path.join(folder, "strategy.txt")
                    save_strategy(strategy(build_graph(model, BATCH)), path)
                    options = {"import_strategy": path}
                model.compile(optimizer=optimizer, loss="mse", **options)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                histories[name] = model.fit(
                    x, y, batch_size=BATCH, epochs=2, shuffle=False,
                    verbose=0).history
            models[name] = model
    messages = [str(w.message) for w in caught]
    assert_not_handed_over(test, messages, messages)
    test.assertIsInstance(models["ours"].strategy_executor,
                          model_step.ModelStepExecutor)
    np.testing.assert_allclose(histories["ours"]["loss"],
                               histories["plain"]["loss"], rtol=1e-5)
    for a, b in zip(models["plain"].get_weights(),
                    models["ours"].get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    return models["ours"], messages


def split_table(graph):
    """The Embedding's table split on its columns over 4 devices."""
    configs = dict(Strategy.data_parallel(graph, 4))
    configs["emb"] = ParallelConfig((1, 1, 4), (0, 1, 2, 3))
    return Strategy(configs)


class SparseUpdatesTest(unittest.TestCase):
    def test_which_optimizers_keep_tables_whole(self):
        graph = build_graph(build(keras, "sgd"), BATCH)
        for name in ("Adagrad", "RMSprop", "Adadelta", "Adafactor",
                     "Adam", "SGD"):
            with self.subTest(name):
                optimizer = getattr(keras.optimizers, name)()
                emb = capabilities.for_optimizer(graph, optimizer).op("emb")
                splits = capabilities.PARAMETER in emb.partitionable.values()
                self.assertEqual(
                    splits, name not in capabilities.SPARSE_UPDATE_OPTIMIZERS)

    def test_int64_ids_under_data_parallelism(self):
        for name in ("adagrad", "rmsprop"):
            with self.subTest(name):
                fit_both(self, name)

    def test_int64_ids_into_an_embedding_inside_a_users_layer(self):
        for name in ("adagrad", "rmsprop"):
            with self.subTest(name):
                fit_both(self, name, build=build_positional,
                         data=positional_data)

    def test_imported_table_split_is_searched_again(self):
        ours, messages = fit_both(self, "adagrad", split_table)
        self.assertEqual(
            sum("splits the tables of Embedding ops ['emb']" in m
                for m in messages), 1, messages)
        self.assertNotEqual(ours.strategy["emb"].dims[2], 4)

    def test_adam_keeps_the_imported_table_split(self):
        ours, _ = fit_both(self, "adam", split_table)
        self.assertEqual(ours.strategy["emb"].dims, (1, 1, 4))


if __name__ == "__main__":
    unittest.main()
