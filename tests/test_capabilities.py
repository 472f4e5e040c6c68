"""The capability table against DTensor, and the probe for unlisted layers.

- Every Keras layer the table lists runs forward and backward on a
  2-device mesh with a split batch (declared non-batch splits are run
  and compared by `test_graph.DeclaredSplitsRunOnDTensorTest`).
- Every op the table runs replicated fails without DTensor's switch and
  runs with it: the table is exactly what this TensorFlow needs.
- Unlisted layers are probed once, cached on disk, and then train under
  a searched strategy equal to plain Keras, or, when DTensor cannot run
  them, train as plain Keras with a warning given before any step.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
import warnings
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

import flexflow_keras as fk
from flexflow_keras import capabilities, search_space
from flexflow_keras.capabilities import Probed
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.runtime import op_rules, probe
from flexflow_keras.strategy import ParallelConfig, Strategy

from test_own_step import train_both

L = keras.layers


def _zoo():
    """Keras layer name -> (layer factory, input shape without batch)."""
    image, seq, vol = (6, 6, 4), (6, 4), (4, 4, 4, 2)
    zoo = {
        "Dense": (lambda: L.Dense(4), seq),
        "EinsumDense": (lambda: L.EinsumDense("abc,cd->abd", (6, 3)), seq),
        "BatchNormalization": (L.BatchNormalization, image),
        "LayerNormalization": (L.LayerNormalization, seq),
        "Softmax": (L.Softmax, seq),
        "Dropout": (lambda: L.Dropout(0.5), seq),
        "Bidirectional": (lambda: L.Bidirectional(L.LSTM(3)), seq),
        "SimpleRNN": (lambda: L.SimpleRNN(3), seq),
        "GRU": (lambda: L.GRU(3, go_backwards=True), seq),
        "LSTM": (lambda: L.LSTM(3, return_sequences=True), seq),
        "Activation": (lambda: L.Activation("gelu"), seq),
        "ReLU": (L.ReLU, seq),
        "LeakyReLU": (L.LeakyReLU, seq),
        "ELU": (L.ELU, seq),
        "PReLU": (L.PReLU, seq),
        "Reshape": (lambda: L.Reshape((4, 6)), seq),
        "Flatten": (L.Flatten, seq),
        "Permute": (lambda: L.Permute((2, 1)), seq),
        "RepeatVector": (lambda: L.RepeatVector(3), (4,)),
        "Identity": (L.Identity, seq),
        "Rescaling": (lambda: L.Rescaling(0.5, 1.0), image),
        "GaussianNoise": (lambda: L.GaussianNoise(0.1), seq),
        "GaussianDropout": (lambda: L.GaussianDropout(0.1), seq),
        "SpatialDropout1D": (lambda: L.SpatialDropout1D(0.5), seq),
        "SpatialDropout2D": (lambda: L.SpatialDropout2D(0.5), image),
        "SpatialDropout3D": (lambda: L.SpatialDropout3D(0.5), vol),
        "Embedding": (lambda: L.Embedding(10, 4), (6,)),
        "Normalization": (lambda: _adapted(
            L.Normalization(), np.arange(48.0).reshape(2, 6, 4)), seq),
        "Discretization": (lambda: L.Discretization([0.0, 1.0]), seq),
        "CategoryEncoding": (lambda: L.CategoryEncoding(
            6, output_mode="multi_hot"), (3,)),
        "Hashing": (lambda: L.Hashing(8), (1,)),
    }
    for kind in ("Rotation", "Zoom", "Translation", "Shear"):
        args = {"Rotation": (0.2,), "Zoom": (0.2,), "Translation": (0.2, 0.2),
                "Shear": (0.2,)}[kind]
        zoo[f"Random{kind}"] = (
            lambda k=kind, a=args: getattr(L, f"Random{k}")(*a), image
        )
    shapes = {1: seq, 2: image, 3: vol}
    for n, shape in shapes.items():
        d = f"{n}D"
        zoo[f"Conv{d}"] = (lambda d=d: getattr(L, f"Conv{d}")(2, 3), shape)
        zoo[f"Conv{d}Transpose"] = (
            lambda d=d: getattr(L, f"Conv{d}Transpose")(2, 3), shape
        )
        for pool in ("MaxPooling", "AveragePooling"):
            zoo[f"{pool}{d}"] = (lambda p=pool, d=d: getattr(L, p + d)(2),
                                 shape)
            zoo[f"Global{pool}{d}"] = (
                lambda p=pool, d=d: getattr(L, f"Global{p}{d}")(), shape
            )
        for layer in ("ZeroPadding", "Cropping", "UpSampling"):
            zoo[f"{layer}{d}"] = (lambda c=layer, d=d: getattr(L, c + d)(1)
                                  if c != "UpSampling"
                                  else getattr(L, c + d)(2), shape)
        if n < 3:
            zoo[f"DepthwiseConv{d}"] = (
                lambda d=d: getattr(L, f"DepthwiseConv{d}")(3), shape
            )
            zoo[f"SeparableConv{d}"] = (
                lambda d=d: getattr(L, f"SeparableConv{d}")(2, 3), shape
            )
    return zoo


def _adapted(layer, data):
    layer.adapt(data)
    return layer


# Input dtypes of the zoo's layers that do not take floats.
DTYPES = {"Embedding": "int32", "CategoryEncoding": "int32",
          "Hashing": "int64"}


def _merge_zoo():
    return {
        name: getattr(L, name)
        for name in ("Add", "Subtract", "Multiply", "Average", "Maximum",
                     "Minimum", "Concatenate")
    }


ZOO = _zoo()
MERGES = _merge_zoo()


def _op_of(layer, shape, inputs=1):
    """The graph op of `layer` called on `inputs` Inputs of `shape`."""
    dtype = DTYPES.get(type(layer).__name__, "float32")
    xs = [keras.Input(shape, dtype=dtype) for _ in range(inputs)]
    if isinstance(layer, L.MultiHeadAttention):
        out = layer(xs[0], xs[-1])
    else:
        out = layer(xs if inputs > 1 else xs[0])
    graph = build_graph(keras.Model(xs, out), 4)
    return graph.ops[-1], graph


def _mesh():
    return dtensor.create_mesh(
        [("batch", 2)], devices=["CPU:0", "CPU:1"]
    )


def _run(op, graph, mesh, split=True):
    inputs = probe._probe_inputs(op, graph)
    probe._forward_backward(op, inputs, mesh, split=split)


def probes_without_switches():
    """Table layer with replicated ops -> what the probe finds it needs
    (run in a fresh process, where no switch is on yet)."""
    mesh = _mesh()
    found = {}
    for name, (make, shape) in ZOO.items():
        if capabilities.TABLE[name].replicated_ops:
            op, graph = _op_of(make(), shape)
            found[name] = probe.probe_op(op, graph, mesh).to_json()
    return found


class TableTest(unittest.TestCase):
    def test_every_listed_layer_is_probed_here_or_in_test_graph(self):
        listed = {n for n in capabilities.TABLE if hasattr(L, n)}
        # Those that cannot run: test_probe_safety (their op types).
        probed = set(ZOO) | set(MERGES) | {"MultiHeadAttention"} | {
            n for n, c in capabilities.TABLE.items() if c.error
        }
        self.assertEqual(listed - probed, set())

    def test_listed_layers_run_with_a_split_batch(self):
        op_rules.enable()  # as the runtime does
        mesh = _mesh()
        for name, (make, shape) in ZOO.items():
            with self.subTest(layer=name):
                op, graph = _op_of(make(), shape)
                self.assertIs(capabilities.listed(op.layer),
                              capabilities.TABLE[name])
                _run(op, graph, mesh)
        for name, make in MERGES.items():
            with self.subTest(layer=name):
                op, graph = _op_of(make(), (6, 4), inputs=2)
                _run(op, graph, mesh)
        op, graph = _op_of(L.MultiHeadAttention(2, 4), (6, 4), inputs=2)
        _run(op, graph, mesh)

    def test_replicated_ops_are_what_a_fresh_probe_needs(self):
        # DTensor keeps a switch on once read, so a fresh process probes
        # the table's replicated layers; then this one runs them.
        script = (
            "import json, os, sys; sys.path.insert(0, %r); "
            "import test_capabilities as t; "
            "print('RESULT', json.dumps(t.probes_without_switches()))"
        ) % os.path.dirname(os.path.abspath(__file__))
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("DTENSOR_ENABLE_REPLICATED")}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True,
            text=True, timeout=600,
        )
        lines = [line for line in done.stdout.splitlines()
                 if line.startswith("RESULT ")]
        self.assertTrue(lines, done.stderr[-3000:])
        found = json.loads(lines[-1][len("RESULT "):])
        op_rules.enable()
        mesh = _mesh()
        for name, (make, shape) in ZOO.items():
            needed = capabilities.TABLE[name].replicated_ops
            if not needed:
                continue
            with self.subTest(layer=name):
                self.assertEqual(found[name], {
                    "replicated_ops": sorted(needed), "error": None,
                    "splits_batch": True,
                })
                op, graph = _op_of(make(), shape)
                self.assertEqual(op.partitionable, {})  # runs replicated
                _run(op, graph, mesh)

    def test_weight_shard_axes_come_with_parameter_splits(self):
        op, _ = _op_of(L.Dense(4), (6, 4))
        self.assertEqual(op.partitionable,
                         {0: "sample", 1: "attribute", 2: "parameter"})
        self.assertEqual({w.shard_axis for w in op.weights}, {1, 0})

    def test_a_custom_class_named_like_a_keras_layer_is_unlisted(self):
        class Dense(L.Layer):
            def call(self, x):
                return x * 2.0

        self.assertIsNone(capabilities.listed(Dense()))
        self.assertIsNotNone(capabilities.listed(L.Dense(2)))


class Reverse(L.Layer):
    """Runs `tf.reverse` (`ReverseV2`: no DTensor rule) on its input."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return tf.reverse(x, axis=[1]) * self.scale


