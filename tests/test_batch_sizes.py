"""Any batch plain Keras accepts trains under a strategy (issue 21, item 2).

A global batch (or a last partial batch) that the 4 devices do not
divide splits as far as it divides (`strategy.largest_divisor`), other
dims taking the devices left over; nothing raises, nothing is padded.

`PlanningRuleTest` checks the rule on hand-built graphs (pure Python);
`BatchSizeTrainingTest` trains small models 2 epochs under a searched
strategy on the 4 virtual CPU devices at batches 50, 30, 7, 1 and with a
partial last batch, and compares with plain Keras from the same weights
(losses and weights within 1e-5 relative). A Dense model keeps the whole
SOAP space; one with an activity regularizer (a loss added by the layer's
call) runs its own step on one mesh.
"""

import os
import random
import unittest
import warnings
from unittest import mock

import keras
import numpy as np
import pytest

import flexflow_keras as fk
from flexflow_keras import search as search_lib
from flexflow_keras import search_space
from flexflow_keras import strategy_files
from flexflow_keras.graph import SAMPLE, Op, OpGraph, TensorInfo
from flexflow_keras.strategy import (
    ParallelConfig, Strategy, data_parallel_config, largest_divisor,
)
from hand_graphs import hand_graph
from runtime_support import on_one_mesh, relative_error

NUM_DEVICES = 4
EPOCHS = 2
RTOL = 1e-5


def _batch_only_graph(batch: int) -> OpGraph:
    """x (batch, 4) -> `conv` (batch, 4): an op that splits the batch
    only, as a convolution does."""
    tensors = {
        "x": TensorInfo("x", (batch, 4), "float32"),
        "conv:0": TensorInfo("conv:0", (batch, 4), "float32", "conv"),
    }
    op = Op(
        name="conv", type="Conv1D", inputs=("x",), outputs=("conv:0",),
        input_shapes=((batch, 4),), output_shapes=((batch, 4),),
        dtype="float32", partitionable={0: SAMPLE},
    )
    return OpGraph((op,), tensors, ("x",), ("conv:0",), batch)


