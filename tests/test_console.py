"""A quiet console (issue 23): no TensorFlow C++ INFO lines at default
verbosity (DTensor printed two `dtensor_device.cc` lines per SPMD
expansion), and a user's own `TF_CPP_MIN_LOG_LEVEL` wins. With those
lines on, they count DTensor's SPMD expansions: one per function over a
5-epoch fit with validation.

Each case runs a script in a process of its own: TensorFlow reads its
log level once, when it loads (a script that loads it before the package
has its threshold lowered in place: `native_log_level`)."""

import collections
import os
import re
import subprocess
import sys
import tempfile
import unittest

from flexflow_keras import settings

SCRIPT = """
import numpy as np
import flexflow_keras as keras

inputs = keras.Input((8,))
h = keras.layers.Dense(16, activation="relu")(inputs)
model = keras.Model(inputs, keras.layers.Dense(2)(h))
model.compile(optimizer="adam", loss="mse", search_budget=20)
x = np.random.default_rng(0).random((64, 8), dtype=np.float32)
y = np.random.default_rng(1).random((64, 2), dtype=np.float32)
model.fit(x, y, batch_size=16, epochs=5, validation_split=0.25, verbose=0)
print("devices used:", len({d for c in model.strategy.values()
                            for d in c.device_ids}))
"""

# The same fit under a strategy over two device meshes (ops alternate
# between devices (0, 1) and (2, 3)): the layer-by-layer executor, whose
# backward functions took the learning rate and step as a small input.
SEVERAL_MESHES = SCRIPT.replace(
    'model.compile(optimizer="adam", loss="mse", search_budget=20)', """
import os, sys, tempfile
sys.path[:0] = [{tests!r}, {bench!r}]
from runtime_support import several_meshes
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.strategy_files import save_strategy

path = os.path.join(tempfile.mkdtemp(), "strategy.txt")
save_strategy(several_meshes(build_graph(model, 16)), path)
model.compile(optimizer="adam", loss="mse", import_strategy=path)
""".format(
    tests=os.path.dirname(os.path.abspath(__file__)),
    bench=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "bench"),
)) + 'print("executor:", type(model.strategy_executor).__module__)\n'


# One label per sample: a batch of 16 labels is small enough for DTensor
# to take it for a constant, and the train step was expanded again at
# the second batch (`model_step._on_mesh` pads such inputs).
SMALL_LABELS = SCRIPT.replace(
    "keras.layers.Dense(2)(h)", "keras.layers.Dense(1)(h)"
).replace("random((64, 2), dtype=np.float32)",
          "random((64,), dtype=np.float32)")

# Raw strings in, a `TextVectorization` in the model (run on the host):
# the batch's 16 strings went in as they were, a small constant to
# DTensor, and every function was expanded again at its second call;
# with a Bidirectional LSTM the test step's second expansion then failed
# on its loops' names and fit crashed (TensorFlow's "text classification
# with an RNN" tutorial).
STRINGS = """
import numpy as np
import tensorflow as tf
import flexflow_keras as keras

words = np.array(["good", "bad", "plot", "actor", "fun", "the", "was"])
rng = np.random.default_rng(0)
texts = [" ".join(rng.choice(words, rng.integers(2, 9))) for _ in range(64)]
labels = np.array([("good" in t) * 1.0 for t in texts], np.float32)
encoder = keras.layers.TextVectorization(max_tokens=12,
                                         output_sequence_length=8)
encoder.adapt(texts)
model = keras.Sequential([
    keras.Input((), dtype="string"), encoder,
    keras.layers.Embedding(12, 8),
    keras.layers.GlobalAveragePooling1D(),
    keras.layers.Dense(1),
])
model.compile(optimizer="adam", loss="mse", search_budget=20)
data = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(16)
model.fit(data, epochs=5, validation_data=data.take(2), verbose=0)
print("devices used:", len({d for c in model.strategy.values()
                            for d in c.device_ids}))
"""


# Three models, each fitted on a `tf.data.Dataset` with fit's default
# `shuffle=True`: Keras warns that it ignores it once per place in its
# code, so plain Keras shows it once (Deep Learning with Python's
# weather chapter, six models). Each plan, the graph's trace and the
# cost measurement, used to enter `warnings.catch_warnings()`, which
# empties every module's record of the warnings shown: ours showed it
# at every fit. A fresh cache folder makes every plan measure its ops.
SEVERAL_FITS = """
import numpy as np
import tensorflow as tf
import flexflow_keras as keras

rng = np.random.default_rng(0)
x = rng.random((64, 8), dtype=np.float32)
y = rng.random((64, 1), dtype=np.float32)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
for width in (16, 24, 32):
    inputs = keras.Input((8,))
    h = keras.layers.Dense(width, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="adam", loss="mse", search_budget=20)
    model.fit(data, epochs=1, verbose=0)
    print("devices used:", len({d for c in model.strategy.values()
                                for d in c.device_ids}))
"""


