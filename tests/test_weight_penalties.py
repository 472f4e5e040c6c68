"""Weight regularizers keep the whole strategy space (issue 22).

A `kernel_regularizer` (any regularizer Keras keeps on a variable) used
to make a model run its own step, so its search kept to one mesh and
found only data parallelism on FlexFlow's suite. Keras's default step
counts the penalty in `compute_loss`; the layer-by-layer step counts it
the same way (`step.Executor._penalty`), so such a model is planned over
several meshes and trains equal to plain Keras. An activity regularizer
(a loss added while the layer is called) still needs the model's own
step.
"""

import unittest

import keras
import numpy as np

import runtime_support as support
from flexflow_keras import runtime
from flexflow_keras.runtime import step

SAMPLES, BATCH = 44, 8  # the last batch is partial


def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = {"ids": rng.integers(0, 20, (n, 6)).astype("int32"),
         "values": rng.random((n, 8), dtype=np.float32)}
    return x, rng.integers(0, 3, (n,))


def build_penalized(mod):
    """Every kind of weight penalty, with Dropout, BatchNormalization, a
    frozen penalized layer (Keras counts trainable weights' penalties
    only) and two inputs."""
    ids = mod.Input((6,), dtype="int32", name="ids")
    values = mod.Input((8,), name="values")
    a = mod.layers.Embedding(
        20, 8, embeddings_regularizer=mod.regularizers.L2(1e-3))(ids)
    a = mod.layers.GlobalAveragePooling1D()(a)
    b = mod.layers.Dense(
        16, activation="tanh",
        kernel_regularizer=mod.regularizers.L2(0.1),
        bias_regularizer=mod.regularizers.L2(1e-3))(values)
    b = mod.layers.BatchNormalization(
        gamma_regularizer=mod.regularizers.L2(1e-3))(b)
    b = mod.layers.Dropout(0.25)(b)
    frozen = mod.layers.Dense(
        16, kernel_regularizer=mod.regularizers.L1L2(1e-3, 1e-2),
        name="frozen")
    h = frozen(mod.layers.concatenate([a, b]))
    frozen.trainable = False
    out = mod.layers.Dense(
        3, activation="softmax",
        kernel_regularizer=mod.regularizers.OrthogonalRegularizer(0.01),
        name="out")(h)
    return mod.Model({"ids": ids, "values": values}, out)


COMPILE = dict(optimizer="adam", loss="sparse_categorical_crossentropy",
               metrics=["accuracy"])


class WeightPenaltyTest(unittest.TestCase):
    def test_weight_regularizers_are_not_a_reason_for_the_own_step(self):
        import flexflow_keras as fk

        model = build_penalized(fk)
        model.compile(**COMPILE)
        self.assertEqual(runtime.own_step_reasons(model), [])
        inputs = fk.Input((4,))
        active = fk.Model(inputs, fk.layers.Dense(
            2, activity_regularizer="l2", name="act")(inputs))
        active.compile(optimizer="sgd", loss="mse")
        self.assertEqual(runtime.own_step_reasons(active),
                         ["layer 'act' has activity_regularizer"])

    def test_several_meshes_train_equal_to_plain_keras(self):
        x, y = _data(SAMPLES, 0)
        histories, models, caught = support.fit_plain_and_ours(
            build_penalized, support.several_meshes, BATCH, 0, COMPILE,
            x=x, y=y, epochs=2, shuffle=False, verbose=0,
            validation_data=_data(12, 1),
        )
        self.assertEqual(caught, [])
        ours = models["ours"]
        self.assertFalse(support.on_one_mesh(ours))
        self.assertIsInstance(ours.strategy_executor, step.Executor)
        # The penalty is in the loss: far above the crossentropy's 1.1.
        self.assertGreater(histories["plain"]["loss"][0], 1.5)
        support.assert_same_fits(self, histories, models)
        data = _data(12, 2)
        np.testing.assert_allclose(
            ours.evaluate(*data, batch_size=BATCH, verbose=0),
            models["plain"].evaluate(*data, batch_size=BATCH, verbose=0),
            rtol=1e-5)


if __name__ == "__main__":
    unittest.main()
