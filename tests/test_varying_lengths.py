"""Inputs whose length changes from batch to batch (text padded to each
batch's longest) train under their strategy, equal to plain Keras.

Before, such a model trained as plain Keras on one device ("Tensor of
'text_vectorization' has an unknown dimension; the search needs static
shapes"): TensorFlow's RNN text-classification tutorial (a
`TextVectorization` without `output_sequence_length`), and any
`padded_batch` of a shuffled dataset. Now those dims are `varying`:
priced at `keras_graph.VARYING_DIM_SIZE`, never split, and the step is
traced once more with them unknown after a second length
(`runtime/varying_shapes.py`); a step with recurrent loops, which
DTensor lays out only on static shapes, gets one trace per length, up
to `MAX_STATIC_LENGTHS`, then trains as plain Keras, saying why.
"""

import os
import tempfile
import unittest

import keras
import numpy as np
import tensorflow as tf

from flexflow_keras.keras_graph import VARYING_DIM_SIZE
from flexflow_keras.runtime import varying_shapes

from runtime_support import (
    assert_own_step_under_strategy, assert_same_fit_evaluate_predict,
    train_plain_and_ours,
)

WORDS = np.array(["good", "bad", "movie", "great", "awful", "plot",
                  "actor", "fun", "boring", "the", "a", "was"])


def reviews(rows=96, seed=0):
    rng = np.random.default_rng(seed)
    texts = np.array([" ".join(rng.choice(WORDS, rng.integers(2, 12)))
                      for _ in range(rows)])
    labels = np.array([("good" in t or "great" in t) * 1.0 for t in texts],
                      np.float32)
    return texts, labels