def _run(script=SCRIPT, **env):
    environ = {k: v for k, v in os.environ.items()
               if k != "TF_CPP_MIN_LOG_LEVEL"}
    environ.update(env, FLEXFLOW_KERAS_CPU_DEVICES="4")
    return subprocess.run([sys.executable, "-c", script], env=environ,
                          capture_output=True, text=True, timeout=600)


class ConsoleTest(unittest.TestCase):
    def test_no_dtensor_info_lines_by_default(self):
        done = _run()
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        self.assertRegex(done.stdout, r"devices used: [234]")  # on DTensor
        output = done.stdout + done.stderr
        self.assertNotIn("dtensor_device.cc", output)

    def test_no_dtensor_info_lines_when_tensorflow_loaded_first(self):
        # Most published scripts import TensorFlow (or Keras, which loads
        # it) before the package: TensorFlow had read its log level at
        # INFO, and every expansion printed its two lines.
        for first in ("import tensorflow as tf", "import keras"):
            with self.subTest(first=first):
                done = _run(first + "\n" + SCRIPT)
                self.assertEqual(done.returncode, 0, done.stderr[-3000:])
                self.assertRegex(done.stdout, r"devices used: [234]")
                self.assertNotIn("dtensor_device.cc",
                                 done.stdout + done.stderr)
        # The user's own level still wins there: the check can fail.
        done = _run("import tensorflow as tf\n" + SCRIPT,
                    TF_CPP_MIN_LOG_LEVEL="0")
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        self.assertIn("dtensor_device.cc", done.stderr)

    def test_users_log_level_wins(self):
        done = _run(TF_CPP_MIN_LOG_LEVEL="0")
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        # DTensor's expansions are logged again: the check above can fail.
        self.assertIn("dtensor_device.cc", done.stderr)

    def test_one_spmd_expansion_per_function(self):
        # DTensor re-expanded a function once when a small input's value
        # changed (the optimizer's iteration count copied in at the
        # second epoch: `variables.padded`; a batch's 16 labels at the
        # second batch, or its 16 raw strings: `model_step._on_mesh`;
        # the several-mesh backward's learning rate and step at the
        # second step: `step.Executor._hyper`).
        for name, script in (("one mesh", SCRIPT),
                             ("small labels", SMALL_LABELS),
                             ("strings", STRINGS),
                             ("several meshes", SEVERAL_MESHES)):
            with self.subTest(strategy=name):
                done = _run(script, TF_CPP_MIN_LOG_LEVEL="0")
                self.assertEqual(done.returncode, 0, done.stderr[-3000:])
                if script is SEVERAL_MESHES:
                    self.assertIn("executor: flexflow_keras.runtime.step",
                                  done.stdout)
                else:
                    self.assertRegex(done.stdout, r"devices used: [234]")
                expanded = collections.Counter(re.findall(
                    r"cache key lookup missed for (\S+)\. DTensor is "
                    r"\(re-\)computing its SPMD", done.stderr))
                self.assertTrue(expanded, done.stderr[-3000:])
                self.assertEqual(
                    {n: c for n, c in expanded.items() if c > 1}, {},
                    dict(expanded),
                )

    def test_keras_warnings_once_as_in_plain_keras(self):
        with tempfile.TemporaryDirectory() as home:
            done = _run(SEVERAL_FITS, HOME=home)
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        self.assertEqual(len(re.findall(r"devices used: [234]",
                                        done.stdout)), 3, done.stdout)
        self.assertEqual(
            done.stderr.count("`shuffle=True` was passed, but will be "
                              "ignored"), 1, done.stderr[-3000:])

    def test_setting_keeps_the_users_value(self):
        env = {}
        settings.quiet_native_logs(env, loaded=False)
        self.assertEqual(env, {"TF_CPP_MIN_LOG_LEVEL": "1"})
        env = {"TF_CPP_MIN_LOG_LEVEL": "3"}
        settings.quiet_native_logs(env, loaded=False)
        self.assertEqual(env, {"TF_CPP_MIN_LOG_LEVEL": "3"})
