"""No probe can take the process down (issue 21, item 3).

Measured on TF 2.21 CPU: DTensor raises "'tf.LookupTableFindV2' op does
not implement layout propagation" for a hash-table lookup (StringLookup,
IntegerLookup, TextVectorization, `tf.lookup`); with that op's
replicated switch on, which the probe used to turn on and run again,
the process dies of a segmentation fault. So crashing op types are
decided from the traced graph before anything runs on DTensor
(`capabilities.crashing_ops`), a crashing op's switch is never turned
on, and the lookup layers are listed as unable to run on DTensor. A
structured-data model that calls them on its raw inputs runs them on the
host before each step (`tests/test_host_prefix.py`) and trains under its
strategy; a lookup elsewhere makes the model train as plain Keras, with
one warning naming it.

The trainings run in a fresh process, so that a crash fails the test
instead of killing pytest.
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest
import warnings
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

import flexflow_keras as fk
from flexflow_keras import capabilities
from flexflow_keras.capabilities import Probed
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.runtime import op_rules, probe

L = keras.layers
ROWS, BATCH, EPOCHS = 64, 16, 2


# -- the reported model: dict inputs, preprocessing inside the model ---------


def structured_data(rows=ROWS):
    rng = np.random.default_rng(0)
    x = {
        "thal": rng.choice(["fixed", "normal", "reversible"],
                           size=(rows, 1)).astype(object),
        "sex": rng.integers(0, 2, size=(rows, 1)).astype("int64"),
        "cp": rng.integers(0, 5, size=(rows, 1)).astype("int64"),
        "age": rng.normal(50, 10, size=(rows, 1)).astype("float64"),
        "chol": rng.normal(240, 40, size=(rows, 1)).astype("float64"),
    }
    y = rng.integers(0, 2, size=(rows, 1)).astype("float32")
    return x, y


def build_structured(mod, lookups=True):
    """The keras.io structured-data classifier: StringLookup and
    IntegerLookup (one-hot) and adapted Normalization inside the model
    (`lookups=False`: Normalization only), concatenated, Dense, Dropout,
    Dense(1, sigmoid)."""
    x, _ = structured_data()
    names = ("thal", "sex", "cp", "age", "chol") if lookups else (
        "age", "chol")
    inputs, features = {}, []
    for name in names:
        dtype = {"thal": "string", "sex": "int64", "cp": "int64"}.get(
            name, "float64")
        inputs[name] = mod.Input((1,), dtype=dtype, name=name)
        if name == "thal":
            layer = mod.layers.StringLookup(output_mode="one_hot",
                                            name="lookup_thal")
        elif dtype == "int64":
            layer = mod.layers.IntegerLookup(output_mode="one_hot",
                                             name=f"lookup_{name}")
        else:
            layer = mod.layers.Normalization(name=f"norm_{name}")
        layer.adapt(x[name] if dtype != "string" else x[name][:, 0])
        features.append(mod.ops.cast(layer(inputs[name]), "float32"))
    h = mod.layers.concatenate(features)
    h = mod.layers.Dense(8, activation="relu")(h)
    h = mod.layers.Dropout(0.5)(h)
    model = mod.Model(inputs, mod.layers.Dense(1, activation="sigmoid")(h))
    return model


def _dataset(names):
    x, y = structured_data()
    x = {k: v for k, v in x.items() if k in names}
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def train_structured(lookups):
    """Plain Keras and flexflow_keras, same seeds, `EPOCHS` from tf.data:
    their histories, the plain-Keras warnings, and whether a strategy
    trained it."""
    histories = {}
    for name, mod in (("plain", keras), ("ours", fk)):
        keras.utils.set_random_seed(7)
        model = build_structured(mod, lookups)
        kwargs = {} if mod is keras else {"search_budget": 0}
        model.compile(optimizer="adam", loss="binary_crossentropy",
                      **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(_dataset(model.input), epochs=EPOCHS,
                                verbose=0).history
        histories[name] = history["loss"]
    return {
        "plain": histories["plain"], "ours": histories["ours"],
        "warnings": [str(w.message) for w in caught
                     if "plain Keras" in str(w.message)],
        "strategy": model.strategy_executor is not None,
    }


def run_fresh(call):
    """`call` (code on this module, `t`) in a fresh Python: its JSON
    result, or the test's failure with the process's exit status (a
    crash is a failure, not a dead pytest)."""
    folder = tempfile.mkdtemp()
    script = (
        "import json, sys; sys.path.insert(0, %r); "
        "import test_probe_safety as t; from flexflow_keras.runtime import "
        "probe; probe.DEFAULT_CACHE_PATH = %r; "
        "print('RESULT', json.dumps(%s))"
    ) % (os.path.dirname(os.path.abspath(__file__)),
         os.path.join(folder, "capabilities.json"), call)
    env = dict(os.environ, FLEXFLOW_KERAS_CPU_DEVICES="4",
               TF_CPP_MIN_LOG_LEVEL="2")
    env = {k: v for k, v in env.items()
           if not k.startswith("DTENSOR_ENABLE_REPLICATED")}
    done = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines()
             if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise AssertionError(
            f"exit status {done.returncode}:\n{done.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT "):])


class StructuredDataTrainsTest(unittest.TestCase):
    def test_lookup_layers_on_inputs_run_on_the_host(self):
        found = run_fresh("t.train_structured(True)")
        self.assertTrue(found["strategy"])
        self.assertEqual(found["warnings"], [])
        self.assertEqual(len(found["ours"]), EPOCHS)
        np.testing.assert_allclose(found["ours"], found["plain"], rtol=1e-5)

    def test_normalization_of_float64_inputs_trains_under_a_strategy(self):
        found = run_fresh("t.train_structured(False)")
        self.assertTrue(found["strategy"])
        self.assertEqual(found["warnings"], [])
        np.testing.assert_allclose(found["ours"], found["plain"], rtol=1e-5)


# -- the op-type rule --------------------------------------------------------


def _mesh():
    return dtensor.create_mesh([("batch", 2)], devices=["CPU:0", "CPU:1"])


def _op_of(layer, shape, dtype):
    x = keras.Input(shape, dtype=dtype)
    graph = build_graph(keras.Model(x, layer(x)), 4)
    return graph.ops[-1], graph


class TableLookup(L.Layer):
    """A script's own layer looking its inputs up in a `tf.lookup`
    table (LookupTableFindV2, like IntegerLookup)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant([0, 1], tf.int64), tf.constant([1.0, 2.0])
            ), 0.0,
        )

    def call(self, x):
        return self.table.lookup(x)


