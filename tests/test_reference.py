"""Reference optima: the chain dynamic program and exhaustive enumeration
are exact over what they cover, and the search reaches them."""

import itertools
import math
import unittest

import keras

from flexflow_keras import reference
from flexflow_keras import search as search_lib
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.machine import load_machine
from flexflow_keras.search_space import valid_configs
from flexflow_keras.simulator import Simulator
from flexflow_keras.strategy import Strategy
from flexflow_keras.taskgraph import FWD, XFER_FWD, Piece
from test_search import exhaustive_optimum as brute_force
from test_search import mlp_graph


def _wide_mlp():
    """Big weights, small batch: data parallelism is far from optimal."""
    return mlp_graph(batch=64, units=(2048, 2048, 64), features=2048)


class PhaseTest(unittest.TestCase):
    def test_phases_add_and_tasks_queue_on_shared_resources(self):
        piece = Piece(
            durations_ms=(1.0, 2.0, 3.0, 4.0, 0.5),
            # Two forwards on devices 0 and 1 (parallel); three transfers,
            # two of them on link 9 (serial), one on links 8 and 10.
            resources=((0,), (1,), (9,), (9,), (8, 10)),
            priorities=(0, 1, 2, 3, 4),
            labels=((FWD, "a", ""), (FWD, "a", ""), (XFER_FWD, "b", ""),
                    (XFER_FWD, "b", ""), (XFER_FWD, "b", "")),
        )
        self.assertEqual(reference.phase_ms(piece), 2.0 + 7.0)
        self.assertEqual(reference.phase_ms(Piece()), 0.0)


class ChainTest(unittest.TestCase):
    def test_chain_order(self):
        graph = mlp_graph(batch=8, units=(4, 4, 2))
        self.assertEqual([op.name for op in reference.chain_order(graph)],
                         ["dense_0", "dense_1", "dense_2"])
        inputs = keras.Input(shape=(4,), name="x")
        hidden = keras.layers.Dense(4, name="a")(inputs)
        out = keras.layers.Add(name="add")([
            hidden, keras.layers.Dense(4, name="b")(hidden)
        ])
        residual = build_graph(keras.Model(inputs, out), 8)
        self.assertIsNone(reference.chain_order(residual))
        with self.assertRaisesRegex(ValueError, "not one \\(3 ops\\)"):
            reference.ChainCosts(Simulator(residual, load_machine("v100x4")))
        sim = Simulator(residual, load_machine("v100x4"))
        self.assertIsNone(reference.chain_reference(residual, sim))

    def test_dynamic_program_is_exact(self):
        """The program's optimum is the minimum of the additive cost over
        every combination of the candidate configs (enumerated here)."""
        graph = _wide_mlp()
        machine = load_machine("v100x4")
        for hidden in (False, True):
            costs = reference.ChainCosts(Simulator(graph, machine),
                                         hidden_syncs=hidden)
            found = reference.chain_optimum(costs)
            self.assertAlmostEqual(costs.total_ms(found.strategy),
                                   found.cost_ms, places=9)
            spaces = [reference.aligned_configs(op, 4) for op in graph]
            best = min(
                costs.total_ms(Strategy(
                    {op.name: c for op, c in zip(graph, picked)}
                ))
                for picked in itertools.product(*spaces)
            )
            self.assertAlmostEqual(found.cost_ms, best, places=9)
            self.assertEqual(found.candidates, sum(map(len, spaces)))

    def test_aligned_configs_start_at_multiples_of_their_size(self):
        op = _wide_mlp().ops[0]
        configs = reference.aligned_configs(op, 4)
        self.assertTrue(configs)
        for config in configs:
            ids = config.device_ids
            self.assertEqual(ids[0] % len(ids), 0)
            self.assertEqual(ids, tuple(range(ids[0], ids[0] + len(ids))))
        self.assertLess(len(configs),
                        len(list(valid_configs(op, 4, "contiguous"))))


class ExhaustiveTest(unittest.TestCase):
    def test_matches_full_simulation_of_every_strategy(self):
        """Delta simulation in odometer order finds what simulating each
        strategy from scratch finds, over every placement."""
        graph = mlp_graph(batch=16, units=(1024, 1024, 16), features=1024)
        machine = load_machine("v100x4")
        def every(op, n):
            return list(valid_configs(op, n))

        found = reference.exhaustive_optimum(
            graph, Simulator(graph, machine), 2, configs=every
        )
        self.assertEqual(found.evaluated,
                         math.prod(len(every(op, 2)) for op in graph))
        expected = brute_force(graph, Simulator(graph, machine), 2)
        self.assertAlmostEqual(found.cost_ms, expected, places=9)
        self.assertAlmostEqual(
            Simulator(graph, machine).simulate(found.strategy).step_ms,
            found.cost_ms, places=9,
        )

    def test_refuses_too_many_strategies(self):
        graph = _wide_mlp()
        sim = Simulator(graph, load_machine("v100x4"))
        with self.assertRaisesRegex(ValueError, "limit=10\\b.*raise"):
            reference.exhaustive_optimum(graph, sim, 4, limit=10)


class SearchAgainstReferenceTest(unittest.TestCase):
    """At the defaults, MCMC ends within 2% of both references."""

    def test_search_within_two_percent(self):
        graph = _wide_mlp()
        machine = load_machine("v100x4")
        exhaustive = reference.exhaustive_optimum(
            graph, Simulator(graph, machine), 4
        )
        _, chain_ms = reference.chain_reference(
            graph, Simulator(graph, machine)
        )
        self.assertGreaterEqual(chain_ms, exhaustive.cost_ms - 1e-9)
        result = search_lib.search(graph, Simulator(graph, machine), 4,
                                   1000, seed=0, verbose=0)
        self.assertLess(exhaustive.cost_ms, result.data_parallel_ms)
        self.assertLessEqual(result.best_ms, 1.02 * exhaustive.cost_ms)


if __name__ == "__main__":
    unittest.main()
