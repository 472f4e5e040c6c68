"""The examples are Keras scripts: with our import or Keras's, same accuracy.

Each example runs twice in a subprocess: as written (flexflow_keras,
search, DTensor on 4 virtual CPUs) and with its import lines switched
back to plain `keras`. Both runs are seeded alike (a line the test puts
before the script's code: the scripts, like published examples, seed
nothing), so both start from the same weights; random ops (dropout) draw
differently under DTensor, so accuracies are compared with a tolerance.
"""

import os
import re
import subprocess
import sys
import tempfile
import unittest

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCURACY = re.compile(r"test accuracy ([0-9.]+)")


def run_example(name: str, plain_keras: bool, *flags: str) -> float:
    """Test accuracy printed by `examples/<name>.py`."""
    with open(os.path.join(ROOT, "examples", f"{name}.py")) as f:
        source = f.read()
    if plain_keras:
        source = source.replace(
            "import flexflow_keras as keras", "import keras"
        ).replace("from flexflow_keras import ", "from keras import ")
        assert "flexflow_keras" not in source.split('"""', 2)[2]
    module = "keras" if plain_keras else "flexflow_keras"
    source = (
        f"import {module} as _seeded; _seeded.utils.set_random_seed(0)\n"
        + source
    )
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"{name}.py")
        with open(path, "w") as f:
            f.write(source)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        run = subprocess.run(
            [sys.executable, path, *flags], capture_output=True, text=True,
            cwd=ROOT, env=env, timeout=900,
        )
    assert run.returncode == 0, run.stderr[-3000:]
    # Under its strategy from start to end: no hand-over to plain Keras.
    assert "as plain Keras" not in run.stderr, run.stderr[-3000:]
    found = ACCURACY.findall(run.stdout)
    assert found, run.stdout[-2000:]
    return float(found[-1])


class ExampleAccuracyTest(unittest.TestCase):
    def check(self, name: str, *flags: str, tolerance: float = 0.06):
        ours = run_example(name, False, "--budget", "100", *flags)
        plain = run_example(name, True, *flags)
        self.assertGreater(plain, 0.5)  # the task is learnt at all
        self.assertAlmostEqual(ours, plain, delta=tolerance)

    def test_mlp(self):
        self.check("mlp", "--epochs", "3")

    def test_custom_train_step(self):
        self.check("custom_train_step", "--epochs", "3")

    # Slow: a step override trains by default in test_custom_train_step
    @pytest.mark.slow
    def test_distillation(self):
        self.check("distillation", "--epochs", "4")

    # Slow: recurrent layers train by default in test_unroll.py and
    # test_rolled_rnn.py; ~57 s
    @pytest.mark.slow
    def test_bidirectional_lstm(self):
        self.check("bidirectional_lstm", "--epochs", "3")

    @pytest.mark.slow
    def test_cnn(self):
        self.check("cnn", "--epochs", "2")

    @pytest.mark.slow
    def test_transformer(self):
        self.check("transformer", "--epochs", "2")


if __name__ == "__main__":
    unittest.main()
