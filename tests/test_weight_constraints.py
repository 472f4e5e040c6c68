"""Weight constraints (`kernel_constraint=MaxNorm(...)`) hold under every
executor.

Keras's optimizer applies each weight's `constraint` right after updating
it. On one mesh the model's own step runs that `apply`; over several
meshes the layer-by-layer step updates weights with its own rules
(`runtime/optimizers.py`), which once left constraints out: a MaxNorm
kernel grew to 3x its bound and a NonNeg bias went negative, silently.
"""

import unittest

import keras
import numpy as np

import runtime_support as support
from flexflow_keras.runtime import model_step, step

SAMPLES, BATCH = 44, 8  # the last batch is partial


def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = {"ids": rng.integers(0, 20, (n, 6)).astype("int32"),
         "values": rng.normal(size=(n, 8)).astype("float32")}
    return x, rng.integers(0, 3, (n,))


@keras.saving.register_keras_serializable(package="constraint_tests")
class ClipTo(keras.constraints.Constraint):
    """A user's own constraint: clips every entry to [-bound, bound]."""

    def __init__(self, bound):
        self.bound = bound

    def __call__(self, w):
        return keras.ops.clip(w, -self.bound, self.bound)

    def get_config(self):
        return {"bound": self.bound}


def build_constrained(mod):
    """Keras's constraints and a user's, with Dropout, a frozen
    constrained layer (no gradient: Keras leaves it as it is) and two
    inputs. `UnitNorm(axis=1)` normalizes across the kernel's columns,
    which a split of the output dim spreads over devices."""
    ids = mod.Input((6,), dtype="int32", name="ids")
    values = mod.Input((8,), name="values")
    a = mod.layers.Embedding(
        20, 8, embeddings_constraint=ClipTo(0.02))(ids)
    a = mod.layers.GlobalAveragePooling1D()(a)
    b = mod.layers.Dense(
        16, activation="relu",
        kernel_constraint=mod.constraints.MaxNorm(0.4),
        bias_constraint=mod.constraints.NonNeg(), name="bounded")(values)
    b = mod.layers.Dropout(0.25)(b)
    frozen = mod.layers.Dense(
        16, kernel_constraint=mod.constraints.MinMaxNorm(0.5, 0.6),
        name="frozen")
    h = frozen(mod.layers.concatenate([a, b]))
    frozen.trainable = False
    h = mod.layers.Dense(
        16, activation="tanh",
        kernel_constraint=mod.constraints.UnitNorm(axis=1))(h)
    out = mod.layers.Dense(3, activation="softmax", name="out")(h)
    return mod.Model({"ids": ids, "values": values}, out)


def _split_outputs(graph):
    """One mesh: every op with a parameter dim splits it over all
    devices (the Dense kernels' columns), the rest data parallel."""
    return support.parameter(graph)


class WeightConstraintTest(unittest.TestCase):
    def _fit(self, make_strategy, executor, optimizer):
        x, y = _data(SAMPLES, 0)
        compile_args = dict(optimizer=optimizer,
                            loss="sparse_categorical_crossentropy",
                            metrics=["accuracy"])
        histories, models, caught = support.fit_plain_and_ours(
            build_constrained, make_strategy, BATCH, 0, compile_args,
            x=x, y=y, epochs=2, shuffle=False, verbose=0,
            validation_data=_data(12, 1),
        )
        self.assertEqual(caught, [])
        ours = models["ours"]
        self.assertIsInstance(ours.strategy_executor, executor)
        support.assert_same_fits(self, histories, models)
        # The constraints bind: without them these bounds are broken.
        kernel, bias = (w.numpy() for w in ours.get_layer("bounded").weights)
        self.assertLessEqual(np.linalg.norm(kernel, axis=0).max(), 0.4 + 1e-6)
        self.assertGreaterEqual(bias.min(), 0.0)
        return ours

    def test_several_meshes_apply_constraints_as_keras(self):
        for optimizer in ("sgd", "adam"):
            with self.subTest(optimizer):
                ours = self._fit(support.several_meshes, step.Executor,
                                 optimizer)
                self.assertFalse(support.on_one_mesh(ours))

    def test_split_weights_apply_constraints_as_keras(self):
        ours = self._fit(_split_outputs, model_step.ModelStepExecutor,
                         "adamw")
        self.assertTrue(support.on_one_mesh(ours), ours.strategy)


if __name__ == "__main__":
    unittest.main()