class PlanningRuleTest(unittest.TestCase):
    """The rule, on graphs whose SOAP dims are fixed by hand."""

    def test_largest_divisor(self):
        cases = {(8, 4): 4, (50, 4): 2, (30, 4): 3, (7, 4): 1, (1, 4): 1,
                 (6, 4): 3, (2, 4): 2, (50, 1): 1}
        for (size, limit), degree in cases.items():
            self.assertEqual(largest_divisor(size, limit), degree,
                             (size, limit))

    def test_data_parallel_is_valid_for_any_batch(self):
        for batch in (1, 2, 6, 7, 8, 30, 50, 97):
            graph = hand_graph(batch)
            for n in (1, 2, 3, 4, 8):
                strategy = Strategy.data_parallel(graph, n)
                strategy.validate(graph, n)

    def test_divisible_batch_is_plain_data_parallelism(self):
        strategy = Strategy.data_parallel(hand_graph(8), 4)
        for config in strategy.values():
            self.assertEqual(config, ParallelConfig((4, 1), (0, 1, 2, 3)))

    def test_batch_splits_as_far_as_it_divides_other_dims_for_the_rest(self):
        # hand_graph: Dense ops (batch, 6|6|2) split sample and
        # parameter dims, `relu` (batch, 2) the sample dim only.
        expected = {
            50: {"dense_0": (2, 2), "dense_2": (2, 2), "relu": (2, 1)},
            30: {"dense_0": (3, 1), "dense_2": (3, 1), "relu": (3, 1)},
            7: {"dense_0": (1, 3), "dense_2": (1, 2), "relu": (1, 1)},
            1: {"dense_0": (1, 3), "dense_2": (1, 2), "relu": (1, 1)},
        }
        for batch, dims in expected.items():
            strategy = Strategy.data_parallel(hand_graph(batch), 4)
            for name, want in dims.items():
                config = strategy[name]
                self.assertEqual(config.dims, want, (batch, name))
                self.assertEqual(
                    config.device_ids, tuple(range(config.num_parts))
                )

    def test_op_splitting_only_the_batch_uses_fewer_devices(self):
        graph = _batch_only_graph(50)
        self.assertEqual(
            data_parallel_config(graph.op("conv"), 4),
            ParallelConfig((2, 1), (0, 1)),
        )
        self.assertEqual(
            data_parallel_config(_batch_only_graph(7).op("conv"), 4),
            ParallelConfig((1, 1), (0,)),
        )

    def test_one_mesh_configs_are_never_empty(self):
        for batch in (1, 7, 30, 50):
            graph = hand_graph(batch)
            for parts in range(1, 5):
                for op in graph:
                    configs = search_space.one_mesh_configs(op, parts)
                    self.assertTrue(configs, (batch, parts, op.name))
                    for config in configs:
                        self.assertIn(config.device_ids,
                                      {(0,), tuple(range(parts))})

    def test_one_mesh_keeps_ops_that_cannot_split_replicated(self):
        relu = hand_graph(7).op("relu")  # splits the batch only
        self.assertEqual(search_space.one_mesh_configs(relu, 4),
                         [ParallelConfig((1, 1), (0,))])
        self.assertEqual(search_space.one_mesh_splits(relu, 4), [])
        dense = hand_graph(7).op("dense_0")  # (7, 6): 2 of 6 channels
        # The split first, the unsplit config last: an op may always
        # stay whole (replicated) on the mesh.
        self.assertEqual(search_space.one_mesh_configs(dense, 2),
                         [ParallelConfig((1, 2), (0, 1)),
                          ParallelConfig((1, 1), (0,))])

    def test_one_mesh_devices_for_any_batch(self):
        # Every op splits 4 ways at batch 8; 2 and 3 divide 50 and 30
        # for every op; at 7 and 1 the relu splits nothing, and 2
        # devices let the three Dense ops split their channels.
        expected = {8: 4, 50: 2, 30: 3, 7: 2, 1: 2}
        for batch, parts in expected.items():
            graph = hand_graph(batch)
            self.assertEqual(
                search_space.one_mesh_devices(graph, 4), parts, batch
            )
            strategy = search_space.one_mesh_data_parallel(graph, parts)
            strategy.validate(graph, 4)
            self.assertTrue(search_space.is_one_mesh(strategy), strategy)
        self.assertEqual(search_space.one_mesh_devices(
            _batch_only_graph(7), 4), 1)

    def test_one_mesh_random_strategies_for_odd_batches(self):
        rng = random.Random(0)
        for batch in (1, 7, 50):
            graph = hand_graph(batch)
            parts = search_space.one_mesh_devices(graph, 4)
            for _ in range(20):
                drawn = search_space.random_strategy(graph, 4, rng, parts)
                drawn.validate(graph, 4)
                self.assertTrue(search_space.is_one_mesh(drawn), drawn)

    def test_search_plans_any_batch_on_the_simulator(self):
        from flexflow_keras.machine import load_machine
        from flexflow_keras.simulator import Simulator

        machine = load_machine("v100x4")
        for batch in (50, 30, 7, 1):
            graph = hand_graph(batch)
            sim = Simulator(graph, machine)
            for parts in (None, search_space.one_mesh_devices(graph, 4)):
                result = search_lib.search(
                    graph, sim, 4, budget=40, seed=0, verbose=0,
                    one_mesh_parts=parts,
                )
                result.strategy.validate(graph, 4)
                devices = {d for c in result.strategy.values()
                           for d in c.device_ids}
                self.assertGreater(len(devices), 1, (batch, parts))
                self.assertLess(result.data_parallel_ms, float("inf"))
                if parts is not None:
                    self.assertTrue(
                        search_space.is_one_mesh(result.strategy, 4)
                    )

    def test_strategy_file_fills_missing_ops_for_any_batch(self):
        graph = hand_graph(50)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            strategy = strategy_files.complete(
                {"dense_0": ParallelConfig((1, 2), (0, 1))}, graph, 4,
                "s.txt",
            )
        strategy.validate(graph, 4)
        self.assertEqual(strategy["relu"], ParallelConfig((2, 1), (0, 1)))


# -- training, against plain Keras ------------------------------------------


def _dense_model(mod):
    inputs = mod.Input((8,))
    h = mod.layers.Dense(16, activation="relu")(inputs)
    model = mod.Model(inputs, mod.layers.Dense(4)(h))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def _regularized_model(mod):
    inputs = mod.Input((8,))
    h = mod.layers.Dense(16, activation="relu",
                         activity_regularizer="l2")(inputs)
    model = mod.Model(inputs, mod.layers.Dense(4)(h))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def _conv_model(mod):
    """A convolution splits the batch only: at batch 50 data parallelism
    puts it on 2 devices and the Dense on 4, two meshes."""
    inputs = mod.Input((6, 3))
    h = mod.layers.Conv1D(4, 3, activation="relu")(inputs)
    h = mod.layers.Flatten()(h)
    model = mod.Model(inputs, mod.layers.Dense(4)(h))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def _conv_data(samples):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(samples, 6, 3)).astype("float32"),
            rng.normal(size=(samples, 4)).astype("float32"))


def _text_classifier(mod):
    """The issue's report: an embedding bag classifier at batch 50."""
    inputs = mod.Input((10,), dtype="int32")
    h = mod.layers.Embedding(50, 8)(inputs)
    h = mod.layers.GlobalAveragePooling1D()(h)
    h = mod.layers.Dense(8, activation="relu")(h)
    model = mod.Model(inputs, mod.layers.Dense(1, activation="sigmoid")(h))
    model.compile(optimizer="adam", loss="binary_crossentropy",
                  metrics=["accuracy"])
    return model


def _dense_data(samples):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(samples, 8)).astype("float32"),
            rng.normal(size=(samples, 4)).astype("float32"))