def build_tutorial(mod):
    """TensorFlow's "text classification with an RNN" tutorial, small:
    raw strings in, a `TextVectorization` without a fixed length (its
    output as long as each batch's longest review), a masking
    Embedding, a Bidirectional LSTM; Dropout as well."""
    texts, _ = reviews()
    encoder = mod.layers.TextVectorization(max_tokens=16, name="encoder")
    encoder.adapt(texts)
    model = mod.Sequential([
        mod.Input((), dtype="string"),
        encoder,
        mod.layers.Embedding(16, 8, mask_zero=True, name="embed"),
        mod.layers.Bidirectional(mod.layers.LSTM(8), name="bilstm"),
        mod.layers.Dropout(0.25, seed=3),
        mod.layers.Dense(8, activation="relu", name="hidden"),
        mod.layers.Dense(1, name="logit"),
    ])
    model.compile(optimizer=mod.optimizers.Adam(1e-2),
                  loss=mod.losses.BinaryCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def tutorial_data(shuffle):
    texts, labels = reviews()
    data = tf.data.Dataset.from_tensor_slices((texts, labels))
    if shuffle:
        data = data.shuffle(96, seed=1)
    return data.batch(16)


def sequences(rows, lengths, seed=0):
    """A dataset of token sequences of `lengths` (cycled), padded to each
    batch's longest by `padded_batch`."""
    rng = np.random.default_rng(seed)
    sizes = [lengths[i % len(lengths)] for i in range(rows)]
    tokens = tf.ragged.constant(
        [rng.integers(1, 30, size).tolist() for size in sizes],
        dtype=tf.int32)
    labels = rng.integers(0, 3, rows)
    return tf.data.Dataset.from_tensor_slices((tokens, labels)).map(
        lambda t, y: (t, y))


def build_conv_attention(mod):
    """Tokens of any length: Embedding, Conv1D, self-attention with
    Dropout, pooled."""
    tokens = mod.Input((None,), dtype="int32", name="tokens")
    h = mod.layers.Embedding(30, 8, name="embed")(tokens)
    h = mod.layers.Conv1D(8, 3, padding="same", activation="relu",
                          name="conv")(h)
    a = mod.layers.MultiHeadAttention(2, 4, dropout=0.2, name="mha")(h, h)
    h = mod.layers.LayerNormalization(name="norm")(h + a)
    h = mod.layers.GlobalAveragePooling1D(name="pool")(h)
    model = mod.Model(tokens, mod.layers.Dense(3, name="out")(h))
    model.compile(optimizer=mod.optimizers.SGD(0.1, momentum=0.9),
                  loss=mod.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  metrics=["accuracy"])
    return model


def build_rnn(mod):
    tokens = mod.Input((None,), dtype="int32", name="tokens")
    h = mod.layers.Embedding(30, 4, name="embed")(tokens)
    h = mod.layers.SimpleRNN(4, name="rnn")(h)
    model = mod.Model(tokens, mod.layers.Dense(3, name="out")(h))
    model.compile(optimizer="sgd",
                  loss=mod.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


def own_length_batches(count, seed):
    """`count` batches of 8 token rows, each batch as long as its own
    longest row (what a generator or `PyDataset` that pads per batch
    yields), the first two of other lengths (Keras reads two to tell
    which dims vary), zeros past each row's end."""
    rng = np.random.default_rng(seed)
    batches = []
    for i in range(count):
        length = 6 + (3 * i + 5 * (i % 2)) % 9
        tokens = rng.integers(1, 30, (8, length)).astype("int32")
        tokens[::3, length - 2:] = 0
        batches.append((tokens, rng.integers(0, 3, 8)))
    return batches


class OwnLengthBatches(keras.utils.PyDataset):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        return self.batches[index]


def build_masked_gru(mod, strategy_file=None):
    """Masked tokens of any length into a GRU with dropout, a Dropout,
    a Dense."""
    tokens = mod.Input((None,), dtype="int32", name="tokens")
    h = mod.layers.Embedding(30, 8, mask_zero=True, name="embed")(tokens)
    h = mod.layers.GRU(8, dropout=0.2, seed=2, name="gru")(h)
    h = mod.layers.Dropout(0.3, seed=4, name="drop")(h)
    model = mod.Model(tokens, mod.layers.Dense(3, name="out")(h))
    return compiled(mod, model, strategy_file)


def build_token_dense(mod, strategy_file=None):
    """Tokens of any length, a Dense over each position, pooled."""
    tokens = mod.Input((None,), dtype="int32", name="tokens")
    h = mod.layers.Embedding(30, 8, name="embed")(tokens)
    h = mod.layers.Dense(8, activation="relu", name="proj")(h)
    h = mod.layers.GlobalAveragePooling1D(name="pool")(h)
    model = mod.Model(tokens, mod.layers.Dense(3, name="out")(h))
    return compiled(mod, model, strategy_file)


def compiled(mod, model, strategy_file):
    """`model` compiled to classify 3 ways (ours with `strategy_file`
    imported)."""
    options = {} if mod is keras else {"import_strategy": strategy_file}
    model.compile(optimizer=mod.optimizers.Adam(1e-2),
                  loss=mod.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  metrics=["accuracy"], **options)
    return model


def fit_evaluate_predict(train, test):
    def run(model):
        history = model.fit(train(), epochs=2, validation_data=test(),
                            verbose=0).history
        return [history, model.evaluate(test(), verbose=0),
                model.predict(test(), verbose=0)]
    return run


class VaryingLengthsTest(unittest.TestCase):
    def test_text_classification_tutorial_trains_under_its_strategy(self):
        runs = train_plain_and_ours(build_tutorial, 4, fit_evaluate_predict(
            lambda: tutorial_data(shuffle=True),
            lambda: tutorial_data(shuffle=False).take(3)))
        assert_own_step_under_strategy(self, runs)
        graph = runs["ours"][0].plan.graph
        (tokens,) = graph.hosted_inputs
        self.assertEqual(graph.tensors[tokens].shape, (16, VARYING_DIM_SIZE))
        self.assertEqual(graph.tensors[tokens].varying, (1,))
        self.assertNotIn(1, graph.op("embed").partitionable)
        assert_same_fit_evaluate_predict(self, runs)

    def test_many_lengths_trace_one_step_for_all(self):
        train = lambda: sequences(64, list(range(8, 40))).shuffle(
            64, seed=2).padded_batch(8)
        # Batches of 8 rows of one length each.
        test = lambda: sequences(24, [8] * 8 + [13] * 8 + [21] * 8,
                                 seed=1).padded_batch(8)
        runs = train_plain_and_ours(build_conv_attention, 5,
                                    fit_evaluate_predict(train, test))
        assert_own_step_under_strategy(self, runs)
        assert_same_fit_evaluate_predict(self, runs)
        keys = list(runs["ours"][0].strategy_executor._functions)
        for kind in ("train", "test", "predict"):
            # The first batch's shapes, then every length at once.
            traced = [k for k in keys if k[0] == kind]
            self.assertEqual(len(traced), 2, traced)
            self.assertIn(None, varying_shapes.Signatures.dims(traced[1])[0])

    def test_recurrent_step_of_too_many_lengths_trains_as_plain_keras(self):
        # Batches of 8 rows of a length of their own (8 x 8 values and
        # more: not padded, so only the RNN's loop keeps them static).
        lengths = [8 + i // 8
                   for i in range(16 * varying_shapes.MAX_STATIC_LENGTHS)]
        data = lambda: sequences(len(lengths), lengths).padded_batch(8)
        runs = train_plain_and_ours(build_rnn, 6, lambda model: model.fit(
            data(), epochs=1, verbose=0).history)
        said = [m for m in runs["ours"][2] if "plain Keras" in m]
        self.assertEqual(len(said), 1, said)
        self.assertIn(
            f"more than {varying_shapes.MAX_STATIC_LENGTHS} shapes", said[0])
        self.assertIn("Pad every batch to one length", said[0])
        np.testing.assert_allclose(runs["ours"][1]["loss"],
                                   runs["plain"][1]["loss"], rtol=1e-5)
        for a, b in zip(runs["plain"][0].get_weights(),
                        runs["ours"][0].get_weights()):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


    def test_generator_py_dataset_and_bucketed_dataset_of_own_lengths(self):
        # Traced on the first batch alone, the graph had that batch's
        # length; the GRU's later lengths ran without their layouts and
        # DTensor refused the step ("TransposeOp SPMD needs communication
        # is not supported yet"): the model trained as plain Keras.
        train, test = own_length_batches(12, 0), own_length_batches(4, 1)

        def endless(batches):
            while True:
                yield from batches

        def bucketed():
            """The same rows, batched by `bucket_by_sequence_length`: a
            batch size no `batch` call in the chain tells, so fit()
            reads the first batch (the dataset replays it)."""
            rows = [row for tokens, _ in train for row in tokens.tolist()]
            labels = np.concatenate([y for _, y in train])
            return tf.data.Dataset.from_tensor_slices(
                (tf.ragged.constant(rows, dtype=tf.int32), labels)).map(
                lambda t, y: (t, y)).bucket_by_sequence_length(
                lambda t, y: tf.shape(t)[0], bucket_boundaries=[9, 12],
                bucket_batch_sizes=[8, 8, 8], drop_remainder=True)

        feeds = {
            "bucketed dataset": lambda model: model.fit(
                bucketed(), epochs=2, validation_data=OwnLengthBatches(test),
                verbose=0),
            "generator": lambda model: model.fit(
                endless(train), steps_per_epoch=len(train), epochs=2,
                validation_data=OwnLengthBatches(test), verbose=0),
            "PyDataset": lambda model: model.fit(
                OwnLengthBatches(train), epochs=2,
                validation_data=(test[0][0], test[0][1]), verbose=0),
        }
        folder = tempfile.mkdtemp()
        path = os.path.join(folder, "gru_split.txt")
        with open(path, "w") as file:  # the embedding whole on device 0
            # (its input conversion and mask take data parallelism)
            file.write("[embed] num_dims(3) dims[1,1,1] device_ids[0]\n"
                       "[gru] num_dims(2) dims[4,1] device_ids[0,1,2,3]\n"
                       "[drop] num_dims(2) dims[4,1] device_ids[0,1,2,3]\n"
                       "[out] num_dims(2) dims[4,1] device_ids[0,1,2,3]\n")
        for feed, fit in feeds.items():
            with self.subTest(feed):
                runs = train_plain_and_ours(
                    lambda mod: build_masked_gru(mod, path), 7,
                    lambda model: [
                        fit(model).history,
                        model.evaluate(OwnLengthBatches(test), verbose=0),
                        model.predict(OwnLengthBatches(test), verbose=0)])
                assert_own_step_under_strategy(self, runs)
                assert_same_fit_evaluate_predict(self, runs)
                model = runs["ours"][0]
                (tokens,) = model.plan.graph.inputs
                self.assertEqual(model.plan.graph.tensors[tokens].varying,
                                 (1,))
                self.assertEqual(model.strategy["gru"].device_ids,
                                 (0, 1, 2, 3))


    def test_fitted_on_one_length_runs_others(self):
        """A model whose Input leaves its length unknown is planned for
        the length of the arrays fit() feeds (10). Fed other lengths:

        - a GRU split over 4 devices (one mesh): a prediction from a
          `PyDataset` of length 20 ran the GRU's input where DTensor
          propagated it, and its rolled loop failed in DTensor
          ("TransposeOp SPMD needs communication"): the model went to
          plain Keras for good;
        - a Dense split over the length on 2 devices, the rest data
          parallel (several meshes): predict, on arrays or a `PyDataset`
          of length 7, raised DTensor's "requires dimension 1 to be
          divisible by sharding" from the script.

        Now predict, evaluate and fit on another length (arrays, or a
        generator or `PyDataset` read ahead for it) plan the model again
        with that length varying, and a call's input keeps the plan's
        layout where that splits none of the dims that differ.
        """
        rng = np.random.default_rng(2)
        tokens = {length: rng.integers(1, 30, (32, length)).astype("int32")
                  for length in (10, 20, 7, 14)}
        labels = rng.integers(0, 3, 32)
        strategies = {
            "masked GRU": (build_masked_gru, 20, (
                "[embed] num_dims(3) dims[1,1,1] device_ids[0]\n"
                "[gru] num_dims(2) dims[4,1] device_ids[0,1,2,3]\n"
                "[drop] num_dims(2) dims[4,1] device_ids[0,1,2,3]\n"
                "[out] num_dims(2) dims[4,1] device_ids[0,1,2,3]\n")),
            "length split": (build_token_dense, 7, (
                "[embed] num_dims(3) dims[2,1,1] device_ids[0,1]\n"
                "[proj] num_dims(3) dims[1,2,1] device_ids[0,1]\n")),
        }
        folder = tempfile.mkdtemp()
        for name, (build, other_length, text) in strategies.items():
            def run(model):
                first = model.fit(tokens[10], labels, batch_size=16,
                                  epochs=2, validation_data=(tokens[10],
                                                             labels),
                                  verbose=0).history
                # predict() reads a PyDataset ahead for its lengths, as
                # fit() does: planned again here.
                other = OwnLengthBatches(
                    [(tokens[other_length][:16], labels[:16]),
                     (tokens[other_length][16:], labels[16:])])
                seen = [model.predict(other, verbose=0),
                        model.predict(tokens[20], verbose=0),
                        model.predict(tokens[7][:5], verbose=0),
                        model.evaluate(tokens[20], labels, verbose=0)]
                again = model.fit(tokens[14], labels, batch_size=16,
                                  epochs=1, verbose=0).history
                return [first, seen, again,
                        model.predict(tokens[7], verbose=0)]

            with self.subTest(name):
                path = os.path.join(folder, "s.txt")
                with open(path, "w") as file:
                    file.write(text)
                runs = train_plain_and_ours(lambda mod: build(mod, path), 8,
                                            run)
                (_, expected, _), (model, got, said) = (runs["plain"],
                                                        runs["ours"])
                self.assertEqual(
                    [m for m in said if "plain Keras" in m], [], said)
                again = [m for m in said if "is planned again" in m]
                self.assertEqual(len(again), 1, said)
                self.assertIn(f"received shape (16, {other_length})",
                              again[0])
                for key in sorted(expected[0]):
                    np.testing.assert_allclose(got[0][key], expected[0][key],
                                               rtol=1e-5, err_msg=key)
                np.testing.assert_allclose(got[2]["loss"],
                                           expected[2]["loss"], rtol=1e-5)
                for mine, plain in zip(got[1] + [got[3]],
                                       expected[1] + [expected[3]]):
                    np.testing.assert_allclose(mine, plain, rtol=1e-5,
                                               atol=1e-6)
                for a, b in zip(runs["plain"][0].get_weights(),
                                model.get_weights()):
                    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
                graph = model.plan.graph
                (tokens_in,) = graph.inputs
                self.assertEqual(graph.tensors[tokens_in].varying, (1,))
                self.assertGreater(len({d for c in model.strategy.values()
                                        for d in c.device_ids}), 1)

    def test_validation_of_another_length_plans_it_varying(self):
        """Validation data of another length than fit's, as arrays, a
        generator or a `PyDataset` (read ahead as fit's own data is):
        the plan leaves that length varying from the start (a searched
        plan), and a strategy file that splits it is refused, saying
        why; before, the first validation step raised DTensor's error
        ("requires dimension 1 to be divisible by sharding")."""
        import flexflow_keras as fk

        rng = np.random.default_rng(3)
        x, y = rng.integers(1, 30, (32, 10)), rng.integers(0, 3, 32)
        x_val = rng.integers(1, 30, (16, 7))
        halves = [(x_val[:8], y[:8]), (x_val[8:], y[8:16])]
        feeds = {
            "arrays": lambda: (x_val, y[:16]),
            "generator": lambda: (batch for batch in halves),
            "PyDataset": lambda: OwnLengthBatches(halves),
        }
        path = os.path.join(tempfile.mkdtemp(), "split.txt")
        with open(path, "w") as file:
            file.write("[proj] num_dims(3) dims[1,2,1] device_ids[0,1]\n")
        for feed, validation in feeds.items():
            # A generator is read once: one epoch validates on it whole.
            epochs = 1 if feed == "generator" else 2
            with self.subTest(feed):
                runs = train_plain_and_ours(build_token_dense, 9, lambda m: [
                    m.fit(x, y, batch_size=16, epochs=epochs, verbose=0,
                          validation_data=validation()).history,
                    m.evaluate(x_val, y[:16], verbose=0),
                    m.predict(x_val, verbose=0)])
                assert_own_step_under_strategy(self, runs)
                assert_same_fit_evaluate_predict(self, runs)
                self.assertIn("val_loss", runs["ours"][1][0])
                graph = runs["ours"][0].plan.graph
                self.assertEqual(graph.tensors[graph.inputs[0]].varying,
                                 (1,))
                self.assertEqual(
                    [m for m in runs["ours"][2] if "planned again" in m], [])

                model = build_token_dense(fk, path)
                with self.assertRaisesRegex(
                        ValueError, "cannot split output dim 1.*Lengths "
                        "that change from batch to batch"):
                    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                              validation_data=validation())


class SignaturesTest(unittest.TestCase):
    @staticmethod
    def key(kind, *dims, padded=(None,)):
        return (kind, 8, "tree", tuple((d, "int32") for d in dims), padded)

    def test_second_length_relaxes_the_dims_that_differ(self):
        signatures, traced = varying_shapes.Signatures(), {}
        first = self.key("train", (5, 3))
        self.assertEqual(signatures.key_for(first, traced, False), first)
        traced[first] = "static"
        wide = signatures.key_for(self.key("train", (9, 3)), traced, False)
        self.assertEqual(varying_shapes.Signatures.dims(wide), ((None, 3),))
        traced[wide] = "relaxed"
        self.assertEqual(
            signatures.key_for(self.key("train", (12, 3)), traced, False),
            wide)
        self.assertEqual(signatures.key_for(first, traced, False), first)
        # Another kind is a family of its own.
        test = self.key("test", (9, 3))
        self.assertEqual(signatures.key_for(test, traced, False), test)
        # A dim that had not changed yet is relaxed too.
        wider = signatures.key_for(self.key("train", (4, 7)), traced, False)
        self.assertEqual(varying_shapes.Signatures.dims(wider),
                         ((None, None),))

    def test_small_padded_inputs_count_their_lengths(self):
        signatures, traced = varying_shapes.Signatures(), {}
        # An input of 8 x length values goes in padded, its shape a
        # Python value of the trace: no trace takes two lengths.
        for length in range(varying_shapes.MAX_STATIC_LENGTHS):
            key = self.key("train", (64,), padded=((8, length + 1),))
            self.assertEqual(signatures.key_for(key, traced, False), key)
            traced[key] = "static"
        with self.assertRaises(varying_shapes.TooManyLengths):
            signatures.key_for(self.key("train", (64,), padded=((8, 9),)),
                               traced, False)

    def test_static_steps_count_their_lengths(self):
        signatures, traced = varying_shapes.Signatures(), {}
        for length in range(varying_shapes.MAX_STATIC_LENGTHS):
            key = self.key("train", (length + 1,))
            self.assertEqual(signatures.key_for(key, traced, True), key)
            traced[key] = "static"
        # A length traced again (a retry) is not a new one.
        del traced[key]
        self.assertEqual(signatures.key_for(key, traced, True), key)
        with self.assertRaises(varying_shapes.TooManyLengths):
            signatures.key_for(self.key("train", (99,)), traced, True)


if __name__ == "__main__":
    unittest.main()
