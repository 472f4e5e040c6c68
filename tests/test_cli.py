"""`python -m flexflow_keras`: search, show and simulate a saved model."""

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest

import keras

from flexflow_keras import strategy_files
from flexflow_keras.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(list(argv), out=out)
    return code, out.getvalue(), err.getvalue()


class CliTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        inputs = keras.Input(shape=(32,), name="x")
        x = keras.layers.Dense(64, activation="relu", name="fc1")(inputs)
        x = keras.layers.Dense(64, activation="relu", name="fc2")(x)
        outputs = keras.layers.Dense(4, name="fc3")(x)
        cls.model_path = cls.path("mlp.keras")
        keras.Model(inputs, outputs).save(cls.model_path)

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    @classmethod
    def path(cls, name: str) -> str:
        return os.path.join(cls.dir.name, name)

    def search(self, export: str) -> str:
        code, out, err = run(
            "search", self.model_path, "--machine", "v100x4",
            "--batch-size", "16", "--budget", "200", "--seed", "0",
            "--export", export,
        )
        self.assertEqual(code, 0, err)
        return out

    def test_search_prints_progress_block_table_and_exports(self):
        out = self.search(self.path("s.pb"))
        self.assertRegex(out, r"iter\(100\) cur\([\d.]+\) next\([\d.]+\) "
                         r"best\([\d.]+\)")
        self.assertIn("=========== Best Discovered Strategy ==========", out)
        self.assertRegex(out, r"speed-up over data parallelism: [\d.]+x")
        self.assertRegex(out, r"fc1 \(Dense\)\s+\(16, 64\)")
        self.assertRegex(out, r"fc1 \(Dense\).* \d+\.\d{3}\n")  # its time
        configs = strategy_files.read_configs(self.path("s.pb"))
        self.assertEqual(sorted(configs), ["fc1", "fc2", "fc3"])

    def test_same_seed_same_file(self):
        self.search(self.path("a.txt"))
        self.search(self.path("b.txt"))
        with open(self.path("a.txt")) as a, open(self.path("b.txt")) as b:
            self.assertEqual(a.read(), b.read())

    def test_show_prints_text_form(self):
        self.search(self.path("show.pb"))
        code, out, _ = run("show", self.path("show.pb"))
        self.assertEqual(code, 0)
        self.assertEqual(out.splitlines()[0],
                         "# flexflow_keras strategy: 3 ops")
        self.assertRegex(out, r"\[fc2\] num_dims\(2\) dims\[\d+,\d+\] "
                         r"device_ids\[[\d,]+\]")

    def test_show_with_model_validates_and_tabulates(self):
        self.search(self.path("v.pb"))
        code, out, err = run("show", self.path("v.pb"), "--model",
                             self.model_path, "--batch-size", "16",
                             "--machine", "v100x4")
        self.assertEqual(code, 0, err)
        self.assertIn("Op (type)", out)

    def test_simulate_imported_strategy_with_trace(self):
        self.search(self.path("sim.pb"))
        trace = self.path("trace.json")
        code, out, err = run(
            "simulate", self.model_path, "--machine", "v100x4",
            "--batch-size", "16", "--import", self.path("sim.pb"),
            "--trace", trace,
        )
        self.assertEqual(code, 0, err)
        self.assertRegex(out, r"Simulated step time: [\d.]+ ms \(data "
                         r"parallelism: [\d.]+ ms, speed-up [\d.]+x\)")
        self.assertIn("Fits in memory: yes", out)
        self.assertIn("Time (ms)", out)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
        self.assertTrue(any(e.get("ph") == "X" for e in events))

    def test_simulate_defaults_to_data_parallelism(self):
        code, out, _ = run("simulate", self.model_path, "--machine",
                           "v100x4", "--batch-size", "16")
        self.assertEqual(code, 0)
        self.assertIn("speed-up 1.00x", out)

    def test_simulate_plans_a_batch_the_devices_do_not_divide(self):
        # Issue 21: batch 6 on 4 devices splits 3 ways, never an error.
        code, out, err = run("simulate", self.model_path, "--machine",
                             "v100x4", "--batch-size", "6")
        self.assertEqual(code, 0, err)
        self.assertIn("speed-up 1.00x", out)

    def test_errors_are_one_line_and_status_2(self):
        bad = self.path("bad.pb")
        with open(bad, "wb") as f:
            f.write(b"\xff\xff\xff")
        code, _, err = run("simulate", self.model_path, "--machine",
                           "v100x4", "--batch-size", "16", "--import", bad)
        self.assertEqual(code, 2)
        self.assertRegex(err, r"^Error: Strategy file .*bad.pb")
        code, _, err = run("search", self.path("none.keras"),
                           "--batch-size", "16", "--machine", "v100x4")
        self.assertEqual(code, 2)
        self.assertIn("Cannot load the model", err)

    def test_python_dash_m_reads_package_flags(self):
        # --machine/--budget/--seed/--export are taken out of sys.argv at
        # import; the command must still see them.
        out_file = self.path("m.txt")
        proc = subprocess.run(
            [sys.executable, "-m", "flexflow_keras", "search",
             self.model_path, "--machine", "v100x4", "--batch-size", "16",
             "--budget", "20", "--seed", "1", "--export", out_file,
             "--quiet"],
            capture_output=True, text=True, cwd=ROOT, timeout=300,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        self.assertIn("after 20 iterations", proc.stdout)
        self.assertTrue(os.path.exists(out_file))
