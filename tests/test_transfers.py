"""Keras values <-> DVariables through the devices' own variables.

`Transfers` reads and writes each DVariable's per-device variables
(`read_components`, `write_components`) instead of tracing a DTensor
function over all of them; the blocks each device holds must be the ones
DTensor's own layouts put there, on 1-D and 2-D meshes, for every way a
tensor's dims may be split, and DTensor's asynchronous ops must be seen
in order from both sides.
"""

import unittest

import keras
import numpy as np
from tensorflow.experimental import dtensor

from flexflow_keras import devices
from flexflow_keras.runtime import deferred
from flexflow_keras.runtime.variables import (
    Transfers, gather, read_components, to_layout, write_components,
)

UNSHARDED = dtensor.UNSHARDED


def _meshes():
    names = devices.device_names()[:4]
    return [
        dtensor.create_mesh([("x", 4)], devices=list(names)),
        dtensor.create_mesh([("a", 2), ("b", 2)], devices=list(names)),
    ]


def _layouts(mesh):
    axes = list(mesh.dim_names)
    specs = [[UNSHARDED, UNSHARDED]]
    for axis in axes:
        specs += [[axis, UNSHARDED], [UNSHARDED, axis]]
    if len(axes) == 2:
        specs += [[axes[0], axes[1]], [axes[1], axes[0]]]
    return [dtensor.Layout(spec, mesh) for spec in specs]


class ComponentsTest(unittest.TestCase):
    def test_blocks_are_dtensors_own(self):
        rng = np.random.default_rng(0)
        for mesh in _meshes():
            for layout in _layouts(mesh):
                with self.subTest(layout=layout.sharding_specs,
                                  mesh=mesh.dim_names):
                    x = rng.normal(size=(8, 8)).astype("float32")
                    var = deferred.StepVariable(to_layout(0 * x, layout))
                    for round_ in range(3):  # DTensor and plain ops in turn
                        write_components([(var, layout, x + round_)])
                        np.testing.assert_array_equal(
                            gather(var.read_value()).numpy(), x + round_)
                        var.assign(to_layout(2 * x + round_, layout))
                        np.testing.assert_array_equal(
                            read_components([(var, layout)])[0],
                            2 * x + round_)

    def test_transfers_copy_keras_values_both_ways(self):
        mesh = _meshes()[1]
        rng = np.random.default_rng(1)
        pairs = []
        for layout, dtype in zip(_layouts(mesh), ["float32", "int64"] * 4):
            value = rng.integers(0, 100, size=(4, 6)).astype(dtype)
            pairs.append((keras.Variable(value),
                          deferred.StepVariable(to_layout(0 * value, layout)),
                          layout))
        transfers = Transfers(mesh)
        transfers.copy_in(pairs)
        for var, dvar, _ in pairs:
            np.testing.assert_array_equal(gather(dvar.read_value()).numpy(),
                                          var.numpy())
        for _, dvar, layout in pairs:  # a "step" changes the DVariables
            dvar.assign(to_layout(gather(dvar.read_value()).numpy() * 3, layout))
        expected = [3 * var.numpy() for var, _, _ in pairs]
        transfers.copy_out(pairs)
        for (var, _, _), want in zip(pairs, expected):
            self.assertEqual(var.dtype, str(want.dtype))
            np.testing.assert_array_equal(var.numpy(), want)


if __name__ == "__main__":
    unittest.main()
