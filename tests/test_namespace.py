"""flexflow_keras mirrors the public Keras 3 API, with our Model classes."""

import importlib
import os
import tempfile
import types
import unittest

import keras
import numpy as np

import flexflow_keras
from flexflow_keras import Model, Sequential, layers


def _public_modules(module, prefix, seen):
    """(dotted path, module) for `module` and its public submodules."""
    if id(module) in seen:
        return
    seen.add(id(module))
    yield prefix, module
    for name in dir(module):
        value = getattr(module, name)
        if (
            not name.startswith("_")
            and isinstance(value, types.ModuleType)
            and value.__name__.startswith(module.__name__ + ".")
        ):
            yield from _public_modules(value, f"{prefix}.{name}", seen)


class NamespaceTest(unittest.TestCase):
    def test_every_public_keras_name_exists(self):
        missing, checked = [], 0
        for path, module in _public_modules(keras, "keras", set()):
            if path.split(".")[1:2] in (["src"], ["api"]):
                continue
            ours = flexflow_keras
            for part in path.split(".")[1:]:
                ours = getattr(ours, part, None)
                if ours is None:
                    break
            if ours is None:
                missing.append(path)
                continue
            for name in dir(module):
                if path == "keras" and name in ("src", "api"):
                    continue  # Keras internals, not public API.
                if not name.startswith("_"):
                    checked += 1
                    if not hasattr(ours, name):
                        missing.append(f"{path}.{name}")
        self.assertEqual(missing, [])
        self.assertGreater(checked, 1000)  # the walk reached submodules

    def test_names_mean_the_same(self):
        self.assertIs(flexflow_keras.layers.Dense, keras.layers.Dense)
        self.assertIs(flexflow_keras.ops.add, keras.ops.add)
        self.assertIs(flexflow_keras.Input, keras.Input)
        self.assertIs(flexflow_keras.optimizers.Adam, keras.optimizers.Adam)

    def test_submodules_import_by_dotted_path(self):
        for name in ("ops", "optimizers", "callbacks", "random", "backend"):
            module = importlib.import_module(f"flexflow_keras.{name}")
            self.assertIs(module, getattr(keras, name))
        from flexflow_keras.layers import Dense
        from flexflow_keras.utils import PyDataset

        self.assertIs(Dense, keras.layers.Dense)
        self.assertIs(PyDataset, keras.utils.PyDataset)
        # Ours, model builders and loaders aside (see ModelBuildersTest).
        for name in ("applications", "applications.resnet50", "saving",
                     "layers", "utils"):
            module = importlib.import_module(f"flexflow_keras.{name}")
            self.assertIsNot(module, importlib.import_module(f"keras.{name}"))
        from flexflow_keras.applications.resnet50 import (  # noqa: F401
            ResNet50, preprocess_input,
        )
        self.assertIs(preprocess_input,
                      keras.applications.resnet50.preprocess_input)

    def test_model_classes_subclass_keras(self):
        inputs = keras.Input((3,))
        model = Model(inputs, layers.Dense(2)(inputs))
        self.assertIsInstance(model, keras.Model)
        self.assertIsInstance(model, Model)
        seq = Sequential([keras.Input((3,)), layers.Dense(2)])
        self.assertIsInstance(seq, keras.Sequential)
        self.assertIs(flexflow_keras.models.Model, Model)
        self.assertIs(flexflow_keras.Model, Model)