class Double(L.Layer):
    def call(self, x):
        return x * 2.0 + 1.0


class NumpyDouble(L.Layer):
    """Python inside the graph: DTensor cannot run it (it crashes)."""

    def call(self, x):
        y = tf.numpy_function(lambda a: a * 2, [x], tf.float32,
                              stateful=False)
        y.set_shape(x.shape)
        return y + x


class OnlyRealData(L.Layer):
    """Fails on the probe's zeros: the probe learns nothing."""

    def call(self, x):
        tf.debugging.assert_greater(x, 100.0)
        return x


class ProbeTest(unittest.TestCase):
    def probe(self, layer, shape=(6, 4)):
        op, graph = _op_of(layer, shape)
        return probe.probe_op(op, graph, _mesh())

    def test_op_without_rule_is_found_and_switched(self):
        found = self.probe(Reverse())
        self.assertEqual(found, Probed(("ReverseV2",)))
        self.assertTrue(found.replicated)
        self.assertEqual(os.environ.get(op_rules.switch("ReverseV2")), "1")

    def test_layer_that_runs_splits_its_batch(self):
        self.assertEqual(self.probe(Double()), Probed())

    def test_table_lookup_by_a_variable_index_splits_its_batch(self):
        # keras.io's Swin Transformer: DTensor gave the bias lookup the
        # split of the scores it is added to, which a gather cannot take
        # ("do not agree on non-axis dim 1"), and the layer ran whole.
        from test_layer_support import RelativePositionBias

        self.assertEqual(self.probe(RelativePositionBias(), (4, 4)),
                         Probed())

    def test_rolled_windows_split_their_batch(self):
        # keras.io's Swin Transformer shifts its windows by `ops.roll`;
        # DTensor has no rule for `Roll`, and the block ran whole.
        from test_layer_support import ShiftedWindows

        self.assertEqual(self.probe(ShiftedWindows(), (8, 8, 4)), Probed())

    def test_python_in_the_graph_is_unsupported_without_running_it(self):
        found = self.probe(NumpyDouble())
        self.assertRegex(found.error, "PyFuncStateless.*numpy_function")

    def test_layer_failing_on_probe_inputs_teaches_nothing(self):
        self.assertIsNone(self.probe(OnlyRealData()))

    def test_string_inputs_are_probed(self):
        class Length(L.Layer):
            def call(self, x):
                return tf.strings.length(x)

        x = keras.Input((1,), dtype="string")
        graph = build_graph(keras.Model(x, Length()(x)), 8)
        self.assertEqual(  # measured: StringLength needs both
            probe.probe_op(graph.ops[-1], graph, _mesh()),
            Probed(("StringLength",), splits_batch=False),
        )

    def test_apply_probes(self):
        x = keras.Input((6, 4))
        y = Double(name="double")(Reverse(name="rev")(x))
        graph = build_graph(keras.Model(x, y), 8)
        applied = capabilities.apply_probes(
            graph, {"rev": Probed(("ReverseV2",)), "double": Probed()}
        )
        self.assertEqual(applied.op("rev").partitionable, {})
        self.assertEqual(applied.op("double").partitionable,
                         graph.op("double").partitionable)
        with self.assertRaisesRegex(
            capabilities.Unsupported, "'double': it broke"
        ):
            capabilities.apply_probes(graph, {"double": Probed(
                error="it broke")})