def _adapted(layer, data):
    layer.adapt(data)
    return layer


# Keras layers the table lists as unable to run: (factory, shape, dtype).
CANNOT_RUN = {
    "StringLookup": (lambda: _adapted(L.StringLookup(output_mode="one_hot"),
                                      np.array(["a", "b"])), (1,), "string"),
    "IntegerLookup": (lambda: _adapted(L.IntegerLookup(),
                                       np.array([1, 2], "int64")),
                      (1,), "int64"),
    "TextVectorization": (
        lambda: _adapted(L.TextVectorization(max_tokens=8,
                                             output_sequence_length=3),
                         np.array(["a b", "b c"])), (1,), "string"),
}


class OpTypeRuleTest(unittest.TestCase):
    def test_crashing_ops(self):
        self.assertEqual(
            capabilities.crashing_ops(
                {"MatMul", "LookupTableFindV2", "PyFunc",
                 "LookupTableSizeV2", "StringToHashBucketFast"}
            ),
            ("LookupTableFindV2", "LookupTableSizeV2", "PyFunc"),
        )
        self.assertEqual(capabilities.crashing_ops({"MatMul"}), ())

    def _probe_without_dtensor(self, op, graph):
        """`probe_op`, failing if it runs anything on the mesh."""
        real = probe._forward_backward

        def plain_only(op, inputs, mesh, split=True, run=True):
            self.assertIsNone(mesh, "ran on DTensor")
            return real(op, inputs, mesh, split, run)

        with mock.patch.object(probe, "_forward_backward", plain_only):
            return probe.probe_op(op, graph, _mesh())

    def test_own_table_lookup_is_refused_before_running(self):
        op, graph = _op_of(TableLookup(), (1,), "int64")
        self.assertTrue(probe.needs_probe(op))
        found = self._probe_without_dtensor(op, graph)
        self.assertRegex(found.error, "hash table.*LookupTableFindV2")

    def test_listed_lookup_layers_are_what_their_op_types_say(self):
        for name, (make, shape, dtype) in CANNOT_RUN.items():
            with self.subTest(layer=name):
                op, graph = _op_of(make(), shape, dtype)
                self.assertIn("LookupTableFindV2",
                              capabilities.listed(op.layer).error)
                self.assertFalse(probe.needs_probe(op))
                found = self._probe_without_dtensor(op, graph)
                self.assertRegex(found.error, "LookupTableFindV2")

    def test_hashed_crossing_does_not_run_even_replicated(self):
        # Its ops do not crash DTensor (measured), so the probe runs them.
        a, b = (keras.Input((1,), dtype="int64") for _ in range(2))
        layer = L.HashedCrossing(num_bins=8)
        graph = build_graph(keras.Model([a, b], layer((a, b))), 4)
        self.assertIsNotNone(capabilities.listed(layer).error)
        found = probe.probe_op(graph.ops[-1], graph, _mesh())
        self.assertRegex(found.error, "SparseToDense")

    def test_listed_lookup_layer_is_unsupported_without_probing(self):
        # Not on a model input, so not run on the host either.
        x = keras.Input((1,), dtype="int64")
        h = L.IntegerLookup(vocabulary=[1, 2], output_mode="one_hot",
                            name="ids")(keras.ops.add(x, 1))
        graph = build_graph(keras.Model(x, L.Dense(2)(h)), 8)
        with mock.patch.object(probe, "probe_op",
                               side_effect=AssertionError("probed")):
            with self.assertRaisesRegex(capabilities.Unsupported,
                                        "'ids': .*hash table"):
                probe.probe_graph(graph, ("CPU:0", "CPU:1"),
                                  os.path.join(tempfile.mkdtemp(), "c"))

    def test_a_crashing_op_named_missing_is_never_switched_on(self):
        op, graph = _op_of(TableLookup(), (1,), "int64")
        missing = RuntimeError(
            "error: 'tf.LookupTableSizeV2' op does not implement layout "
            "propagation"
        )

        def fake(op, inputs, mesh, split=True, run=True):
            if mesh is not None:
                raise missing
            return frozenset({"Identity"})

        with mock.patch.object(probe, "_forward_backward", fake):
            found = probe.probe_op(op, graph, _mesh())
        self.assertRegex(found.error, "LookupTableSizeV2")
        self.assertNotIn(op_rules.switch("LookupTableSizeV2"), os.environ)

    def test_string_inputs_are_probed(self):
        op, graph = _op_of(L.Hashing(num_bins=4), (1,), "string")
        self.assertEqual(probe.probe_op(op, graph, _mesh()), Probed())

    def test_normalization_constants_are_replicated_in_the_probe(self):
        layer = _adapted(L.Normalization(),
                         np.arange(12.0).reshape(4, 3))
        op, graph = _op_of(layer, (3,), "float64")
        self.assertEqual(probe.probe_op(op, graph, _mesh()), Probed())


if __name__ == "__main__":
    unittest.main()