class ModelBuildersTest(unittest.TestCase):
    """`keras.applications` and `keras.saving.load_model` give our models,
    so a script that builds its network from them is parallelized too."""

    def test_application_is_ours_with_the_same_layers(self):
        build = flexflow_keras.applications.VGG16
        self.assertEqual(build.__name__, "VGG16")
        plain = keras.applications.VGG16(input_shape=(32, 32, 3),
                                         weights=None, classes=4)
        model = build(input_shape=(32, 32, 3), weights=None, classes=4)
        self.assertIsInstance(model, Model)
        self.assertEqual(model.name, "vgg16")
        self.assertEqual(model.count_params(), plain.count_params())
        model.compile("sgd", "sparse_categorical_crossentropy",
                      search_budget=0)
        rng = np.random.default_rng(0)
        x = rng.random((16, 32, 32, 3), dtype=np.float32)
        model.fit(x, rng.integers(0, 4, 16), batch_size=8, verbose=0)
        self.assertIsNotNone(model.strategy)
        self.assertEqual(model.strategy["block1_conv1"].dims, (4, 1, 1, 1))
        self.assertIs(flexflow_keras.applications.vgg16.VGG16, build)

    def test_saving_load_model_is_ours(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "m.keras")
            inputs = keras.Input((3,))
            keras.Model(inputs, keras.layers.Dense(2)(inputs)).save(path)
            loaded = flexflow_keras.saving.load_model(path)
        self.assertIsInstance(loaded, Model)
        self.assertIs(flexflow_keras.saving.load_model,
                      flexflow_keras.models.load_model)
        self.assertIs(flexflow_keras.saving.save_model,
                      keras.saving.save_model)

    def test_deserialized_model_is_ours(self):
        inputs = keras.Input((3,))
        config = keras.saving.serialize_keras_object(
            keras.Model(inputs, keras.layers.Dense(2)(inputs)))
        self.assertIsInstance(
            flexflow_keras.saving.deserialize_keras_object(config), Model)
        # (Keras's deserializer changes the config it reads: a new one.)
        config = keras.saving.serialize_keras_object(
            keras.Model(inputs, keras.layers.Dense(2)(inputs)))
        self.assertIsInstance(
            flexflow_keras.utils.deserialize_keras_object(config), Model)
        for model in (keras.Model(inputs, keras.layers.Dense(2)(inputs)),
                      keras.Sequential([keras.Input((3,)),
                                        keras.layers.Dense(2)])):
            loaded = flexflow_keras.layers.deserialize(
                keras.layers.serialize(model))
            self.assertIsInstance(loaded, (Model, Sequential))
            self.assertEqual(loaded.get_config(), model.get_config())
        # Anything else comes back as Keras gives it.
        dense = flexflow_keras.saving.deserialize_keras_object(
            keras.saving.serialize_keras_object(keras.layers.Dense(2)))
        self.assertIsInstance(dense, keras.layers.Dense)
        dense = flexflow_keras.layers.deserialize(
            keras.layers.serialize(keras.layers.Dense(2)))
        self.assertIsInstance(dense, keras.layers.Dense)


class CloneAndJsonTest(unittest.TestCase):
    def test_clones_and_json_models_are_ours(self):
        inputs = keras.Input((3,))
        model = Model(inputs, layers.Dense(2)(inputs))
        seq = Sequential([keras.Input((3,)), layers.Dense(2)], name="s")
        for original in (model, seq, keras.Model(model.inputs,
                                                 model.outputs)):
            clone = flexflow_keras.models.clone_model(original)
            self.assertIsInstance(clone, (Model, Sequential))
            self.assertEqual(clone.input_shape, (None, 3))
            self.assertIsNot(clone.layers[-1], original.layers[-1])
        self.assertIsInstance(flexflow_keras.models.clone_model(seq),
                              Sequential)
        self.assertEqual(flexflow_keras.models.clone_model(seq).name, "s")
        loaded = flexflow_keras.models.model_from_json(model.to_json())
        self.assertIsInstance(loaded, Model)
        self.assertNotIsInstance(
            keras.models.model_from_json(model.to_json()), Model
        )


class SaveLoadTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "m.keras")
        self.x = np.random.default_rng(0).normal(size=(8, 3))

    def tearDown(self):
        self.dir.cleanup()

    def test_ours_loads_in_plain_keras(self):
        inputs = keras.Input((3,))
        model = Model(inputs, layers.Dense(2)(inputs))
        model.save(self.path)
        loaded = keras.models.load_model(self.path)
        self.assertIsInstance(loaded, keras.Model)
        np.testing.assert_allclose(loaded.predict(self.x, verbose=0),
                                   model.predict(self.x, verbose=0))

    def test_sequential_loads_in_plain_keras(self):
        model = Sequential([keras.Input((3,)), layers.Dense(2)])
        model.save(self.path)
        loaded = keras.models.load_model(self.path)
        self.assertIsInstance(loaded, keras.Sequential)
        self.assertNotIsInstance(loaded, Sequential)

    def test_plain_keras_loads_as_ours(self):
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        model.save(self.path)
        loaded = flexflow_keras.models.load_model(self.path)
        self.assertIsInstance(loaded, Model)
        np.testing.assert_allclose(loaded.predict(self.x, verbose=0),
                                   model.predict(self.x, verbose=0))
        # Plain Keras is unaffected after our load returns.
        again = keras.models.load_model(self.path)
        self.assertNotIsInstance(again, Model)


