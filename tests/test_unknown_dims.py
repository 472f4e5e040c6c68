"""Models whose Keras graph leaves dims unknown beyond the batch are
planned on static shapes and train under their strategy, equal to plain
Keras (each stopped at planning: "... has an unknown dimension; the
search needs static shapes"):
- nested models on variable-length inputs (`keras.Input((None,))`,
  keras.io's encoder-decoder Transformer): walked on the shapes `fit`
  feeds (`keras_graph._on_call_shapes`);
- a layer of the user's reshaping to `(B, -1, d)` with `B` the dynamic
  batch (keras.io's EANet's `PatchExtract`): shaped again with the batch
  known (`keras_graph._specs_on`);
- a layer whose own `compute_output_shape` leaves a dim unknown that its
  call computes (`EinsumDense(..., output_shape=(None, d))`, as Keras's
  docs write it): shaped by tracing its call (`_specs_on`).
- inputs whose length fit's data leaves unknown too (a dataset's
  element spec): `varying` dims (tests/test_varying_lengths.py).
A length only known at run time (a window drawn each step) trains as
plain Keras with one warning, as the script would without the package;
it crashed the script.
"""

import unittest
import warnings

import keras
import numpy as np
import tensorflow as tf

import flexflow_keras as fk
from flexflow_keras.keras_graph import VARYING_DIM_SIZE

from runtime_support import (
    assert_not_handed_over, assert_own_step_under_strategy, assert_same_fits,
    assert_same_runs, train_plain_and_ours,
)

ROWS, BATCH, LENGTH, VOCAB = 64, 16, 6, 30


def build(mod):
    """An encoder and a decoder model, each on `Input((None,))` tokens,
    called by an outer model whose inputs are variable-length too (the
    decoder's second input a sequence of the encoder's features)."""
    tokens = mod.Input((None,), dtype="int64", name="enc_tokens")
    h = mod.layers.Embedding(VOCAB, 8, name="enc_emb")(tokens)
    h = mod.layers.Dense(8, activation="relu", name="enc_dense")(h)
    encoder = mod.Model(tokens, h, name="encoder")

    dec_tokens = mod.Input((None,), dtype="int64", name="dec_tokens")
    features = mod.Input((None, 8), name="features")
    d = mod.layers.Embedding(VOCAB, 8, name="dec_emb")(dec_tokens)
    d = mod.layers.Attention(name="cross")([d, features])
    d = mod.layers.Dense(VOCAB, name="dec_out")(d)
    decoder = mod.Model([dec_tokens, features], d, name="decoder")

    enc_in = mod.Input((None,), dtype="int64", name="source")
    dec_in = mod.Input((None,), dtype="int64", name="target")
    outputs = decoder([dec_in, encoder(enc_in)])
    model = mod.Model({"source": enc_in, "target": dec_in}, outputs)
    options = {"search_budget": 50} if mod is fk else {}
    model.compile(optimizer="rmsprop",
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), **options)
    return model


def data():
    rng = np.random.default_rng(0)
    source = rng.integers(1, VOCAB, (ROWS, LENGTH))
    target = rng.integers(1, VOCAB, (ROWS, LENGTH))
    return {"source": source, "target": target}, np.roll(target, -1, 1)


def compiled_classifier(mod, model):
    """`model` compiled on logits of integer classes (searched briefly)."""
    options = {"search_budget": 50} if mod is fk else {}
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), **options)
    return model


def build_patches(mod):
    """keras.io EANet's `PatchExtract` (its output (None, None, 12) in
    Keras's graph), a Dense on the patches, a classifier."""

    class PatchExtract(mod.layers.Layer):
        def __init__(self, patch_size, **kwargs):
            super().__init__(**kwargs)
            self.patch_size = patch_size

        def call(self, x):
            batch, channels = mod.ops.shape(x)[0], mod.ops.shape(x)[-1]
            x = mod.ops.image.extract_patches(x, self.patch_size)
            return mod.ops.reshape(
                x, (batch, -1, self.patch_size ** 2 * channels))

    images = mod.Input((8, 8, 3), name="images")
    h = PatchExtract(2, name="patches")(images)
    h = mod.layers.Dense(8, activation="relu", name="embed")(h)
    h = mod.layers.GlobalAveragePooling1D(name="pool")(h)
    model = mod.Model(images, mod.layers.Dense(4, name="out")(h))
    return compiled_classifier(mod, model)


