"""compile()/fit() wiring: planning, flags, import/export, summary."""

import contextlib
import io
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

import flexflow_keras
from flexflow_keras import (
    Model, Sequential, keras_graph, layers, strategy_files,
)
from flexflow_keras.runtime import model_step
from flexflow_keras.strategy import ParallelConfig, Strategy
from runtime_support import assert_not_handed_over, on_one_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_mlp(seed: int = 0) -> Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,), name="x")
    h = layers.Dense(16, activation="relu", name="hidden")(inputs)
    return Model(inputs, layers.Dense(4, name="out")(h), name="small")


def data(samples: int = 64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 8)).astype("float32")
    y = rng.normal(size=(samples, 4)).astype("float32")
    return x, y


class CompilePlanTest(unittest.TestCase):
    def test_compile_with_batch_size_searches_now(self):
        model = small_mlp()
        model.compile("sgd", "mse", batch_size=16, search_budget=50,
                      search_seed=0)
        self.assertEqual(model.plan.source, "search")
        self.assertEqual(model.plan.graph.batch_size, 16)
        self.assertEqual(set(model.strategy), {"hidden", "out"})
        self.assertEqual(model.plan.search_result.iterations, 50)

    def test_plan_waits_for_fit_batch_size(self):
        model = small_mlp()
        model.compile("sgd", "mse", search_budget=0)
        self.assertIsNone(model.strategy)
        x, y = data()
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assertEqual(model.plan.graph.batch_size, 8)
        self.assertEqual(model.plan.source, "data_parallel")
        self.assertEqual(
            model.strategy, Strategy.data_parallel(model.plan.graph, 4)
        )

    def test_zero_budget_is_data_parallel(self):
        model = small_mlp()
        model.compile("sgd", "mse", batch_size=16, search_budget=0)
        self.assertEqual(model.strategy["hidden"].dims, (4, 1))

    def test_export_then_import_skips_search(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "s.txt")
            first = small_mlp()
            first.compile("sgd", "mse", batch_size=16, search_budget=100,
                          search_seed=1, export_strategy=path)
            second = small_mlp()
            second.compile("sgd", "mse", batch_size=16, import_strategy=path,
                           search_budget=100)
            self.assertEqual(second.plan.source, "import")
            self.assertIsNone(second.plan.search_result)
            self.assertEqual(second.strategy, first.strategy)

    def test_imported_strategy_is_what_fit_runs(self):
        strategy = Strategy({
            "hidden": ParallelConfig((2, 2), (3, 2, 1, 0)),
            "out": ParallelConfig((1, 1), (1,)),
        })
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "s.pb")
            strategy_files.save_strategy(strategy, path)
            model = small_mlp()
            model.compile("sgd", "mse", import_strategy=path)
            x, y = data()
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        self.assertEqual(model.strategy, strategy)

    def test_imported_shared_layer_calls_are_tied(self):
        inputs = [keras.Input((8,), batch_size=16), keras.Input((8,),
                                                                batch_size=16)]
        shared = layers.Dense(4, name="shared")
        merged = layers.Add(name="add")(
            [shared(inputs[0]), shared(inputs[1])]
        )
        model = Model(inputs, layers.Dense(1, name="head")(merged))
        strategy = Strategy({  # on one mesh, as shared layers need
            "shared": ParallelConfig((4, 1), (0, 1, 2, 3)),
            "shared#1": ParallelConfig((1, 4), (0, 1, 2, 3)),
            "add": ParallelConfig((4, 1), (0, 1, 2, 3)),
            "head": ParallelConfig((4, 1), (0, 1, 2, 3)),
        })
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "s.txt")
            strategy_files.save_strategy(strategy, path)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.compile("sgd", "mse", import_strategy=path)
        text = " ".join(str(w.message) for w in caught)
        self.assertIn("['shared#1'] call a shared layer", text)
        self.assertEqual(model.strategy["shared#1"], strategy["shared"])
        rng = np.random.default_rng(0)
        x = [rng.random((32, 8), dtype=np.float32) for _ in range(2)]
        model.fit(x, np.zeros((32, 1)), batch_size=16, verbose=0)
        # It trained under the tied plan: the runtime refuses an untied
        # one (test_runtime_equivalence) rather than re-placing calls.
        self.assertIsNotNone(model.strategy_executor)

    def test_every_supported_optimizer_plans_with_its_slots(self):
        from flexflow_keras import planner

        cases = [
            (keras.optimizers.SGD(), 0),
            (keras.optimizers.SGD(momentum=0.9), 1),
            (keras.optimizers.Adam(), 2),
            (keras.optimizers.AdamW(amsgrad=True), 3),
            (keras.optimizers.RMSprop(), 1),
            (keras.optimizers.RMSprop(momentum=0.9, centered=True), 3),
            (keras.optimizers.Adagrad(), 1),
            (keras.optimizers.Nadam(), 2),  # trains as plain Keras
        ]
        for optimizer, slots in cases:
            with self.subTest(optimizer=type(optimizer).__name__):
                self.assertEqual(planner.optimizer_slots(optimizer), slots)
        model = small_mlp()
        model.compile(cases[5][0], "mse", batch_size=16, search_budget=10)
        self.assertIsNotNone(model.strategy)

    def test_summary_lists_each_op_config(self):
        model = small_mlp()
        model.compile("sgd", "mse", batch_size=16, search_budget=0)
        out = io.StringIO()
        model.summary(print_fn=lambda line, **kw: out.write(line + "\n"))
        text = out.getvalue()
        row = next(l for l in text.splitlines() if l.startswith("hidden"))
        self.assertIn("sample=4", row)
        self.assertIn("0-3", row)
        self.assertIn("Time (ms)", text)

    def test_unknown_compile_setting_is_rejected(self):
        with self.assertRaisesRegex(TypeError, "search_budgte"):
            small_mlp().compile("sgd", "mse", search_budgte=3)

    def test_batch_not_divisible_by_devices_plans(self):
        # Issue 21: batch 6 on 4 devices splits 3 ways, never an error.
        model = small_mlp()
        model.compile("sgd", "mse", batch_size=6, search_budget=0)
        self.assertEqual(model.strategy["hidden"].dims[0], 3)