class TfKerasTest(unittest.TestCase):
    """With Keras 3, `tf.keras` is Keras: after `import flexflow_keras` its
    model classes and builders are ours, and `import keras` stays plain."""

    def test_model_classes_and_builders_are_ours(self):
        import tensorflow as tf

        self.assertIs(tf.keras.Model, Model)
        self.assertIs(tf.keras.Sequential, Sequential)
        self.assertIs(tf.keras.models.Model, Model)
        self.assertIs(tf.keras.models.load_model,
                      flexflow_keras.models.load_model)
        self.assertIs(tf.keras.utils.deserialize_keras_object,
                      flexflow_keras.utils.deserialize_keras_object)
        model = tf.keras.applications.MobileNetV2(
            input_shape=(32, 32, 3), weights=None, classes=3)
        self.assertIsInstance(model, Model)
        # What stays TensorFlow's flavour, and plain Keras, untouched.
        self.assertIs(tf.keras.layers.Dense, keras.layers.Dense)
        self.assertTrue(hasattr(tf.keras.layers, "ThresholdedReLU"))
        self.assertIsNot(keras.Model, Model)
        self.assertIsNot(keras.models, flexflow_keras.models)

    def test_a_tf_keras_model_with_its_own_step_trains_under_a_strategy(self):
        """keras.io's masked language model: a `tf.keras.Model` subclass
        whose `train_step` takes (features, labels, sample weights) from a
        dataset, calls itself under a tape, updates a loss tracker kept
        outside the model; its feed-forward block a `Sequential`. It
        trained as plain Keras, and the only word was the own-loop
        notice about that `Sequential`."""
        import tensorflow as tf

        import runtime_support

        rng = np.random.default_rng(3)
        tokens = rng.integers(1, 40, size=(64, 12))
        labels = rng.integers(0, 40, size=(64, 12))
        weights = rng.uniform(size=(64, 12)).astype("float32")
        data = tf.data.Dataset.from_tensor_slices(
            (tokens, labels, weights)).batch(16)

        def build(mod):
            base = tf.keras.Model if mod is flexflow_keras else keras.Model
            loss_fn = keras.losses.SparseCategoricalCrossentropy(
                reduction=None)
            tracker = keras.metrics.Mean(name="loss")

            class MaskedLanguageModel(base):
                def train_step(self, inputs):
                    features, targets, sample_weight = inputs
                    with tf.GradientTape() as tape:
                        predictions = self(features, training=True)
                        loss = loss_fn(targets, predictions,
                                       sample_weight=sample_weight)
                    variables = self.trainable_variables
                    gradients = tape.gradient(loss, variables)
                    self.optimizer.apply_gradients(zip(gradients, variables))
                    tracker.update_state(loss, sample_weight=sample_weight)
                    return {"loss": tracker.result()}

                @property
                def metrics(self):
                    return [tracker]

            inputs = mod.Input((12,), dtype="int64")
            h = mod.layers.Embedding(40, 16)(inputs)
            ffn = mod.Sequential([mod.layers.Dense(32, activation="relu"),
                                  mod.layers.Dense(16)], name="ffn")
            h = mod.layers.LayerNormalization()(h + mod.layers.Dropout(
                0.1, seed=2)(ffn(h)))
            model = MaskedLanguageModel(
                inputs, mod.layers.Dense(40, activation="softmax")(h))
            options = {"search_budget": 30} if mod is flexflow_keras else {}
            model.compile(optimizer=keras.optimizers.Adam(1e-2), **options)
            return model

        runs = runtime_support.train_plain_and_ours(
            build, 4, lambda model: model.fit(data, epochs=2,
                                              verbose=0).history)
        ours = runs["ours"][0]
        self.assertIsInstance(ours, Model)
        runtime_support.assert_own_step_under_strategy(self, runs)
        self.assertEqual(
            [m for m in runs["ours"][2] if "outside fit()" in m], [])
        devices = {d for c in ours.strategy.values() for d in c.device_ids}
        self.assertGreater(len(devices), 1)
        runtime_support.assert_same_runs(self, runs)


if __name__ == "__main__":
    unittest.main()
