"""`python -m flexflow_keras compare SCRIPT [ARGS...]` (issue 23): a
script run as written on plain Keras and with its imports switched, side
by side. Unmarked: the import rewriting, a script with its own argparse
flags, and `examples/mlp.py`; `-m slow`: every script in `examples/`
(small sizes)."""

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import unittest

import pytest

from flexflow_keras.compare_child import rewrite_imports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    """A user's script with flags of its own."""
    import argparse

    import numpy as np
    import keras
    from keras import layers

    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--units", type=int, default=16)
    args = parser.parse_args()
    print("script epochs", args.epochs)
    rng = np.random.default_rng(0)
    x = rng.random((128, 8), dtype=np.float32)
    y = (x.sum(axis=1) > 4).astype("int32")
    model = keras.Sequential([
        keras.Input((8,)),
        layers.Dense(args.units, activation="relu"),
        layers.Dense(2, activation="softmax"),
    ])
    model.compile(optimizer="adam",
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=args.epochs, verbose=0)
''')


def compare(*args, timeout=900):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, "-m", "flexflow_keras", "compare", *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout,
    )


def epoch_rows(text):
    """{epoch: [values...]} of the first fit's table."""
    rows = {}
    for line in text.split("=== compare:", 1)[1].splitlines():
        found = re.match(r"^  (\d+)\s+([-\d.\s]+)$", line)
        if found:
            rows.setdefault(int(found.group(1)), [
                float(v) for v in found.group(2).split()
            ])
    return rows


class RewriteImportsTest(unittest.TestCase):
    def test_keras_imports_become_ours(self):
        source = ("import keras\nimport keras as K\n"
                  "from keras import layers\n"
                  "from keras.layers import Dense\n"
                  "from tensorflow import keras\n"
                  "from tensorflow.keras.optimizers import Adam\n"
                  "import tensorflow as tf\nx = keras.layers\n")
        got, changed = rewrite_imports(source)
        self.assertEqual(got, (
            "import flexflow_keras as keras\n"
            "import flexflow_keras as K\n"
            "from flexflow_keras import layers\n"
            "from flexflow_keras.layers import Dense\n"
            "import flexflow_keras as keras\n"
            "from flexflow_keras.optimizers import Adam\n"
            "import tensorflow as tf\nx = keras.layers\n"))
        self.assertEqual(changed, 6)

    def test_our_imports_become_keras(self):
        source = ("import flexflow_keras as keras  # was: import keras\n"
                  "from flexflow_keras import layers, ops\n")
        got, changed = rewrite_imports(source, "keras")
        self.assertEqual(got, "import keras  # was: import keras\n"
                              "from keras import layers, ops\n")
        self.assertEqual(changed, 2)

    def test_bad_target(self):
        with self.assertRaisesRegex(ValueError, "Received: 'jax'"):
            rewrite_imports("", "jax")


class CompareTest(unittest.TestCase):
    def test_script_with_its_own_flags(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "train.py")
            with open(path, "w") as f:
                f.write(SCRIPT)
            # --search-budget is ours: it must not reach the plain run,
            # whose argparse would refuse it.
            done = compare(path, "--epochs", "2", "--units", "8",
                           "--search-budget", "20")
        self.assertEqual(done.returncode, 0, done.stdout[-3000:]
                         + done.stderr[-3000:])
        self.assertEqual(done.stdout.count("script epochs 2"), 2)
        rows = epoch_rows(done.stdout)
        self.assertEqual(sorted(rows), [1, 2])
        for values in rows.values():  # K, FF pairs: same losses
            for plain, ours in zip(values[::2], values[1::2]):
                self.assertAlmostEqual(plain, ours, delta=1e-3)
        self.assertRegex(done.stdout, r"strategy \(search\) over [2-4] "
                         r"device")
        self.assertIn("time to first step", done.stdout)
        # each side's first epoch timed: "first epoch  1.2 s  3.4 s"
        self.assertRegex(done.stdout,
                         r"first epoch\s+\d+\.\d s\s+\d+\.\d s")

    def test_missing_script_is_refused(self):
        done = compare("no_such_script.py")
        self.assertEqual(done.returncode, 2)
        self.assertIn("no_such_script.py", done.stderr)
        self.assertIn("not a file", done.stderr)

    # Slow: test_script_with_its_own_flags runs compare by default
    @pytest.mark.slow
    def test_mlp_example(self):
        done = compare("examples/mlp.py", "--epochs", "2", "--budget", "50")
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        self.assertEqual(sorted(epoch_rows(done.stdout)), [1, 2])
        self.assertIn("simulated step", done.stdout)


EXAMPLE_FLAGS = {
    "mlp": ("--epochs", "1"),
    "custom_train_step": ("--epochs", "1"),
    "distillation": ("--epochs", "1"),
    "bidirectional_lstm": ("--epochs", "1"),
    "cnn": ("--epochs", "1"),
    "transformer": ("--epochs", "1"),
}


@pytest.mark.slow
class CompareExamplesTest(unittest.TestCase):
    def test_every_example(self):
        names = sorted(f[:-3] for f in os.listdir(
            os.path.join(ROOT, "examples")) if f.endswith(".py"))
        for name in names:
            flags = EXAMPLE_FLAGS.get(name, ("--small", "--epochs", "1"))
            with self.subTest(example=name):
                done = compare(f"examples/{name}.py", *flags, "--budget",
                               "50", timeout=1800)
                self.assertEqual(done.returncode, 0,
                                 done.stdout[-2000:] + done.stderr[-2000:])
                self.assertIn("=== compare:", done.stdout)
                self.assertTrue(epoch_rows(done.stdout), done.stdout[-2000:])