def _text_data(samples):
    rng = np.random.default_rng(0)
    return (rng.integers(0, 50, (samples, 10)).astype("int32"),
            rng.integers(0, 2, (samples, 1)).astype("float32"))


MODELS = {
    "dense": (_dense_model, _dense_data),
    "regularized": (_regularized_model, _dense_data),
    "text_classifier": (_text_classifier, _text_data),
    "conv": (_conv_model, _conv_data),
}
# (global batch, samples): two full steps, or a last partial batch.
BATCHES = {"50": (50, 100), "30": (30, 60), "7": (7, 14), "1": (1, 3),
           "partial_70_at_32": (32, 70)}
SEARCH = mock.patch.dict(os.environ, {
    "FLEXFLOW_KERAS_SEARCH_BUDGET": "50",
    "FLEXFLOW_KERAS_SEARCH_SEED": "0",
})
NO_SEARCH = mock.patch.dict(os.environ, {"FLEXFLOW_KERAS_SEARCH_BUDGET": "0"})


def train_both(test, model_name, batch, samples, search=SEARCH):
    """Trains `model_name` at `batch` both ways (ours planned under the
    `search` settings); asserts it ran under a multi-device strategy and
    equals plain Keras."""
    build, data = MODELS[model_name]
    x, y = data(samples)
    keras.utils.set_random_seed(7)
    plain = build(keras)
    keras.utils.set_random_seed(7)
    with search:
        ours = build(fk)
    ours.set_weights(plain.get_weights())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours_history = ours.fit(x, y, batch_size=batch, epochs=EPOCHS,
                                shuffle=False, verbose=0).history
    plain_history = plain.fit(x, y, batch_size=batch, epochs=EPOCHS,
                              shuffle=False, verbose=0).history
    fell_back = [str(w.message) for w in caught
                 if "plain Keras" in str(w.message)]
    test.assertEqual(fell_back, [])
    test.assertEqual(ours.plan.graph.batch_size, batch)
    test.assertIsNotNone(ours.strategy_executor)
    ours.strategy.validate(ours.plan.graph, NUM_DEVICES)
    devices = {d for c in ours.strategy.values() for d in c.device_ids}
    test.assertGreater(len(devices), 1, ours.strategy)
    for key, values in plain_history.items():
        np.testing.assert_allclose(ours_history[key], values, rtol=RTOL,
                                   atol=1e-7, err_msg=key)
    for a, b in zip(plain.get_weights(), ours.get_weights()):
        test.assertLess(relative_error(b, a), RTOL)
    return ours


class BatchSizeTrainingTest(unittest.TestCase):
    def _cases(self, model_name):
        for label, (batch, samples) in BATCHES.items():
            with self.subTest(batch=label):
                train_both(self, model_name, batch, samples)

    def test_dense_model(self):
        self._cases("dense")

    def test_model_with_an_activity_regularizer_runs_its_step_on_one_mesh(
            self):
        from flexflow_keras.runtime import model_step

        ours = train_both(self, "regularized", 50, 100)
        self.assertIsInstance(ours.strategy_executor,
                              model_step.ModelStepExecutor)
        self.assertTrue(on_one_mesh(ours), ours.strategy)
        self._cases("regularized")

    def test_uneven_data_parallelism_runs_on_one_2d_mesh(self):
        from flexflow_keras.runtime import model_step

        # At batch 50 on 4 devices the conv splits its batch 2 ways and
        # the Dense ops split batch and channels 2x2: the blocks of one
        # 2x2 mesh, so the model's own step runs it (issue 22).
        # 120 samples at 50: a last partial batch of 20 too.
        for batch, samples in ((50, 100), (50, 120)):
            with self.subTest(batch=batch, samples=samples):
                ours = train_both(self, "conv", batch, samples, NO_SEARCH)
                self.assertEqual(ours.plan.source, "data_parallel")
                dims = {op.type: ours.strategy[op.name].dims
                        for op in ours.plan.graph}
                self.assertEqual(dims["Conv1D"], (2, 1, 1))
                self.assertEqual(dims["Dense"], (2, 2))
                self.assertTrue(on_one_mesh(ours), ours.strategy)
                self.assertIsInstance(ours.strategy_executor,
                                      model_step.ModelStepExecutor)

    def test_text_classifier_at_batch_50(self):
        train_both(self, "text_classifier", 50, 100)

    def test_zero_budget_plans_odd_batches(self):
        for batch in (50, 7):
            with self.subTest(batch=batch):
                model = _dense_model(fk)
                model.compile(optimizer="adam", loss="mse",
                              batch_size=batch, search_budget=0)
                self.assertEqual(model.plan.source, "data_parallel")
                self.assertEqual(
                    model.strategy,
                    Strategy.data_parallel(model.plan.graph, NUM_DEVICES),
                )


@pytest.mark.slow
class SlowBatchSizeTrainingTest(unittest.TestCase):
    def test_text_classifier_every_batch(self):
        for label, (batch, samples) in BATCHES.items():
            with self.subTest(batch=label):
                train_both(self, "text_classifier", batch, samples)