class DropInTest(unittest.TestCase):
    def test_same_losses_as_plain_keras(self):
        x, y = data(96)
        ours = small_mlp(seed=3)
        plain = keras.Model.from_config(ours.get_config())
        plain.set_weights(ours.get_weights())
        ours.compile("adam", "mse", search_budget=30, search_seed=0)
        plain.compile("adam", "mse")
        kwargs = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
        got = ours.fit(x, y, **kwargs).history["loss"]
        want = plain.fit(x, y, **kwargs).history["loss"]
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for a, b in zip(ours.get_weights(), plain.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

    def test_generator_batch_is_peeked_without_losing_data(self):
        x, y = data(48)
        seen = []

        def batches():
            for i in range(0, 48, 12):
                seen.append(i)
                yield x[i:i + 12], y[i:i + 12]

        model = small_mlp()
        model.compile("sgd", "mse", search_budget=0)
        history = model.fit(batches(), epochs=1, verbose=0)
        self.assertEqual(model.plan.graph.batch_size, 12)
        self.assertEqual(seen, [0, 12, 24, 36])
        self.assertEqual(len(history.history["loss"]), 1)

    def test_sequential_without_input_plans_at_fit(self):
        keras.utils.set_random_seed(0)
        model = Sequential([layers.Dense(8, activation="relu"),
                            layers.Dense(4)])
        model.compile("sgd", "mse", search_budget=0)
        x, y = data()
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        self.assertEqual(model.plan.graph.batch_size, 16)

    def test_subclassed_model_is_traced_and_trains_under_a_strategy(self):
        class Custom(Model):
            def __init__(self):
                super().__init__()
                self.hidden = layers.Dense(16, name="hidden")
                self.out = layers.Dense(4, name="out")

            def call(self, x):
                return self.out(keras.ops.relu(self.hidden(x)))

        model = Custom()
        model.compile("sgd", "mse", search_budget=5)
        x, y = data()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        assert_not_handed_over(self, [str(w.message) for w in caught])
        self.assertEqual(len(history.history["loss"]), 1)
        self.assertIn("hidden", model.strategy)
        self.assertIn("out", model.strategy)
        # The search may leave a small op unsplit (replicated on the
        # mesh); the strategy as a whole spans several devices.
        self.assertGreater(max(len(c.device_ids)
                               for c in model.strategy.values()), 1)
        self.assertIsNot(model.strategy_executor, None)

    def test_untraceable_subclassed_model_says_why(self):
        class Branchy(Model):
            def __init__(self):
                super().__init__()
                self.dense = layers.Dense(4)

            def call(self, x):
                import tensorflow as tf

                # A TensorFlow op: runs in Keras, not on keras.Input.
                return tf.math.softplus(self.dense(x))

        model = Branchy()
        model.compile("sgd", "mse", search_budget=5)
        x, y = data()
        # Called as one op, it would train split over the batch
        # (`tests/test_one_op_models.py`); here that fails too.
        one_op = mock.patch.object(keras_graph, "_as_one_op",
                                   side_effect=ValueError("refused"))
        with warnings.catch_warnings(record=True) as caught, one_op:
            warnings.simplefilter("always")
            history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        text = " ".join(str(w.message) for w in caught)
        self.assertIn("could not be traced on symbolic inputs", text)
        self.assertEqual(len(history.history["loss"]), 1)
        self.assertIsNone(model.strategy)


class OwnStepPlanningTest(unittest.TestCase):
    """A model that runs its own step gets a strategy on one mesh."""

    def fit_quietly(self, model, x, y, **compile_kw):
        model.compile("sgd", "mse", **compile_kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        return [str(w.message) for w in caught]

    def test_search_keeps_one_mesh(self):
        from flexflow_keras.mesh_space import MeshSpec

        inputs = keras.Input((8,))
        outputs = layers.Dense(
            4, activity_regularizer=keras.regularizers.L2(0.1), name="reg"
        )(layers.Dense(16)(inputs))
        model = Model(inputs, outputs)
        x, y = data()
        caught = self.fit_quietly(model, x, y, search_budget=50,
                                  search_seed=1)
        self.assertEqual(caught, [])
        self.assertTrue(on_one_mesh(model), model.strategy)
        # One mesh, which the regularized op splits over.
        mesh = MeshSpec.of(model.strategy, 4)
        self.assertGreater(mesh.size, 1, model.strategy)
        self.assertIsNotNone(mesh.axes(model.strategy["reg"]))
        self.assertGreater(len(model.strategy["reg"].device_ids), 1)

    def test_imported_strategy_over_several_meshes_is_replaced(self):
        inputs = keras.Input((8,))
        outputs = layers.Dense(
            4, activity_regularizer="l2", name="reg"
        )(layers.Dense(16, name="hidden")(inputs))
        model = Model(inputs, outputs)
        graph = flexflow_keras.keras_graph.build_graph(model, 16)
        placed = Strategy({
            op.name: ParallelConfig((1,) * op.rank, (i,))
            for i, op in enumerate(graph)
        })
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "placed.txt")
            strategy_files.save_strategy(placed, path)
            x, y = data()
            caught = self.fit_quietly(model, x, y, import_strategy=path,
                                      search_budget=20)
        text = " ".join(caught)
        self.assertIn("places ops on several device meshes", text)
        self.assertIn("layer 'reg' has activity_regularizer", text)
        self.assertTrue(on_one_mesh(model), model.strategy)

    def test_custom_layers_plan_one_mesh(self):
        # The probe runs them on one mesh with a split batch; between
        # segments of several meshes they are not measured.
        class Scale(keras.layers.Layer):
            def call(self, x):
                return 2.0 * x

        inputs = keras.Input((8,))
        h = Scale(name="scale")(layers.Dense(16)(inputs))
        model = Model(inputs, layers.Dense(4)(h))
        x, y = data()
        caught = self.fit_quietly(model, x, y, search_budget=50,
                                  search_seed=2)
        self.assertEqual(caught, [])
        self.assertTrue(on_one_mesh(model), model.strategy)


class PlainKerasFallbackTest(unittest.TestCase):
    """What DTensor cannot run trains as plain Keras, loudly."""

    # An op without a DTensor rule inside a layer is found by the probe
    # before the search and runs replicated (tests/test_capabilities.py);
    # one in the model's own step shows only when the step first runs.
    # `Roll` by a shift known only at run time is used here only (a
    # static shift runs as slices: `op_rules.roll_by_slices`): DTensor
    # keeps a switch on for the process once read, and no test turns
    # Roll's on. The step's first-run retry
    # with the blamed op replicated (which makes `Roll` run: the WGAN-GP's
    # DynamicStitch in test_step_patterns) is off here, so that the last
    # resort, plain Keras, is what these tests check.

    def setUp(self):
        retries = mock.patch.object(model_step, "_MAX_REPLICATED", 0)
        retries.start()
        self.addCleanup(retries.stop)

    @staticmethod
    def rolled(t):
        """`t` rolled by 1 along axis 1, the shift read from the data (0
        + 1), so that it is known only at run time: TensorFlow's `Roll`,
        which DTensor has no rule for."""
        ops = keras.ops
        shift = ops.cast(ops.sum(ops.zeros_like(t)), "int32") + 1
        return ops.roll(t, shift, axis=1)

    @staticmethod
    def build_rolled(cls, seed):
        """A model whose loss and predictions roll the outputs."""

        class Rolled(cls):
            def compute_loss(self, x=None, y=None, y_pred=None,
                             sample_weight=None, training=True):
                return super().compute_loss(
                    x, y, PlainKerasFallbackTest.rolled(y_pred),
                    sample_weight,
                    training,
                )

            def predict_step(self, data):
                return PlainKerasFallbackTest.rolled(
                    super().predict_step(data))

        keras.utils.set_random_seed(seed)
        inputs = keras.Input((6, 4))
        h = layers.Dense(4, name="pre")(inputs)
        return Rolled(inputs, layers.Dense(2)(layers.Flatten()(h)))

    def test_op_without_dtensor_rule_hands_over_to_keras(self):
        model = self.build_rolled(Model, 3)
        plain = self.build_rolled(keras.Model, 3)
        model.compile("adam", "mse", search_budget=0)
        plain.compile("adam", "mse")
        rng = np.random.default_rng(0)
        x = rng.random((32, 6, 4), dtype=np.float32)
        y = rng.random((32, 2), dtype=np.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
            again = model.fit(x, y, batch_size=16, verbose=0)
        texts = [str(w.message) for w in caught
                 if "from now on" in str(w.message)]
        self.assertEqual(len(texts), 1, texts)
        self.assertIn("no layout rule for its 'Roll' op", texts[0])
        self.assertIsNone(model.strategy)
        expected = plain.fit(x, y, batch_size=16, epochs=2, verbose=0)
        np.testing.assert_allclose(history.history["loss"],
                                   expected.history["loss"], rtol=1e-6)
        np.testing.assert_allclose(
            again.history["loss"],
            plain.fit(x, y, batch_size=16, verbose=0).history["loss"],
            rtol=1e-6,
        )

    def test_validation_hands_over_within_fit(self):
        """A test step that falls back at the first epoch's validation:
        the fit goes on as plain Keras (its next train step found no
        train function: `TypeError: 'NoneType' object is not
        callable`)."""

        def build(cls):
            class RolledInTest(cls):
                def compute_loss(self, x=None, y=None, y_pred=None,
                                 sample_weight=None, training=True):
                    if not training:
                        y_pred = PlainKerasFallbackTest.rolled(y_pred)
                    return super().compute_loss(
                        x, y, y_pred, sample_weight, training)

            keras.utils.set_random_seed(5)
            inputs = keras.Input((6, 4))
            h = layers.Flatten()(layers.Dense(4, name="pre")(inputs))
            return RolledInTest(inputs, layers.Dense(2)(h))

        model, plain = build(Model), build(keras.Model)
        model.compile("adam", "mse", search_budget=0)
        plain.compile("adam", "mse")
        rng = np.random.default_rng(2)
        x = rng.random((48, 6, 4), dtype=np.float32)
        y = rng.random((48, 2), dtype=np.float32)
        fit = dict(batch_size=16, epochs=3, validation_split=0.25,
                   verbose=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(x, y, **fit)
        texts = [str(w.message) for w in caught]
        self.assertTrue(any("from now on" in t for t in texts), texts)
        expected = plain.fit(x, y, **fit)
        for key, values in expected.history.items():
            np.testing.assert_allclose(history.history[key], values,
                                       rtol=1e-6, err_msg=key)

    def test_predict_and_evaluate_hand_over_too(self):
        x = np.random.default_rng(1).random((20, 6, 4), dtype=np.float32)
        y = np.zeros((20, 2), np.float32)
        for first in ("predict", "evaluate"):
            with self.subTest(first=first):
                model = self.build_rolled(Model, 4)
                plain = self.build_rolled(keras.Model, 4)
                model.compile("sgd", "mse", batch_size=8, search_budget=0)
                plain.compile("sgd", "mse")
                self.assertIsNotNone(model.strategy)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if first == "predict":
                        got = model.predict(x, batch_size=8, verbose=0)
                        want = plain.predict(x, batch_size=8, verbose=0)
                    else:
                        got = model.evaluate(x, y, batch_size=8, verbose=0)
                        want = plain.evaluate(x, y, batch_size=8,
                                              verbose=0)
                self.assertTrue(any("Roll" in str(w.message)
                                    for w in caught))
                np.testing.assert_allclose(got, want, rtol=1e-6)
                self.assertIsNone(model.strategy)


class DatasetOrderTest(unittest.TestCase):
    """Planning reads a dataset's batch without iterating it: an iterator
    takes the next shuffle seed, so a peek gave the first epoch another
    order than plain Keras's (keras.io's mixup)."""

    def _fit_both(self, make_data):
        """Our model, after the same fit of a two-layer model on
        `make_data(x, y)` from plain Keras and ours (asserted equal), and
        our "plain Keras" warnings."""
        rng = np.random.default_rng(0)
        x = rng.random((64, 8), dtype=np.float32)
        y = rng.random((64, 2), dtype=np.float32)
        histories, told = [], []
        for cls in (keras.Model, Model):
            keras.utils.set_random_seed(3)
            inputs = keras.Input((8,))
            model = cls(inputs, layers.Dense(2)(layers.Dense(8)(inputs)))
            options = {} if cls is keras.Model else {"search_budget": 0}
            model.compile("sgd", "mse", **options)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                histories.append(
                    model.fit(make_data(x, y), epochs=2, verbose=0).history)
            told = [str(w.message) for w in caught
                    if "plain Keras" in str(w.message)]
        np.testing.assert_allclose(histories[1]["loss"],
                                   histories[0]["loss"], rtol=1e-5)
        return model, told

    def test_reshuffled_dataset_trains_in_keras_order(self):
        import tensorflow as tf

        def make(x, y):
            return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
                64, seed=5).batch(16).map(lambda a, b: (a * 2.0, b))

        model, _ = self._fit_both(make)
        self.assertIsNotNone(model.strategy_executor)

    def test_zip_of_batchings_plans_for_its_inputs_unpeeked(self):
        """keras.io's semi-supervised SimCLR zips inputs and labels batched
        apart (by 95 and 9 there), each shuffled: the inputs' batching is
        read through the zip, and nothing is read from the data."""
        import tensorflow as tf

        def make(x, y):
            inputs = tf.data.Dataset.from_tensor_slices(x).shuffle(
                64).batch(16)
            labels = tf.data.Dataset.from_tensor_slices(y).shuffle(
                64).batch(16, drop_remainder=False).map(lambda b: b * 1.0)
            return tf.data.Dataset.zip(inputs, labels).prefetch(2)

        model, told = self._fit_both(make)
        self.assertEqual(told, [])
        self.assertIsNotNone(model.strategy_executor)
        self.assertEqual(model.plan.graph.batch_size, 16)

    def test_unreadable_batch_of_a_shuffled_dataset_is_not_peeked(self):
        """A batch size only a read could give, from a dataset that
        shuffles: read, it would give the first epoch plain Keras's second
        order, so the model trains as plain Keras, said once."""
        import tensorflow as tf

        def make(x, y):  # batched inside group_by_window: not in the chain
            return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
                64).group_by_window(
                    key_func=lambda a, b: tf.constant(0, tf.int64),
                    reduce_func=lambda key, rows: rows.batch(16),
                    window_size=16)

        model, told = self._fit_both(make)
        self.assertEqual(len(told), 1, told)
        self.assertIn("batch size cannot be read", told[0])
        self.assertIsNone(model.strategy_executor)

    def test_shapeless_dataset_fails_as_keras_fails_and_says_why(self):
        """A `tf.numpy_function` gives its outputs no shape, not even a
        rank (keras.io's 3D image classification): plain Keras cannot
        fit on them. Ours crashed in its own read of the batch
        ("Cannot iterate over a shape with unknown rank"); now it says
        what it cannot plan and how to give the shapes, and Keras raises
        its own error."""
        import tensorflow as tf

        def load(index):
            return (np.full((8,), index, np.float32),
                    np.zeros((2,), np.float32))

        errors, told = [], []
        for cls in (keras.Model, Model):
            data = tf.data.Dataset.range(32).map(
                lambda i: tf.numpy_function(load, [i],
                                            [tf.float32, tf.float32])
            ).batch(16)
            inputs = keras.Input((8,))
            model = cls(inputs, layers.Dense(2)(inputs))
            model.compile("sgd", "mse")
            with warnings.catch_warnings(record=True) as caught, \
                    self.assertRaises(ValueError) as raised:
                warnings.simplefilter("always")
                model.fit(data, epochs=1, verbose=0)
            errors.append(str(raised.exception))
            told = [str(w.message) for w in caught
                    if "plain Keras" in str(w.message)]
        self.assertEqual(errors[1], errors[0])
        self.assertEqual(len(told), 1, told)
        self.assertIn("have no shape", told[0])
        self.assertIn("tf.ensure_shape", told[0])


class RunEagerlyTest(unittest.TestCase):
    """`compile(run_eagerly=True)` is Keras's debugging mode: the step runs
    eagerly, line by line (keras.io's debugging_tips prints tensor values
    with `%` formatting in its train_step): plain Keras, with one warning;
    compiled again without it, the model trains under its strategy."""

    def test_eager_step_then_strategy(self):
        class Printing(Model):
            def train_step(self, data):
                logs = super().train_step(data)
                self.seen.append("%.4f" % float(logs["loss"]))
                return logs

        keras.utils.set_random_seed(5)
        inputs = keras.Input((8,))
        model = Printing(inputs, layers.Dense(2)(inputs))
        model.seen = []
        rng = np.random.default_rng(0)
        x = rng.random((32, 8), dtype=np.float32)
        y = rng.random((32, 2), dtype=np.float32)
        model.compile("sgd", "mse", run_eagerly=True, search_budget=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        eager = [str(w.message) for w in caught
                 if "run_eagerly=True" in str(w.message)]
        self.assertEqual(len(eager), 1, eager)
        self.assertEqual(len(model.seen), 8)
        self.assertIsNone(model.strategy_executor)
        model.run_eagerly = False
        model.train_step = lambda data: Model.train_step(model, data)
        model.compile("sgd", "mse", search_budget=0)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assertIsNotNone(model.strategy_executor)
        self.assertGreater(len({d for c in model.strategy.values()
                                for d in c.device_ids}), 1)


class SilencedWarningsTest(unittest.TestCase):
    """keras.io's GAT node classifier starts with
    `warnings.filterwarnings("ignore")`; its subclassed model calls itself
    on graph tensors it holds (not on fit's inputs, node indices), so
    its call cannot be traced and it trains as plain Keras, and the
    warning saying so was filtered away with TensorFlow's noise: the
    script trained as plain Keras without a word. The notice now goes to
    stderr where the script's filters hide it, and is a warning as
    before where they do not."""

    def _gat_like(self, mod):
        rng = np.random.default_rng(0)
        nodes = tf.constant(rng.random((20, 6), dtype=np.float32))
        weights = tf.constant(rng.random((20, 1), dtype=np.float32))

        class Graph(mod.Model):
            def __init__(self):
                super().__init__()
                self.nodes, self.weights_of_nodes = nodes, weights
                self.dense = mod.layers.Dense(3)

            def call(self, inputs):
                features, scale = inputs  # unpacks its inputs
                return self.dense(features * scale)

            def train_step(self, data):
                indices, labels = data
                with tf.GradientTape() as tape:
                    outputs = tf.gather(
                        self([self.nodes, self.weights_of_nodes]), indices)
                    loss = self.compute_loss(y=labels, y_pred=outputs)
                grads = tape.gradient(loss, self.trainable_weights)
                self.optimizer.apply(grads, self.trainable_weights)
                for metric in self.metrics:
                    if metric.name == "loss":
                        metric.update_state(loss)
                return {m.name: m.result() for m in self.metrics}

        keras.utils.set_random_seed(3)
        model = Graph()
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        return model

    def _fit(self, model):
        indices = np.arange(16)
        labels = np.arange(16) % 3
        return model.fit(indices, labels, batch_size=8, epochs=2,
                         verbose=0).history["loss"]

    def test_notice_reaches_stderr_when_warnings_are_ignored(self):
        expected = self._fit(self._gat_like(keras))
        model = self._gat_like(flexflow_keras)
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stderr(io.StringIO()) as err:
            warnings.filterwarnings("ignore")
            got = self._fit(model)
        told = [line for line in err.getvalue().splitlines()
                if "trains as plain Keras" in line]
        self.assertEqual(len(told), 1, err.getvalue())
        self.assertIn("could not be traced", told[0])
        self.assertEqual(caught, [])
        np.testing.assert_allclose(got, expected, rtol=1e-6)

    def test_notice_is_a_warning_when_warnings_are_shown(self):
        model = self._gat_like(flexflow_keras)
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stderr(io.StringIO()) as err:
            warnings.simplefilter("always")
            self._fit(model)
        said = [w for w in caught if "trains as plain Keras" in
                str(w.message)]
        self.assertEqual(len(said), 1)
        self.assertIs(said[0].category, UserWarning)
        self.assertEqual(os.path.basename(said[0].filename),
                         "test_models.py")
        self.assertNotIn("trains as plain Keras", err.getvalue())


class ModelClassTest(unittest.TestCase):
    def test_functional_subclass_leaves_model_class_intact(self):
        class Wrapped(Model):
            def __init__(self):
                inputs = keras.Input((8,))
                super().__init__(inputs, layers.Dense(4)(inputs))

        wrapped = Wrapped()
        self.assertIsInstance(wrapped, keras.Model)
        self.assertEqual(wrapped.output_shape, (None, 4))
        plain = small_mlp()
        self.assertEqual(plain.name, "small")
        self.assertEqual(Model.__bases__[-1], keras.Model)

        class Custom(Model):
            def __init__(self):
                super().__init__()
                self.dense = layers.Dense(2)

            def call(self, x):
                return self.dense(x)

        self.assertEqual(Custom()(np.zeros((1, 3))).shape, (1, 2))


class CommandLineTest(unittest.TestCase):
    def test_script_flags_reach_compile_and_argparse_is_untouched(self):
        script = textwrap.dedent("""
            import argparse
            import numpy as np
            import flexflow_keras as keras
            parser = argparse.ArgumentParser()
            parser.add_argument("--epochs", type=int)
            args = parser.parse_args()
            inputs = keras.Input((8,))
            model = keras.Model(inputs, keras.layers.Dense(4)(inputs))
            model.compile("sgd", "mse")
            x = np.zeros((32, 8), "float32")
            model.fit(x, np.zeros((32, 4)), batch_size=16,
                      epochs=args.epochs, verbose=0)
            print("source", model.plan.source, "epochs", args.epochs)
        """)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "train.py")
            out_path = os.path.join(folder, "s.txt")
            with open(path, "w") as f:
                f.write(script)
            env = dict(os.environ, FLEXFLOW_KERAS_SEARCH_BUDGET="7")
            run = subprocess.run(
                [sys.executable, path, "--epochs", "1", "--budget", "0",
                 "--export", out_path, "--cpu-devices", "2"],
                capture_output=True, text=True, env=env, cwd=ROOT,
                timeout=300,
            )
            self.assertEqual(run.returncode, 0, run.stderr[-2000:])
            self.assertIn("source data_parallel epochs 1", run.stdout)
            with open(out_path) as f:
                text = f.read()
        self.assertIn("dims[2,1] device_ids[0,1]", text)


if __name__ == "__main__":
    unittest.main()
