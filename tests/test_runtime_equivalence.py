"""Every strategy computes what plain Keras computes (the SOAP promise).

3 epochs of `fit` under a strategy give the same per-epoch losses and
final weights as plain Keras `fit` on one device, within 1e-5 relative.
The unmarked tests are a representative subset; `-m slow` runs the sweep
(every model x {data parallel, operator placement, parameter split} x
{SGD, momentum SGD, Adam}, and 20 random strategies per model).
"""

import itertools
import random
import unittest

import keras
import numpy as np
import pytest

import runtime_support as support
from flexflow_keras.runtime import model_step, step
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.strategy import Strategy

EQUIVALENCE_MODELS = (
    "mlp", "cnn", "two_input_concat", "nested", "transformer", "embedding",
)
STRATEGIES = {
    "data_parallel": support.data_parallel,
    "placement": support.placement,
    "parameter": support.parameter,
}


def train_both(name, make_strategy, optimizer, samples=20, batch_size=8):
    """Fits both models 3 epochs; the last batch is partial (20 = 8+8+4)."""
    ref, model = support.build_pair(name, optimizer)
    support.attach(model, make_strategy, batch_size)
    x, y = support.MODELS[name][1](samples)
    kwargs = dict(batch_size=batch_size, epochs=3, verbose=0, shuffle=False)
    history = model.fit(x, y, **kwargs)
    history_ref = ref.fit(x, y, **kwargs)
    return ref, model, history_ref, history


class RuntimeEquivalenceTest(unittest.TestCase):
    def check(self, name, make_strategy, optimizer):
        ref, model, history_ref, history = train_both(
            name, make_strategy, optimizer
        )
        support.assert_same_training(self, ref, model, history_ref, history)

    def test_mlp_data_parallel_sgd(self):
        self.check("mlp", support.data_parallel, "sgd")

    def test_cnn_batchnorm_parameter_momentum(self):
        self.check("cnn", support.parameter, "momentum")

    def test_two_input_concat_placement_adam(self):
        self.check("two_input_concat", support.placement, "adam")

    def test_nested_parameter_sgd(self):
        self.check("nested", support.parameter, "sgd")

    def test_transformer_data_parallel_adam(self):
        self.check("transformer", support.data_parallel, "adam")

    def test_embedding_parameter_adam(self):
        self.check("embedding", support.parameter, "adam")

    def test_shared_layer_random_strategy_momentum(self):
        self.check("shared_layer", support.random_strategy(3), "momentum")

    def test_untied_shared_layer_is_refused(self):
        """The runtime runs the strategy it gets: a shared layer's call
        on another mesh than its weights is an error, not re-placed."""
        _, model = support.build_pair("shared_layer", "momentum")
        with self.assertRaisesRegex(
            ValueError, "'shared#1' calls the shared layer of 'shared'.*"
            "tie_shared"
        ):
            support.attach(model, support.random_strategy(3, tied=False), 8)

    def test_random_strategies_mlp_cnn_transformer(self):
        for name, seed in (("mlp", 1), ("cnn", 2), ("transformer", 3)):
            with self.subTest(name=name, seed=seed):
                self.check(name, support.random_strategy(seed), "adam")

    def test_one_device_strategy_runs_keras_step_on_that_device(self):
        def on_device_2(graph):
            return Strategy({
                op.name: support.ParallelConfig((1,) * op.rank, (2,))
                for op in graph
            })

        ref, model, history_ref, history = train_both(
            "cnn", on_device_2, "adam"
        )
        self.assertTrue(model.strategy_executor.single_device.endswith(":2"))
        support.assert_same_training(self, ref, model, history_ref, history)

    def test_multi_segment_strategy_runs_per_mesh_functions(self):
        ref, model = support.build_pair("mlp")
        support.attach(model, support.placement, 8)
        self.assertIsInstance(model.strategy_executor, step.Executor)
        self.assertGreater(len(model.strategy_executor.segments), 1)

    def test_data_parallel_runs_the_models_own_step(self):
        ref, model = support.build_pair("cnn")
        support.attach(model, support.data_parallel, 8)
        self.assertIsInstance(
            model.strategy_executor, model_step.ModelStepExecutor
        )


@pytest.mark.slow
class RuntimeEquivalenceSweepTest(unittest.TestCase):
    def test_models_strategies_optimizers(self):
        for name, strategy, optimizer in itertools.product(
            EQUIVALENCE_MODELS, STRATEGIES, support.OPTIMIZERS
        ):
            with self.subTest(name=name, strategy=strategy, opt=optimizer):
                ref, model, history_ref, history = train_both(
                    name, STRATEGIES[strategy], optimizer
                )
                support.assert_same_training(
                    self, ref, model, history_ref, history
                )

    def test_twenty_random_strategies_per_model(self):
        optimizers = list(support.OPTIMIZERS)
        for name in EQUIVALENCE_MODELS:
            for seed in range(20):
                optimizer = optimizers[seed % len(optimizers)]
                with self.subTest(name=name, seed=seed, opt=optimizer):
                    ref, model, history_ref, history = train_both(
                        name, support.random_strategy(100 + seed), optimizer
                    )
                    support.assert_same_training(
                        self, ref, model, history_ref, history
                    )


class EveryConfigExecutesTest(unittest.TestCase):
    """Each op type under configs drawn as the search draws them."""

    def run_random_configs(self, names, draws):
        from flexflow_keras.search_space import random_config

        for name in names:
            ref, model = support.build_pair(name)
            graph = build_graph(model, 8)
            x, y = support.MODELS[name][1](8)
            rng = random.Random(name)
            for draw in range(draws):
                # One op at a time gets a random config, the rest stay
                # data parallel: every op type meets many of its configs.
                base = dict(Strategy.data_parallel(graph, 4))
                for op in graph:
                    base[op.name] = random_config(op, 4, rng)
                strategy = Strategy(base)
                with self.subTest(name=name, draw=draw):
                    support.runtime.attach_strategy(model, graph, strategy)
                    model.set_weights(ref.get_weights())
                    loss = model.train_on_batch(x, y)
                    expected = keras.models.clone_model(ref)
                    expected.set_weights(ref.get_weights())
                    expected.compile(
                        optimizer=support.OPTIMIZERS["sgd"](),
                        loss=support.MODELS[name][2],
                    )
                    np.testing.assert_allclose(
                        loss, expected.train_on_batch(x, y), rtol=1e-5
                    )
                    np.testing.assert_allclose(
                        model.predict(x, verbose=0),
                        expected.predict(x, verbose=0),
                        rtol=1e-4, atol=1e-6,
                    )

    def test_random_configs_of_each_op_type(self):
        # One draw each; the slow test below draws ten of every model.
        self.run_random_configs(("transformer", "embedding", "cnn", "lstm"), 1)

    @pytest.mark.slow
    def test_many_random_configs_of_each_op_type(self):
        self.run_random_configs(tuple(support.MODELS) + ("lstm",), 10)
