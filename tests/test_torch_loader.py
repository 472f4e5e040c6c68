"""fit(), evaluate() and predict() on a PyTorch `DataLoader`.

Keras 3 reads a `DataLoader` on every backend (keras.io's "Introduction
to Keras for engineers" and "Training & evaluation with the built-in
methods"). The package reads its first batches for the batch size and
lengths it plans for, with the script's random streams put back (a
loader that shuffles draws its order from torch's generator), and runs
what plain Keras runs from the same seed.

PyTorch is no dependency of the package: where it is not installed, a
stand-in with the parts Keras and the package use (a `DataLoader` class
in `torch.utils.data` that shuffles from `torch.random`'s generator,
tensors with `.cpu()`) is put in `sys.modules` for the test.
"""

import importlib.util
import sys
import types
import unittest
from unittest import mock

import numpy as np

from runtime_support import train_plain_and_ours

RNG = np.random.default_rng(0)
X = RNG.normal(size=(200, 12)).astype("float32")
Y = RNG.integers(0, 4, 200)
TRAIN_BATCH, VALIDATION_BATCH = 40, 64


def _stand_in_torch() -> dict:
    """Modules for `sys.modules`: just enough PyTorch for Keras's
    `TorchDataLoaderAdapter` and the package."""
    generator = {"state": np.random.RandomState(0)}

    class Tensor:
        def __init__(self, array):
            self.array = array

        shape = property(lambda self: self.array.shape)
        dtype = property(lambda self: self.array.dtype)

        def cpu(self):
            return self

        def __array__(self, dtype=None, copy=None):
            return self.array if dtype is None else self.array.astype(dtype)

    class TensorDataset:
        def __init__(self, *arrays):
            self.arrays = arrays

        def __len__(self):
            return len(self.arrays[0])

    class DataLoader:
        def __init__(self, dataset, batch_size=1, shuffle=False):
            self.dataset, self.batch_size = dataset, batch_size
            self.shuffle = shuffle

        def __len__(self):
            return -(-len(self.dataset) // self.batch_size)

        def __iter__(self):
            count = len(self.dataset)
            order = (generator["state"].permutation(count) if self.shuffle
                     else np.arange(count))
            for start in range(0, count, self.batch_size):
                rows = order[start:start + self.batch_size]
                yield [Tensor(a[rows]) for a in self.dataset.arrays]

    torch = types.ModuleType("torch")
    torch.utils = types.ModuleType("torch.utils")
    torch.utils.data = types.ModuleType("torch.utils.data")
    torch.random = types.ModuleType("torch.random")
    DataLoader.__module__ = "torch.utils.data.dataloader"
    torch.utils.data.DataLoader = DataLoader
    torch.utils.data.TensorDataset = TensorDataset
    torch.random.get_rng_state = lambda: generator["state"].get_state()
    torch.random.set_rng_state = (
        lambda state: generator["state"].set_state(state))
    torch.manual_seed = lambda seed: generator.update(
        state=np.random.RandomState(seed))
    torch.from_numpy = lambda array: array
    return {"torch": torch, "torch.utils": torch.utils,
            "torch.utils.data": torch.utils.data,
            "torch.random": torch.random}


def _build(mod):
    """A subclassed model (traced on its data's shapes: the lengths are
    read ahead) with Dropout (a seed the step draws from)."""

    class Classifier(mod.Model):
        def __init__(self):
            super().__init__()
            self.hidden = mod.layers.Dense(16, activation="relu")
            self.dropout = mod.layers.Dropout(0.3, seed=2)
            self.out = mod.layers.Dense(4)

        def call(self, x, training=False):
            return self.out(self.dropout(self.hidden(x),
                                         training=training))

    model = Classifier()
    model.compile(mod.optimizers.Adam(3e-3),
                  mod.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _train(model):
    torch = sys.modules["torch"]
    torch.manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.from_numpy(X),
                                          torch.from_numpy(Y))
    train = torch.utils.data.DataLoader(data, batch_size=TRAIN_BATCH,
                                        shuffle=True)
    validation = torch.utils.data.DataLoader(
        data, batch_size=VALIDATION_BATCH)
    history = model.fit(train, epochs=3, verbose=0,
                        validation_data=validation).history
    return {"fit": history,
            "evaluate": model.evaluate(validation, verbose=0),
            "predict": model.predict(validation, verbose=0),
            "weights": model.get_weights()}


class DataLoaderTest(unittest.TestCase):

    def _check(self):
        runs = train_plain_and_ours(_build, 1, _train)
        _, expected, _ = runs["plain"]
        model, got, said = runs["ours"]
        self.assertEqual([s for s in said if "plain Keras" in s], [])
        self.assertIsNotNone(model.strategy_executor)
        # Planned for the loader's batches, not Keras's default 32.
        self.assertEqual(model.plan.graph.batch_size, TRAIN_BATCH)
        for name, values in expected["fit"].items():
            np.testing.assert_allclose(got["fit"][name], values, rtol=1e-5,
                                       err_msg=name)
        for key in ("evaluate", "predict"):
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-5,
                                       atol=1e-6, err_msg=key)
        for ours, plain in zip(got["weights"], expected["weights"]):
            np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-6)

    def test_a_stand_in_loader_trains_as_plain_keras_does(self):
        with mock.patch.dict(sys.modules, _stand_in_torch()):
            self._check()

    @unittest.skipUnless(importlib.util.find_spec("torch"),
                         "PyTorch is not installed")
    def test_a_pytorch_loader_trains_as_plain_keras_does(self):
        import torch  # noqa: F401

        self._check()


if __name__ == "__main__":
    unittest.main()
