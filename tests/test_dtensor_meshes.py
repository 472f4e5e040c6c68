"""What DTensor trains over several meshes in one function (issue 22).

The model's own step runs on one mesh because a function over several
meshes hung in training (docs/ARCHITECTURE.md). The hangs of split
cases were DTensor's all-reduce combining merging a forward collective
with a backward one through the other mesh; without the pass, meshes
of the same number of devices (disjoint, overlapping, or views of the
same devices) train, split and updated, equal to plain TensorFlow. Operator placement inside a user's
step would rest on that fact, so it is checked here on the installed
TensorFlow: each case of `bench/dtensor_mesh_probe.py` runs in a fresh
process (DTensor reads the switch when it makes its device), with a
timeout, since the failure it guards against is a hang.
"""

import os
import subprocess
import sys
import unittest

PROBE = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "bench", "dtensor_mesh_probe.py")
# A case takes about 4 s; a hung one would wait for ever.
TIMEOUT_S = 120


def probe(case: str) -> str:
    """The probe's result line for `case`, run with combining off."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION="0")
    try:
        done = subprocess.run([sys.executable, PROBE, "--case", case],
                              capture_output=True, text=True, env=env,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"HANG (no result in {TIMEOUT_S} s)"
    results = [line for line in done.stdout.splitlines()
               if line.startswith("RESULT ")]
    return results[-1] if results else done.stderr[-2000:]


class SeveralMeshesTest(unittest.TestCase):
    def test_disjoint_meshes_train_split_and_updated(self):
        """x @ w1 on CPU:0,1, @ w2 on CPU:2,3, the loss back on 0,1,
        the batch split on both, SGD on both weights at a rate read from
        one step counter on the first mesh, copied to the second (as an
        optimizer's `iterations`)."""
        self.assertEqual(probe("dis-train-ABA-ABshard-sgd-counter"),
                         "RESULT ok")

    def test_overlapping_meshes_of_one_size_train_split_and_updated(self):
        """CPU:0,1 and CPU:1,2: the device they share runs a part of
        both meshes' functions."""
        self.assertEqual(probe("ov-train-ABA-ABshard-sgd-counter"),
                         "RESULT ok")

    def test_views_of_the_same_devices_train_split_and_updated(self):
        """A 1-D mesh and a 2 x 2 mesh over the same 4 devices: with the
        pass on, this case hung."""
        self.assertEqual(probe("view-train-ABA-ABshard-sgd"), "RESULT ok")


if __name__ == "__main__":
    unittest.main()
