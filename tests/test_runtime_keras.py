"""Keras behaviour kept under a strategy: inputs, fit options, callbacks,
metrics, evaluate/predict sizes, save/load, weight sync."""

import os
import tempfile
import unittest

import keras
import numpy as np
import tensorflow as tf

import runtime_support as support
from flexflow_keras import runtime

try:
    import tensorboard  # noqa: F401

    _HAS_TENSORBOARD = True
except ImportError:
    _HAS_TENSORBOARD = False

CUSTOM = {"StrategyModel": support.StrategyModel}
FIT = dict(batch_size=8, epochs=3, verbose=0, shuffle=False)


def pair(name="mlp", optimizer="sgd", strategy=None, metrics=("mae",)):
    ref, model = support.build_pair(name, optimizer, metrics=list(metrics))
    support.attach(model, strategy or support.parameter, 8)
    return ref, model


class RuntimeKerasTest(unittest.TestCase):
    def assert_histories_equal(self, history, history_ref):
        self.assertEqual(set(history.history), set(history_ref.history))
        for key, values in history_ref.history.items():
            np.testing.assert_allclose(
                history.history[key], values, rtol=1e-5, atol=1e-7,
                err_msg=key,
            )

    def test_validation_split_sample_weight_metrics(self):
        ref, model = pair()
        x, y = support.MODELS["mlp"][1](30)
        weights = np.linspace(0.5, 2.0, 30).astype("float32")
        kwargs = dict(FIT, validation_split=0.2, sample_weight=weights)
        self.assert_histories_equal(
            model.fit(x, y, **kwargs), ref.fit(x, y, **kwargs)
        )

    def test_class_weight_and_initial_epoch(self):
        ref, model = pair("cnn", metrics=("accuracy",))
        x, y = support.MODELS["cnn"][1](20)
        kwargs = dict(FIT, class_weight={0: 1.0, 1: 2.0, 2: 0.5, 3: 1.0},
                      initial_epoch=1)
        history = model.fit(x, y, **kwargs)
        self.assertEqual(history.epoch, [1, 2])
        self.assert_histories_equal(history, ref.fit(x, y, **kwargs))

    def test_tf_data_with_validation_data(self):
        ref, model = pair("two_input_concat", "adam",
                          strategy=support.placement)
        x, y = support.MODELS["two_input_concat"][1](20)
        data = tf.data.Dataset.from_tensor_slices((tuple(x), y)).batch(8)
        kwargs = dict(epochs=2, verbose=0, validation_data=data)
        self.assert_histories_equal(
            model.fit(data, **kwargs), ref.fit(data, **kwargs)
        )

    def test_generator_with_steps_per_epoch(self):
        ref, model = pair()
        x, y = support.MODELS["mlp"][1](16)

        def batches():
            while True:
                for i in range(0, 16, 8):
                    yield x[i:i + 8], y[i:i + 8]

        kwargs = dict(epochs=2, steps_per_epoch=2, verbose=0)
        self.assert_histories_equal(
            model.fit(batches(), **kwargs), ref.fit(batches(), **kwargs)
        )

    def test_shuffle_and_verbose_progress_bar(self):
        ref, model = pair()
        x, y = support.MODELS["mlp"][1](20)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=True,
                            verbose=1)
        self.assertEqual(len(history.history["loss"]), 2)
        self.assertTrue(np.all(np.isfinite(history.history["loss"])))

    def test_evaluate_and_predict_any_number_of_samples(self):
        ref, model = pair("transformer", strategy=support.data_parallel)
        x, y = support.MODELS["transformer"][1](13)
        for batch_size in (8, 5, None):
            np.testing.assert_allclose(
                model.evaluate(x, y, batch_size=batch_size, verbose=0),
                ref.evaluate(x, y, batch_size=batch_size, verbose=0),
                rtol=1e-5,
            )
            np.testing.assert_allclose(
                model.predict(x, batch_size=batch_size, verbose=0),
                ref.predict(x, batch_size=batch_size, verbose=0),
                rtol=1e-5, atol=1e-6,
            )

    def test_callbacks_see_trained_weights_each_epoch(self):
        class Record(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.kernels, self.losses = [], []

            def on_epoch_end(self, epoch, logs=None):
                self.kernels.append(self.model.get_layer("logits").kernel
                                    .numpy().copy())
                self.losses.append(logs["loss"])

        ref, model = pair()
        x, y = support.MODELS["mlp"][1](20)
        mine, theirs = Record(), Record()
        model.fit(x, y, callbacks=[mine], **FIT)
        ref.fit(x, y, callbacks=[theirs], **FIT)
        np.testing.assert_allclose(mine.losses, theirs.losses, rtol=1e-5)
        for a, b in zip(mine.kernels, theirs.kernels):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

    def test_lr_schedulers_take_effect(self):
        def schedule(epoch, lr):
            return lr * 0.5

        callbacks = lambda: [  # noqa: E731
            keras.callbacks.LearningRateScheduler(schedule),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0,
                                              min_delta=10.0, factor=0.5),
        ]
        ref, model = pair(optimizer="momentum")
        x, y = support.MODELS["mlp"][1](20)
        history = model.fit(x, y, callbacks=callbacks(), **FIT)
        self.assert_histories_equal(
            history, ref.fit(x, y, callbacks=callbacks(), **FIT)
        )
        self.assertLess(float(model.optimizer.learning_rate), 0.01 / 4)

    def test_learning_rate_schedule_object(self):
        def optimizer():
            return keras.optimizers.Adam(
                keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5)
            )

        ref, model = support.build_pair("mlp")
        ref.compile(optimizer=optimizer(), loss="mse")
        model.compile(optimizer=optimizer(), loss="mse")
        support.attach(model, support.data_parallel, 8)
        x, y = support.MODELS["mlp"][1](20)
        self.assert_histories_equal(model.fit(x, y, **FIT),
                                    ref.fit(x, y, **FIT))

    def test_early_stopping_checkpoint_tensorboard_save_load(self):
        ref, model = pair("cnn", metrics=())
        x, y = support.MODELS["cnn"][1](20)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "best.keras")
            callbacks = [
                keras.callbacks.EarlyStopping(monitor="loss", patience=1),
                keras.callbacks.ModelCheckpoint(path),
            ]
            model.fit(x, y, callbacks=callbacks, **FIT)
            checkpoint = keras.models.load_model(path, custom_objects=CUSTOM)
            for a, b in zip(checkpoint.get_weights(), model.get_weights()):
                np.testing.assert_array_equal(a, b)
            saved = os.path.join(tmp, "m.keras")
            model.save(saved)
            loaded = keras.models.load_model(saved, custom_objects=CUSTOM)
            np.testing.assert_allclose(
                loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                rtol=1e-5, atol=1e-6,
            )

    def test_optimizer_state_is_saved_and_resumed(self):
        ref, model = pair("mlp", "adam", metrics=())
        x, y = support.MODELS["mlp"][1](24)
        model.fit(x, y, **FIT)
        ref.fit(x, y, **FIT)
        self.assertEqual(len(model.optimizer.variables),
                         len(ref.optimizer.variables))
        for a, b in zip(model.optimizer.variables, ref.optimizer.variables):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5,
                                       atol=1e-7, err_msg=a.path)
        with tempfile.TemporaryDirectory() as tmp:
            model.save(os.path.join(tmp, "ff.keras"))
            ref.save(os.path.join(tmp, "ref.keras"))
            model = keras.models.load_model(os.path.join(tmp, "ff.keras"),
                                            custom_objects=CUSTOM)
            ref = keras.models.load_model(os.path.join(tmp, "ref.keras"))
        support.attach(model, support.parameter, 8)
        # Adam's moments resume: zero moments at step 13 would move the
        # weights far more than the saved ones do.
        self.assert_histories_equal(model.fit(x, y, **FIT),
                                    ref.fit(x, y, **FIT))
        for a, b in zip(model.get_weights(), ref.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def test_every_optimizer_slot_reaches_keras(self):
        optimizers = {
            "nesterov": lambda: keras.optimizers.SGD(0.01, 0.9, True),
            "amsgrad": lambda: keras.optimizers.Adam(amsgrad=True),
            "adamw": lambda: keras.optimizers.AdamW(0.01),
            "rmsprop": lambda: keras.optimizers.RMSprop(
                momentum=0.5, centered=True),
            "adagrad": lambda: keras.optimizers.Adagrad(0.1),
        }
        x, y = support.MODELS["mlp"][1](16)
        for name, make in optimizers.items():
            with self.subTest(optimizer=name):
                ref, model = support.build_pair("mlp")
                ref.compile(optimizer=make(), loss="mse")
                model.compile(optimizer=make(), loss="mse")
                support.attach(model, support.parameter, 8)
                model.fit(x, y, **FIT)
                ref.fit(x, y, **FIT)
                mine = model.optimizer.variables
                theirs = ref.optimizer.variables
                self.assertEqual(  # names past the optimizer's own
                    [v.path.split("/", 1)[1] for v in mine],
                    [v.path.split("/", 1)[1] for v in theirs],
                )
                for a, b in zip(mine, theirs):
                    np.testing.assert_allclose(
                        np.array(a), np.array(b), rtol=1e-4, atol=1e-6,
                        err_msg=a.path,
                    )

    @unittest.skipUnless(_HAS_TENSORBOARD, "tensorboard is not installed")
    def test_tensorboard_writes_logs(self):
        ref, model = pair()
        x, y = support.MODELS["mlp"][1](16)
        with tempfile.TemporaryDirectory() as tmp:
            board = keras.callbacks.TensorBoard(os.path.join(tmp, "logs"))
            model.fit(x, y, callbacks=[board], **FIT)
            self.assertTrue(os.listdir(os.path.join(tmp, "logs")))

    def test_set_weights_between_fits_is_used(self):
        ref, model = pair()
        x, y = support.MODELS["mlp"][1](16)
        model.fit(x, y, **FIT)
        model.set_weights(ref.get_weights())
        np.testing.assert_allclose(
            model.predict(x, verbose=0), ref.predict(x, verbose=0),
            rtol=1e-5, atol=1e-6,
        )

    def test_several_meshes_name_the_optimizers_they_run(self):
        # One mesh runs Keras's own optimizer (test_own_step.py); the
        # layer-by-layer step over several meshes has its own rules.
        ref, model = support.build_pair("mlp")
        model.compile(optimizer=keras.optimizers.Nadam(), loss="mse")
        support.attach(model, support.placement, 8)
        x, y = support.MODELS["mlp"][1](8)
        with self.assertRaisesRegex(NotImplementedError, "Nadam.*|.*SGD"):
            model.fit(x, y, **FIT)

    def test_add_loss_over_several_meshes_hands_over_to_keras(self):
        # compile() plans such a model on one mesh (its own step); a
        # strategy over several meshes attached by hand finds the
        # add_loss when its layer-by-layer step is first traced.
        def build():
            keras.utils.set_random_seed(5)
            inputs = keras.Input((8,))
            h = keras.layers.ActivityRegularization(l2=0.1)(
                keras.layers.Dense(4)(inputs)
            )
            return inputs, keras.layers.Dense(4)(h)

        model = support.StrategyModel(*build())
        plain = keras.Model(*build())
        for m in (model, plain):
            m.compile("sgd", "mse")
        support.attach(model, support.placement, 8)
        rng = np.random.default_rng(0)
        x = rng.random((16, 8), dtype=np.float32)
        y = rng.random((16, 4), dtype=np.float32)
        with self.assertWarnsRegex(UserWarning, "calls add_loss"):
            history = model.fit(x, y, **FIT)
        self.assertIsNone(model.strategy_executor)
        self.assert_histories_equal(history, plain.fit(x, y, **FIT))

    def test_detach_returns_to_plain_keras(self):
        ref, model = pair()
        x, y = support.MODELS["mlp"][1](16)
        runtime.detach_strategy(model)
        self.assertIsNone(model.strategy_executor)
        self.assert_histories_equal(model.fit(x, y, **FIT),
                                    ref.fit(x, y, **FIT))

    def test_no_batches_log_the_validation_alone(self):
        """A fit on no rows (a keras_tuner guide's `x[:-10000]` of a
        small data set) logs only its validation, and an evaluate on no
        rows nothing, as Keras does; both raised "Cannot get result()
        since the metric has not yet been built". With one mesh and with
        several (the two executors)."""
        x, y = support.MODELS["mlp"][1](16)
        none = dict(epochs=2, verbose=0, validation_data=(x, y))
        for strategy in (support.data_parallel, support.several_meshes):
            with self.subTest(strategy=strategy.__name__):
                ref, model = pair(strategy=strategy)
                self.assert_histories_equal(model.fit(x[:0], y[:0], **none),
                                            ref.fit(x[:0], y[:0], **none))
                self.assertEqual(
                    model.evaluate(x[:0], y[:0], verbose=0,
                                   return_dict=True),
                    ref.evaluate(x[:0], y[:0], verbose=0, return_dict=True))

    def test_strategy_for_more_devices_than_attached_is_refused(self):
        from flexflow_keras.strategy import ParallelConfig, Strategy

        ref, model = support.build_pair("mlp")
        graph = support.build_graph(model, 8)
        strategy = Strategy({
            op.name: ParallelConfig((1,) * op.rank, (7,)) for op in graph
        })
        with self.assertRaisesRegex(ValueError,
                                    "device_ids=\\(7,\\).*has 4 devices"):
            runtime.attach_strategy(model, graph, strategy)


class RuntimeMultiOutputTest(unittest.TestCase):
    def test_two_outputs_with_loss_dict_and_weights(self):
        def build():
            x = keras.Input((6,), name="x")
            h = keras.layers.Dense(8, activation="relu", name="h")(x)
            a = keras.layers.Dense(2, name="a")(h)
            b = keras.layers.Dense(1, name="b")(h)
            return keras.Model(x, {"a": a, "b": b})

        keras.utils.set_random_seed(0)
        ref = build()
        keras.utils.set_random_seed(0)
        base = build()
        model = support.StrategyModel(base._inputs_struct,
                                      base._outputs_struct)
        model.set_weights(ref.get_weights())
        compile_args = dict(loss={"a": "mse", "b": "mae"},
                            loss_weights={"a": 1.0, "b": 0.5},
                            metrics={"a": ["mae"]})
        ref.compile(optimizer=keras.optimizers.Adam(0.01), **compile_args)
        model.compile(optimizer=keras.optimizers.Adam(0.01), **compile_args)
        support.attach(model, support.parameter, 8)
        rng = np.random.default_rng(0)
        x = rng.random((20, 6), dtype=np.float32)
        y = {"a": rng.random((20, 2), dtype=np.float32),
             "b": rng.random((20, 1), dtype=np.float32)}
        history = model.fit(x, y, **FIT)
        history_ref = ref.fit(x, y, **FIT)
        self.assertEqual(set(history.history), set(history_ref.history))
        for key, values in history_ref.history.items():
            np.testing.assert_allclose(history.history[key], values,
                                       rtol=1e-5, err_msg=key)
        for a, b in zip(model.get_weights(), ref.get_weights()):
            self.assertLess(support.relative_error(a, b), 1e-5)


class TracingTest(unittest.TestCase):
    """Every compiled step function is traced once, whatever the batch
    sizes (partial batches, validation, evaluate, predict), and
    TensorFlow prints no retracing warning."""

    def run_everything(self, strategy_of):
        from flexflow_keras.keras_graph import build_graph

        inputs = keras.Input((32,))
        h = keras.layers.Dense(64, activation="relu", name="d0")(inputs)
        h = keras.layers.Dense(64, activation="relu", name="d1")(h)
        model = support.StrategyModel(
            inputs, keras.layers.Dense(10, name="d2")(h)
        )
        model.compile(
            optimizer="adam", metrics=["accuracy"],
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        rng = np.random.default_rng(0)
        x = rng.random((500, 32), dtype=np.float32)
        y = rng.integers(0, 10, 500)
        graph = build_graph(model, 32)
        runtime.attach_strategy(model, graph, strategy_of(graph))
        with self.assertNoLogs("tensorflow", "WARNING"):
            model.fit(x, y, batch_size=32, epochs=3, verbose=0,
                      validation_split=0.1)
            model.evaluate(x, y, batch_size=32, verbose=0)
            model.predict(x, batch_size=32, verbose=0)
        return model.strategy_executor

    def test_several_meshes(self):
        from flexflow_keras.runtime.step import Executor
        from flexflow_keras.strategy import ParallelConfig, Strategy

        executor = self.run_everything(lambda graph: Strategy({
            "d0": ParallelConfig((4, 1), (0, 1, 2, 3)),
            "d1": ParallelConfig((1, 1), (2,)),
            "d2": ParallelConfig((2, 1), (0, 1)),
        }))
        self.assertIsInstance(executor, Executor)
        functions = {key: f.function for key, f in executor._fns.items()}
        counts = {key: f.experimental_get_tracing_count()
                  for key, f in functions.items()
                  if hasattr(f, "experimental_get_tracing_count")}
        self.assertGreater(len(counts), 12)  # forward/backward x variants
        self.assertEqual(set(counts.values()), {1}, counts)

    def test_one_mesh(self):
        from flexflow_keras.runtime.model_step import ModelStepExecutor
        from flexflow_keras.strategy import Strategy

        executor = self.run_everything(
            lambda graph: Strategy.data_parallel(graph, 4)
        )
        self.assertIsInstance(executor, ModelStepExecutor)
        # RedoneOnNameClash -> _StepFunction -> tf.function
        counts = {key: f.function.function.experimental_get_tracing_count()
                  for key, f in executor._functions.items()}
        self.assertGreaterEqual(len(counts), 4)  # train/test/predict x sizes
        self.assertEqual(set(counts.values()), {1}, counts)
