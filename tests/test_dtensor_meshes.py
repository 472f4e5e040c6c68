"""What DTensor trains over several meshes in one function (issue 22).

The model's own step runs on one mesh because a function over several
meshes hung in training (docs/ARCHITECTURE.md). The hangs of split
cases were DTensor's all-reduce combining merging a forward collective
with a backward one through the other mesh; without the pass, meshes
of the same number of devices (disjoint, overlapping, or views of the
same devices) train, split and updated, equal to plain TensorFlow.
Operator placement inside a user's step would rest on that fact, so it
is checked here on the installed TensorFlow: each case of
`bench/dtensor_mesh_probe.py` runs in a fresh process (DTensor reads
the switch when it makes its device), with a timeout, since the failure
it guards against is a hang.
"""

import os
import unittest
from unittest import mock

import dtensor_mesh_probe  # bench/, on the path by conftest

# A case takes about 4 s; a hung one would wait for ever.
TIMEOUT_S = 120


def probe(case: str) -> str:
    """The probe's result for `case` ("ok", "WRONG: ...", "HANG ..."),
    run in its own process with combining off."""
    with mock.patch.dict(os.environ,
                         {dtensor_mesh_probe.COMBINE_SWITCH: "0"}):
        result, _ = dtensor_mesh_probe.run_in_subprocess(case, TIMEOUT_S, 0)
    return result


class SeveralMeshesTest(unittest.TestCase):
    def test_disjoint_meshes_train_split_and_updated(self):
        """x @ w1 on CPU:0,1, @ w2 on CPU:2,3, the loss back on 0,1,
        the batch split on both, SGD on both weights at a rate read from
        one step counter on the first mesh, copied to the second (as an
        optimizer's `iterations`)."""
        self.assertEqual(probe("dis-train-ABA-ABshard-sgd-counter"), "ok")

    def test_overlapping_meshes_of_one_size_train_split_and_updated(self):
        """CPU:0,1 and CPU:1,2: the device they share runs a part of
        both meshes' functions."""
        self.assertEqual(probe("ov-train-ABA-ABshard-sgd-counter"), "ok")

    def test_views_of_the_same_devices_train_split_and_updated(self):
        """A 1-D mesh and a 2 x 2 mesh over the same 4 devices: with the
        pass on, this case hung."""
        self.assertEqual(probe("view-train-ABA-ABshard-sgd"), "ok")


if __name__ == "__main__":
    unittest.main()