class ProbeCacheTest(unittest.TestCase):
    def setUp(self):
        folder = tempfile.TemporaryDirectory()
        self.addCleanup(folder.cleanup)
        self.path = os.path.join(folder.name, "sub", "capabilities.json")
        x = keras.Input((6, 4))
        y = Reverse(name="rev")(L.Dense(4, name="dense")(x))
        self.graph = build_graph(keras.Model(x, y), 8)
        self.devices = ("CPU:0", "CPU:1")

    def test_probed_once_then_read_from_disk(self):
        first = probe.probe_graph(self.graph, self.devices, self.path)
        self.assertEqual(first.op("rev").partitionable, {})
        self.assertNotEqual(first.op("dense").partitionable, {})  # listed
        with mock.patch.object(probe, "probe_op",
                               side_effect=AssertionError("probed")):
            again = probe.probe_graph(self.graph, self.devices, self.path)
        self.assertEqual(again.op("rev").partitionable, {})

    def test_an_edited_layer_is_probed_again(self):
        """A user told that DTensor cannot run their layer rewrites its
        call and runs the script again: the layer, same class name and
        config, is probed again, not refused from the cache (the old
        error, naming a line no longer there). Unedited, it is read from
        the cache, as before."""
        source = textwrap.dedent("""
            import tensorflow as tf
            import keras

            class Edited(keras.layers.Layer):
                def call(self, x):
                    return CALL
        """)
        refused = "tf.ensure_shape(tf.numpy_function(lambda a: a * 2, " \
            "[x], tf.float32, stateful=False), x.shape) + x"

        from test_code_digest import defined_in_a_script

        def graph_of(call):
            edited = defined_in_a_script(source.replace("CALL", call))
            x = keras.Input((6, 4))
            return build_graph(keras.Model(x, edited(name="edited")(x)), 8)

        with self.assertRaisesRegex(capabilities.Unsupported, "edited"):
            probe.probe_graph(graph_of(refused), self.devices, self.path)
        with mock.patch.object(probe, "probe_op",
                               side_effect=AssertionError("probed")):
            with self.assertRaisesRegex(capabilities.Unsupported,
                                        "edited"):
                probe.probe_graph(graph_of(refused), self.devices,
                                  self.path)
        edited = probe.probe_graph(graph_of("x * 2.0 + 1.0"),
                                   self.devices, self.path)
        self.assertNotEqual(edited.op("edited").partitionable, {})

    def test_unreadable_cache_is_probed_again(self):
        os.makedirs(os.path.dirname(self.path))
        with open(self.path, "w") as f:
            f.write("{not json")
        probed = probe.probe_graph(self.graph, self.devices, self.path)
        self.assertEqual(probed.op("rev").partitionable, {})

    def test_one_device_probes_nothing(self):
        with mock.patch.object(probe, "probe_op",
                               side_effect=AssertionError("probed")):
            same = probe.probe_graph(self.graph, ("CPU:0",), self.path)
        self.assertIs(same, self.graph)


