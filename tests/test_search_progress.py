"""How the search shows its progress (issue 23): a Keras progress bar at
`search_verbose=1` (the default), FlexFlow's lines at 2, nothing at 0;
the bar counts both phases of the one-mesh search."""

import contextlib
import io
import os
import tempfile
import unittest

import keras

import model_zoo
from flexflow_keras import planner, search, settings
from flexflow_keras.mesh_space import MeshSpec
from flexflow_keras.settings import Settings
from flexflow_keras.simulator import Simulator
from flexflow_keras.strategy_files import save_strategy
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.machine import load_machine


def _mlp():
    keras.backend.clear_session()
    return model_zoo.mlp()


def _planned_output(verbose, **options):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan = planner.make_plan(
            _mlp(), 64, Settings(search_budget=300, search_seed=0,
                                 machine="v100x4", search_verbose=verbose,
                                 **options),
        )
    return plan, out.getvalue()


class SearchProgressTest(unittest.TestCase):
    def setUp(self):
        self.graph = build_graph(_mlp(), 64)
        self.sim = Simulator(self.graph, load_machine("v100x4"))
        self.calls = []

    def _record(self, *args):
        self.calls.append(args)

    def test_search_reports_every_100_iterations_and_at_the_end(self):
        result = search.search(self.graph, self.sim, 4, 250, seed=0,
                               verbose=0, progress=self._record)
        self.assertEqual([c[0] for c in self.calls], [100, 200, 250])
        self.assertEqual([c[3] for c in self.calls], [False, False, True])
        iterations, best_ms, dp_ms, _ = self.calls[-1]
        self.assertEqual(iterations, result.iterations)
        self.assertEqual(best_ms, result.best_ms)
        self.assertEqual(dp_ms, result.data_parallel_ms)
        # The best only improves.
        bests = [c[1] for c in self.calls]
        self.assertEqual(bests, sorted(bests, reverse=True))

    def test_mesh_search_counts_both_phases(self):
        meshes = (MeshSpec.first((4,)), MeshSpec.first((2, 2)))
        result = search.search_meshes(self.graph, self.sim, 4, 400, meshes,
                                      seed=0, verbose=0,
                                      progress=self._record)
        counts = [c[0] for c in self.calls]
        self.assertEqual(counts, sorted(counts))
        self.assertEqual(counts[-1], result.iterations)
        self.assertEqual(self.calls[-1][1], result.best_ms)
        self.assertEqual([c[3] for c in self.calls].count(True), 1)
        self.assertTrue(self.calls[-1][3])

    def test_verbose_1_draws_a_progress_bar(self):
        plan, text = _planned_output(1)
        self.assertIn("300/300", text)
        self.assertIn("best_ms", text)
        self.assertNotIn("iter(", text)
        self.assertIn("Best Discovered Strategy", text)
        self.assertEqual(plan.search_result.iterations, 300)

    def test_verbose_2_prints_flexflows_lines(self):
        _, text = _planned_output(2)
        self.assertIn("iter(100) cur(", text)
        self.assertIn("iter(300) cur(", text)
        self.assertNotIn("300/300", text)

    def test_verbose_0_is_silent(self):
        _, text = _planned_output(0)
        self.assertEqual(text, "")

    def test_an_imported_strategy_says_where_it_came_from(self):
        searched, _ = _planned_output(0)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "mlp.txt")
            save_strategy(searched.strategy, path)
            plan, text = _planned_output(1, import_strategy=path)
            _, quiet = _planned_output(0, import_strategy=path)
        self.assertEqual(plan.source, "import")
        self.assertEqual(plan.strategy, searched.strategy)
        self.assertIn(searched.strategy.to_text().rstrip("\n"), text)
        self.assertIn(f"Strategy imported from {path} (no search). "
                      f"Simulated step time: {plan.step_ms:.3f} ms", text)
        self.assertIn("simulated speed-up over data parallelism", text)
        self.assertNotIn("where a batch", text)  # 64 splits 4 ways
        self.assertNotIn("Best Discovered Strategy", text)
        self.assertEqual(quiet, "")

    def test_an_imported_strategy_says_when_the_batch_cannot_split(self):
        # A batch of 2 on 4 devices: data parallelism splits it 2 ways
        # and other dims take the rest, as the search's report says.
        def planned(**options):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                plan = planner.make_plan(_mlp(), 2, Settings(
                    search_budget=0, machine="v100x4", search_verbose=1,
                    **options))
            return plan, out.getvalue()

        baseline, _ = planned()
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "mlp.txt")
            save_strategy(baseline.strategy, path)
            _, text = planned(import_strategy=path)
        self.assertIn(", where a batch of 2 splits 2 ways over 4 devices "
                      "and other dims take the rest); simulated speed-up",
                      text)

    def test_setting(self):
        self.assertEqual(Settings().search_verbose, 1)
        self.assertEqual(settings.resolve(
            {}, {}, {"FLEXFLOW_KERAS_SEARCH_VERBOSE": "2"}).search_verbose, 2)
        self.assertEqual(settings.take_flags(
            ["s.py", "--search-verbose", "0"]), {"search_verbose": 0})
        with self.assertRaisesRegex(ValueError, "search_verbose=3"):
            Settings(search_verbose=3)
