"""Expert strategies (issue 12) and the search's start from them."""

import random
import unittest

import model_zoo
from flexflow_keras import experts, search
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.machine import load_machine
from flexflow_keras.simulator import Simulator
from flexflow_keras.strategy import Strategy


def small_graph(name: str):
    module = model_zoo.load_example(name)
    return build_graph(module.build_model(small=True), module.SMALL["batch"])


class ExpertStrategyTest(unittest.TestCase):
    def test_one_weird_trick_splits_batch_then_channels(self):
        graph = small_graph("alexnet")
        strategy = experts.one_weird_trick(graph, 4)
        strategy.validate(graph, 4)
        self.assertEqual(strategy["conv1"].dims, (4, 1, 1, 1))
        self.assertEqual(strategy["pool5"].dims, (4, 1, 1, 1))
        for name in ("fc6", "fc7"):  # 256 units: 4 channel slices
            self.assertEqual(strategy[name].dims, (1, 4))
            self.assertEqual(strategy[name].device_ids, (0, 1, 2, 3))
        # 10 classes: the largest degree <= 4 dividing 10.
        self.assertEqual(strategy["fc8"].dims, (1, 2))

    def test_layerwise_placement_puts_each_rnn_on_its_device(self):
        graph = small_graph("rnntc")
        strategy = experts.layerwise_placement(graph, 4)
        strategy.validate(graph, 4)
        for i in range(4):
            self.assertEqual(strategy[f"lstm_{i}"].device_ids, (i,))
            self.assertEqual(strategy[f"lstm_{i}"].num_parts, 1)
        self.assertEqual(strategy["embed"].device_ids, (0,))
        self.assertEqual(strategy["softmax"].dims, (1, 2))  # 2 classes

    def test_layerwise_placement_wraps_and_splits_the_softmax(self):
        graph = small_graph("nmt")
        strategy = experts.layerwise_placement(graph, 2)
        strategy.validate(graph, 2)
        self.assertEqual(
            [strategy[f"encoder_{i}"].device_ids for i in range(2)]
            + [strategy[f"decoder_{i}"].device_ids for i in range(2)],
            [(0,), (1,), (0,), (1,)],
        )
        self.assertEqual(strategy["softmax"].dims, (1, 1, 2))

    def test_embedding_columns_split_every_table(self):
        graph = small_graph("dlrm")
        strategy = experts.embedding_columns(graph, 4)
        strategy.validate(graph, 4)
        for i in range(8):
            self.assertEqual(strategy[f"embedding_{i}"].dims, (1, 1, 4))
        dp = Strategy.data_parallel(graph, 4)
        self.assertEqual(strategy["top_0"], dp["top_0"])

    def test_expert_name_by_model_kind(self):
        expected = {
            "alexnet": "one_weird_trick", "rnnlm": "layerwise_placement",
            "nmt": "layerwise_placement", "dlrm": "embedding_columns",
            "transformer_encoder": None,
        }
        for name, expert in expected.items():
            with self.subTest(name):
                self.assertEqual(experts.expert_name(small_graph(name)),
                                 expert)

    def test_search_is_never_slower_than_its_candidate(self):
        graph = small_graph("dlrm")
        machine = load_machine("v100x4")
        expert = experts.expert_strategy(graph, 4)
        expert_ms = Simulator(graph, machine).simulate(expert).step_ms
        result = search.search(graph, Simulator(graph, machine), 4,
                               budget=50, seed=0, verbose=0,
                               candidates=(expert,))
        self.assertLessEqual(result.best_ms, expert_ms)
        bad = Strategy({**dict(expert), "top_0": expert["embedding_0"]})
        with self.assertRaisesRegex(ValueError, "top_0"):
            search.search(graph, Simulator(graph, machine), 4, budget=1,
                          verbose=0, candidates=(bad,))


class RelativeAcceptanceTest(unittest.TestCase):
    def decisions(self, cur_ms: float, next_ms: float, **kw) -> list[bool]:
        rng = random.Random(0)
        return [search._accept(next_ms, cur_ms, rng=rng, **kw)
                for _ in range(200)]

    def test_same_relative_change_same_decisions_at_any_scale(self):
        small = self.decisions(2.0, 2.1, alpha=None, relative_alpha=20.0)
        large = self.decisions(200.0, 210.0, alpha=None, relative_alpha=20.0)
        self.assertEqual(small, large)
        self.assertTrue(0 < sum(small) < 200)  # exp(-1): some, not all

    def test_per_ms_alpha_depends_on_the_scale(self):
        small = self.decisions(2.0, 2.1, alpha=0.05, relative_alpha=20.0)
        large = self.decisions(200.0, 210.0, alpha=0.05, relative_alpha=20.0)
        self.assertGreater(sum(small), sum(large))

    def test_faster_always_and_infeasible_never(self):
        self.assertTrue(all(self.decisions(10.0, 9.0, alpha=None,
                                           relative_alpha=1e9)))
        self.assertFalse(any(self.decisions(10.0, float("inf"), alpha=None,
                                            relative_alpha=0.0)))


if __name__ == "__main__":
    unittest.main()
