"""FlexFlow's benchmark models as example scripts (issue 12).

Each `examples/<model>.py --small` runs end to end in a subprocess on 4
virtual CPU devices: search, export the strategy, then a second run
imports it (no search) and trains one epoch under it. The exported
strategy must load against the example's model and use several devices,
and neither run may hand the model to plain Keras.
"""

import os
import subprocess
import sys
import tempfile
import unittest

import model_zoo
from case_tests import add_case_tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEARCH_LINE = "MCMC Search Finished"

# Unmarked: a convolutional and an attention model (about 20 s each).
# Slow: hundreds of layers to trace, recurrent models (their unrolled
# steps take longest to trace; `tests/test_rolled_rnn.py` and
# `tests/test_unroll.py` train recurrent layers by default), and DLRM
# (`tests/test_runtime_equivalence.py` trains a split embedding table and
# `tests/test_search_suite.py` searches DLRM by default).
QUICK = ("alexnet", "transformer_encoder")
SLOW = ("dlrm", "rnntc", "rnnlm", "nmt", "inception_v3", "resnet101")


def run_example(name: str, *flags: str) -> str:
    """stdout + stderr of `examples/<name>.py --small --epochs 1 ...`."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               FLEXFLOW_KERAS_CPU_DEVICES="4")
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", f"{name}.py"),
         "--small", "--epochs", "1", *flags],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "as plain Keras" not in output, output[-3000:]
    return output


def exported_strategy(name: str, path: str):
    """The strategy in `path`, loaded against the example's small model."""
    from flexflow_keras.keras_graph import build_graph
    from flexflow_keras.strategy_files import load_strategy

    module = model_zoo.load_example(name)
    graph = build_graph(module.build_model(small=True),
                        module.SMALL["batch"])
    return load_strategy(path, graph, 4)


class FlexFlowSuiteTest(unittest.TestCase):
    def check(self, name: str) -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, f"{name}.pb")
            searched = run_example(name, "--budget", "200", "--export", path)
            self.assertIn(SEARCH_LINE, searched)
            self.assertTrue(os.path.exists(path))
            strategy = exported_strategy(name, path)
            used = {d for c in strategy.values() for d in c.device_ids}
            self.assertGreater(len(used), 1, strategy)
            imported = run_example(name, "--import", path)
            self.assertNotIn(SEARCH_LINE, imported)


add_case_tests(FlexFlowSuiteTest, QUICK, SLOW)