class ReplicatedOnTheMeshTest(unittest.TestCase):
    """An op that may split nothing stays in a one-mesh strategy."""

    def graph(self):
        x = keras.Input((8, 8, 3))
        h = L.Conv2D(4, 3, padding="same", name="conv")(x)
        h = L.AveragePooling2D(2, name="pool")(h)
        y = L.Dense(2, name="dense")(L.Flatten(name="flat")(h))
        return build_graph(keras.Model(x, y), 16)

    def test_one_mesh_configs_and_devices(self):
        graph = self.graph()
        self.assertEqual(
            search_space.one_mesh_configs(graph.op("pool"), 4),
            [ParallelConfig((1, 1, 1, 1), (0,))],
        )
        self.assertEqual(search_space.one_mesh_devices(graph, 4), 4)
        strategy = search_space.one_mesh_data_parallel(graph, 4)
        self.assertTrue(search_space.is_one_mesh(strategy))

    def test_is_one_mesh_needs_device_0_on_the_mesh(self):
        split = ParallelConfig((2, 1), (1, 2))
        whole = ParallelConfig((1, 1), (0,))
        self.assertTrue(search_space.is_one_mesh(Strategy({"a": split})))
        self.assertFalse(
            search_space.is_one_mesh(Strategy({"a": split, "b": whole}))
        )
        # "b" placed on device 3 alone is a placement, not a copy.
        on_three = ParallelConfig((1, 1), (3,))
        self.assertFalse(search_space.is_one_mesh(Strategy(
            {"a": ParallelConfig((2, 1), (0, 1)), "b": on_three}
        )))
        # (1, 2) is no row or column of it, nor of a mesh over (0, 1).
        self.assertFalse(search_space.is_one_mesh(Strategy(
            {"a": ParallelConfig((2, 1), (0, 1)),
             "b": ParallelConfig((2, 1), (1, 2))}
        )))

    def test_runtime_runs_it_replicated_on_the_mesh(self):
        from flexflow_keras import devices
        from flexflow_keras.runtime import layouts

        graph = self.graph()
        strategy = search_space.one_mesh_data_parallel(graph, 4)
        plans = layouts.plan_ops(
            graph, strategy, layouts.MeshCache(devices.device_names())
        )
        self.assertEqual(len({p.mesh for p in plans}), 1)
        pool = next(p for p in plans if p.op.name == "pool")
        self.assertEqual(pool.axes, {})


