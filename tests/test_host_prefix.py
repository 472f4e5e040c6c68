"""Lookup layers on raw features run on the host before each step.

A StringLookup, IntegerLookup, TextVectorization or HashedCrossing
cannot run on DTensor (its hash table crashes it). Called on the
model's own inputs, as keras.io's structured-data scripts do, it runs on
the host (`runtime/host_prefix.py`, `keras_graph.hosted_nodes`) and the
rest of the model trains under its strategy, equal to plain Keras.
Elsewhere the model still trains as plain Keras, saying why.
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
from flexflow_keras.planner import _one_mesh_reason
from flexflow_keras.report import strategy_table
from flexflow_keras.runtime.model_step import ModelStepExecutor
from flexflow_keras.strategy_files import save_strategy
from runtime_support import parameter

ROWS, BATCH, EPOCHS = 96, 16, 2
WORDS = "good bad fine poor great awful ok meh".split()


def _features(rows=ROWS, seed=0):
    """Scalar features per row, as a DataFrame's columns come
    (`tf.data.Dataset.from_tensor_slices(dict(df))`)."""
    rng = np.random.default_rng(seed)
    return {
        "sex": rng.integers(0, 2, rows).astype("int64"),
        "thal": rng.choice(["fixed", "normal", "reversible"], rows),
        "age": rng.normal(50, 10, rows).astype("float32"),
        "review": np.array([" ".join(rng.choice(WORDS, 4))
                            for _ in range(rows)]),
        "code": rng.choice(["fixed", "normal", "reversible"], rows),
    }, rng.integers(0, 2, rows).astype("float32")


def _adapt(layer, values):
    layer.adapt(np.reshape(values, (-1, 1)) if values.dtype.kind != "U"
                else values)
    return layer


def build(mod, text=False, own_step=False, shared=False, step=None):
    """The keras.io structured-data classifier (IntegerLookup and
    StringLookup on raw features, adapted Normalization, concatenate,
    Dense with an L2 regularizer, Dropout, sigmoid); `text` adds a
    TextVectorization -> masked Embedding -> pooling branch, `shared` a
    scalar string feature expanded and looked up by the same
    StringLookup (keras.io's wide-and-deep script), `own_step` a class
    whose `train_step` is the user's own (`step(model, x)`: what it
    calls the model on, else `x`)."""
    x, _ = _features()
    inputs = {
        "sex": mod.Input((1,), dtype="int64", name="sex"),
        "thal": mod.Input((1,), dtype="string", name="thal"),
        "age": mod.Input((1,), name="age"),
    }
    lookup_thal = _adapt(mod.layers.StringLookup(output_mode="binary",
                                                 name="lookup_thal"),
                         x["thal"])
    parts = [
        _adapt(mod.layers.IntegerLookup(output_mode="one_hot",
                                        name="lookup_sex"),
               x["sex"])(inputs["sex"]),
        lookup_thal(inputs["thal"]),
        _adapt(mod.layers.Normalization(name="norm_age"),
               x["age"])(inputs["age"]),
    ]
    if shared:
        inputs["code"] = mod.Input((), dtype="string", name="code")
        parts.append(lookup_thal(mod.ops.expand_dims(inputs["code"], -1)))
    if text:
        inputs["review"] = mod.Input((1,), dtype="string", name="review")
        vectorize = mod.layers.TextVectorization(
            max_tokens=12, output_sequence_length=6, name="vectorize")
        vectorize.adapt(x["review"])
        h = vectorize(inputs["review"])
        h = mod.layers.Embedding(12, 4, mask_zero=True)(h)
        parts.append(mod.layers.GlobalAveragePooling1D()(h))
    h = mod.layers.concatenate(parts)
    h = mod.layers.Dense(16, activation="relu",
                         kernel_regularizer=mod.regularizers.L2(1e-3))(h)
    h = mod.layers.Dropout(0.3)(h)
    outputs = mod.layers.Dense(1, activation="sigmoid")(h)
    if not own_step:
        return mod.Model(inputs, outputs)

    class OwnStep(mod.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x if step is None else step(x), training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return OwnStep(inputs, outputs)


def _dataset(names, start, stop):
    x, y = _features()
    x = {k: v[start:stop] for k, v in x.items() if k in names}
    return tf.data.Dataset.from_tensor_slices((x, y[start:stop])).batch(
        BATCH)


def fit_both(test, text=False, own_step=False, strategy=None,
             shared=False, step=None):
    """Plain Keras and flexflow_keras from the same seed on the same
    datasets (with validation), then `predict` on a dict of tensors:
    asserts equal histories, weights and predictions; unless `step`
    (which makes the model fall back), no fallback and a DTensor
    strategy over several devices. Returns our model and the
    plain-Keras warnings."""
    models, histories, predictions = {}, {}, {}
    names = ("sex", "thal", "age") + (("review",) if text else ()) + (
        ("code",) if shared else ())
    x, _ = _features(8, seed=1)
    x = {k: tf.convert_to_tensor(v) for k, v in x.items() if k in names}
    with tempfile.TemporaryDirectory() as folder:
        for name, mod in (("plain", keras), ("ours", fk)):
            keras.utils.set_random_seed(7)
            model = build(mod, text, own_step, shared, step)
            options = {}
            if mod is fk:
                options = {"search_budget": 30, "search_seed": 0}
                if strategy is not None:
                    path = os.path.join(folder, "strategy.txt")
                    save_strategy(strategy(build_graph(model, BATCH)), path)
                    options = {"import_strategy": path}
            model.compile(optimizer="adam", loss="binary_crossentropy",
                          metrics=["accuracy"], **options)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                histories[name] = model.fit(
                    _dataset(names, 0, 64), epochs=EPOCHS, verbose=0,
                    validation_data=_dataset(names, 64, ROWS),
                ).history
                predictions[name] = model.predict(x, verbose=0)
            models[name] = model
    ours = models["ours"]
    fallbacks = [str(w.message) for w in caught
                 if "plain Keras" in str(w.message)]
    if step is None:
        test.assertEqual(fallbacks, [])
        test.assertIsInstance(ours.strategy_executor, ModelStepExecutor)
        devices = {d for c in ours.strategy.values() for d in c.device_ids}
        test.assertGreater(len(devices), 1, ours.strategy)
    test.assertEqual(set(histories["ours"]), set(histories["plain"]))
    for key, values in histories["plain"].items():
        np.testing.assert_allclose(histories["ours"][key], values,
                                   rtol=1e-5, err_msg=key)
    for a, b in zip(models["plain"].get_weights(), ours.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(predictions["ours"], predictions["plain"],
                               rtol=1e-5, atol=1e-7)
    return ours, fallbacks


class HostedGraphTest(unittest.TestCase):
    def test_lookups_on_inputs_leave_the_graph_as_step_inputs(self):
        graph = build_graph(build(keras, text=True), BATCH)
        names = {op.name for op in graph}
        for layer in ("lookup_sex", "lookup_thal", "vectorize"):
            self.assertNotIn(layer, names)
            self.assertIn(f"{layer}:0", graph.inputs)
            self.assertEqual(graph.tensors[f"{layer}:0"].hosted_by, layer)
        # A raw input only a lookup reads is not the step's.
        self.assertEqual(
            [t for t in graph.inputs if not graph.tensors[t].hosted_by],
            ["age"],
        )
        self.assertEqual(graph.tensors["vectorize:0"].shape, (BATCH, 6))
        self.assertEqual(graph.tensors["vectorize:0"].dtype, "int64")
        self.assertRegex(_one_mesh_reason(graph), "run on the host")
        table = strategy_table(graph, parameter(graph), {})
        self.assertRegex(table, r"lookup_thal \(before the step\)\s+"
                                r"\(16, 4\)\s+none\s+host")

    def test_other_lookup_calls_stay_ops_and_are_refused(self):
        x = keras.Input((1,), dtype="int64")
        shared = keras.layers.IntegerLookup(vocabulary=[1, 2], name="twice")
        after_op = keras.layers.IntegerLookup(vocabulary=[2, 3],
                                              name="after_op")
        as_output = keras.layers.IntegerLookup(vocabulary=[1, 2],
                                               name="as_output")
        h = keras.ops.concatenate(
            [shared(x), shared(keras.ops.reshape(x, (-1, 1))),
             after_op(keras.ops.add(x, 1))], axis=-1)
        model = keras.Model(
            x, [keras.layers.Dense(1)(keras.ops.cast(h, "float32")),
                as_output(x)])
        graph = build_graph(model, BATCH)
        # A shared lookup's calls and a reshape before one run on the
        # host; the reshape's result, which only the host reads, is not
        # an input of the step.
        self.assertEqual(
            [graph.tensors[t].hosted_by for t in graph.inputs
             if graph.tensors[t].hosted_by],
            ["twice", "twice#1"])
        self.assertNotIn("reshape", {op.name for op in graph})
        refused = capabilities.cannot_run(graph)
        self.assertEqual(sorted(refused), ["after_op", "as_output"])
        self.assertIn("runs on the host before each step instead only "
                      "where it takes the model's own inputs",
                      refused["after_op"])


class HostedTrainingTest(unittest.TestCase):
    def test_searched_strategy(self):
        fit_both(self)

    def test_text_and_own_train_step_under_parameter_splits(self):
        ours, _ = fit_both(self, text=True, own_step=True,
                           strategy=parameter)
        dense = [c for name, c in ours.strategy.items()
                 if name.startswith("dense") and max(c.dims[1:]) > 1]
        self.assertTrue(dense, ours.strategy)

    def test_shared_lookup_on_a_reshaped_input(self):
        fit_both(self, shared=True, own_step=True)

    def test_a_step_calling_the_model_on_other_data_trains_as_keras(self):
        # The user's step flips a feature before calling the model: the
        # lookup's hosted result (of the batch as it came) would be wrong.
        def flipped(x):
            return {**x, "sex": 1 - x["sex"]}

        ours, fallbacks = fit_both(self, own_step=True, step=flipped)
        self.assertIsNone(ours.strategy_executor)
        self.assertEqual(len(fallbacks), 1, fallbacks)
        self.assertIn("'lookup_sex' (IntegerLookup) runs on the host",
                      fallbacks[0])


if __name__ == "__main__":
    unittest.main()