def build_window(mod):
    """A window of a run-time-drawn length: no static shape at all."""

    class Window(mod.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed = keras.random.SeedGenerator(2)

        def call(self, x):
            stop = keras.ops.cast(
                keras.random.uniform((), 2, 6.0, seed=self.seed), "int32")
            return x[:, :stop, :]

    steps = mod.Input((8, 3))
    h = Window(name="window")(steps)
    h = mod.layers.Dense(5, name="d")(h)
    h = mod.layers.GlobalAveragePooling1D()(h)
    model = mod.Model(steps, mod.layers.Dense(1, name="out")(h))
    options = {"search_budget": 0} if mod is fk else {}
    model.compile(optimizer="sgd", loss="mse", **options)
    return model


def build_einsum(mod):
    """`EinsumDense` as Keras's docs write it, `output_shape=(None, d)`:
    Keras's graph leaves the sequence dim unknown on a fixed-length
    input. Dropout between, a second one on its output."""
    steps = mod.Input((LENGTH, 8))
    h = mod.layers.EinsumDense("btd,de->bte", output_shape=(None, 12),
                               bias_axes="e", activation="relu",
                               name="einsum")(steps)
    h = mod.layers.Dropout(0.25, seed=3, name="drop")(h)
    h = mod.layers.EinsumDense("bte,ef->btf", output_shape=(None, 4),
                               name="einsum_out")(h)
    h = mod.layers.GlobalAveragePooling1D(name="pool")(h)
    model = mod.Model(steps, mod.layers.Dense(3, name="out")(h))
    return compiled_classifier(mod, model)


def build_labelled(mod):
    """keras.io's captcha OCR, small: the labels are a second model input,
    `keras.Input((None,))`, that only a loss layer reads (`add_loss`),
    fed from a dataset that splits label strings into characters, so
    its element spec leaves their length unknown (`(None, None)`)."""
    class SequenceLoss(mod.layers.Layer):
        def call(self, labels, predictions):
            self.add_loss(tf.reduce_mean(tf.square(
                labels - tf.reduce_sum(predictions, axis=-1))))
            return predictions

    image = mod.Input((4, 6), name="image")
    labels = mod.Input((None,), name="label")
    h = mod.layers.Dense(8, activation="relu", name="hidden")(image)
    h = mod.layers.Dense(3, name="per_char")(h)
    outputs = SequenceLoss(name="loss_layer")(labels, h)
    model = mod.Model([image, labels], outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    return model


def labelled_dataset(shuffle=False):
    rng = np.random.default_rng(2)
    images = rng.random((ROWS, 4, 6)).astype("float32")
    texts = np.array(["".join(str(d) for d in rng.integers(0, 10, 4))
                      for _ in range(ROWS)])
    data = tf.data.Dataset.from_tensor_slices((images, texts))
    if shuffle:
        data = data.shuffle(ROWS, seed=4)
    return data.map(lambda image, text: {
        "image": image,
        "label": tf.strings.to_number(tf.strings.unicode_split(text, "UTF-8")),
    }).batch(BATCH)


class UnknownDimsTest(unittest.TestCase):
    def test_run_time_length_trains_as_plain_keras_with_a_warning(self):
        rng = np.random.default_rng(0)
        x = rng.random((ROWS, 8, 3)).astype("float32")
        y = x.sum(axis=(1, 2))[:, None]
        losses, caught = [], None
        for mod in (keras, fk):
            keras.utils.set_random_seed(1)
            model = build_window(mod)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses.append(model.fit(x, y, batch_size=BATCH, epochs=2,
                                        shuffle=False, verbose=0)
                              .history["loss"])
        plain = [str(w.message) for w in caught
                 if "trains as plain Keras" in str(w.message)]
        self.assertEqual(len(plain), 1, plain)
        self.assertIn("'window' has an unknown dimension", plain[0])
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


    def test_reshape_to_the_dynamic_batch_is_planned_on_static_shapes(self):
        rng = np.random.default_rng(0)
        x = rng.random((ROWS, 8, 8, 3)).astype("float32")
        y = rng.integers(0, 4, ROWS)
        runs = train_plain_and_ours(
            build_patches, 5, lambda model: model.fit(
                x, y, batch_size=BATCH, epochs=2, shuffle=False,
                verbose=0).history)
        assert_own_step_under_strategy(self, runs)
        ours = runs["ours"][0]
        self.assertEqual(tuple(ours.get_layer("patches").output.shape),
                         (None, None, 12))  # Keras's own graph
        graph = ours.plan.graph
        self.assertEqual(graph.op("patches").output_shapes, ((BATCH, 16, 12),))
        self.assertEqual(graph.op("embed").output_shapes, ((BATCH, 16, 8),))
        assert_same_fits(self, {k: r[1] for k, r in runs.items()},
                         {k: r[0] for k, r in runs.items()})


    def test_output_shape_its_layer_leaves_unknown_is_traced(self):
        """It trained as plain Keras on one device: "Tensor of 'einsum'
        has an unknown dimension"."""
        rng = np.random.default_rng(0)
        x = rng.normal(size=(ROWS, LENGTH, 8)).astype("float32")
        y = rng.integers(0, 3, ROWS)
        runs = train_plain_and_ours(
            build_einsum, 5, lambda model: model.fit(
                x, y, batch_size=BATCH, epochs=2, shuffle=False,
                validation_split=0.25, verbose=0).history)
        ours = runs["ours"][0]
        assert_not_handed_over(self, runs["ours"][2], runs["ours"][2])
        self.assertIsNotNone(ours.strategy_executor)
        self.assertEqual(tuple(ours.get_layer("einsum").output.shape),
                         (None, None, 12))  # Keras's own graph
        graph = ours.plan.graph
        self.assertEqual(graph.op("einsum").output_shapes,
                         ((BATCH, LENGTH, 12),))
        self.assertEqual(graph.op("einsum_out").output_shapes,
                         ((BATCH, LENGTH, 4),))
        assert_same_runs(self, runs)

    def test_dataset_of_unknown_lengths_plans_them_as_varying(self):
        """The element spec leaves the labels' length unknown: it is
        planned at `VARYING_DIM_SIZE`, never split, and the dataset is
        not read ahead, shuffling or not (it trained as plain Keras:
        "Tensor of 'label' has an unknown dimension"; a peek of a
        shuffling dataset would change every epoch's order)."""
        self.assertEqual(labelled_dataset().element_spec["label"].shape,
                         (None, None))
        for shuffle in (False, True):
            with self.subTest(shuffle=shuffle):
                runs = train_plain_and_ours(
                    build_labelled, 5, lambda model: model.fit(
                        labelled_dataset(shuffle), epochs=2,
                        verbose=0).history)
                assert_own_step_under_strategy(self, runs)
                label = runs["ours"][0].plan.graph.tensors["label"]
                self.assertEqual(label.shape, (BATCH, VARYING_DIM_SIZE))
                self.assertEqual(label.varying, (1,))
                assert_same_fits(self, {k: r[1] for k, r in runs.items()},
                                 {k: r[0] for k, r in runs.items()})

    def test_nested_models_on_variable_length_inputs(self):
        x, y = data()
        runs = train_plain_and_ours(
            build, 5, lambda model: model.fit(
                x, y, batch_size=BATCH, epochs=2, shuffle=False,
                verbose=0).history)
        assert_own_step_under_strategy(self, runs)
        # Nor a warning about the names of the trace's own inputs.
        messages = runs["ours"][2]
        self.assertFalse([m for m in messages if "as a dict" in m],
                         messages)
        graph = runs["ours"][0].plan.graph
        # The nested models' layers are ops, on the fed shapes.
        self.assertEqual(graph.op("encoder/enc_emb").output_shapes[0],
                         (BATCH, LENGTH, 8))
        self.assertEqual(graph.op("decoder/dec_out").output_shapes[0],
                         (BATCH, LENGTH, VOCAB))
        assert_same_fits(self, {k: r[1] for k, r in runs.items()},
                         {k: r[0] for k, r in runs.items()})


if __name__ == "__main__":
    unittest.main()