def build_reverse_model(mod):
    x = mod.Input((6, 4))
    h = mod.layers.Dense(8)(x)
    h = Reverse()(h)
    y = mod.layers.Dense(4)(mod.layers.Flatten()(h))
    model = mod.Model(x, y)
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    return model, (rng.normal(size=(64, 6, 4)).astype("float32"),
                   rng.normal(size=(64, 4)).astype("float32"))


class ProbedLayersTrainTest(unittest.TestCase):
    def test_layer_without_rule_trains_under_the_strategy(self):
        train_both(self, "reverse", build_reverse_model)

    def test_unsupported_layer_trains_as_plain_keras_before_any_step(self):
        x = fk.Input((6, 4))
        h = fk.layers.Flatten()(NumpyDouble()(x))
        model = fk.Model(x, fk.layers.Dense(2)(h))
        model.compile(optimizer="sgd", loss="mse", search_budget=0)
        data = np.ones((16, 6, 4), "float32"), np.ones((16, 2), "float32")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(*data, batch_size=8, verbose=0)
        messages = [str(w.message) for w in caught]
        self.assertTrue(any(
            "trains as plain Keras" in m and "numpy_function" in m
            for m in messages
        ), messages)
        self.assertIsNone(model.strategy_executor)


if __name__ == "__main__":
    unittest.main()
