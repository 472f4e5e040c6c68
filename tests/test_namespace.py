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
        for name in ("layers", "ops", "optimizers", "callbacks", "utils",
                     "applications", "saving", "random", "backend"):
            module = importlib.import_module(f"flexflow_keras.{name}")
            self.assertIs(module, getattr(keras, name))
        from flexflow_keras.layers import Dense  # noqa: F401

    def test_model_classes_subclass_keras(self):
        inputs = keras.Input((3,))
        model = Model(inputs, layers.Dense(2)(inputs))
        self.assertIsInstance(model, keras.Model)
        self.assertIsInstance(model, Model)
        seq = Sequential([keras.Input((3,)), layers.Dense(2)])
        self.assertIsInstance(seq, keras.Sequential)
        self.assertIs(flexflow_keras.models.Model, Model)
        self.assertIs(flexflow_keras.Model, Model)


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


if __name__ == "__main__":
    unittest.main()
