"""DTensor's all-reduce combining is chosen by the first model's size.

DTensor reads its switch once, when it makes its device, so the choice
is tested in fresh processes (`runtime/dtensor_passes.py` says why a
deep model runs without the pass).
"""

import os
import subprocess
import sys
import unittest

from flexflow_keras import settings

_SCRIPT = """
import os
import flexflow_keras
from flexflow_keras.runtime import dtensor_passes

class Graph:  # only its length matters
    def __len__(self):
        return {ops}

print(dtensor_passes.choose_for(Graph()),
      os.environ.get("DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"))
from tensorflow.experimental import dtensor
import tensorflow as tf
mesh = dtensor.create_mesh([("x", 2)], device_type="CPU")
dtensor.copy_to_mesh(tf.ones(()), dtensor.Layout.replicated(mesh, 0))
print(dtensor_passes.choose_for(Graph()))
"""


def _run(ops: int, **env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items()
               if k != settings.COMBINE_ALL_REDUCES}
    environ.update(env, TF_CPP_MIN_LOG_LEVEL="3",
                   FLEXFLOW_KERAS_CPU_DEVICES="2")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(ops=ops)], env=environ,
        capture_output=True, text=True, timeout=300,
    )
    if done.returncode != 0:
        raise AssertionError(done.stderr[-3000:])
    return done.stdout.split()


class CombineAllReducesTest(unittest.TestCase):
    def test_the_users_value_wins(self):
        env = {settings.COMBINE_ALL_REDUCES: "1"}
        self.assertTrue(settings.combine_all_reduces(False, env))
        self.assertEqual(env[settings.COMBINE_ALL_REDUCES], "1")
        env = {}
        self.assertFalse(settings.combine_all_reduces(False, env))
        self.assertEqual(env[settings.COMBINE_ALL_REDUCES], "0")

    def test_chosen_by_the_first_graph_until_dtensor_starts(self):
        from flexflow_keras.runtime.dtensor_passes import DEEP_GRAPH_OPS

        # A deep graph turns it off, a small one keeps DTensor's default;
        # once DTensor's device exists the choice is not made again.
        self.assertEqual(_run(DEEP_GRAPH_OPS), ["False", "0", "None"])
        self.assertEqual(_run(DEEP_GRAPH_OPS - 1), ["True", "1", "None"])
        self.assertEqual(
            _run(DEEP_GRAPH_OPS, **{settings.COMBINE_ALL_REDUCES: "1"}),
            ["True", "1", "None"])


if __name__ == "__main__":
    unittest.main()
