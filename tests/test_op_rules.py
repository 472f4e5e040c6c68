"""Replacements for TensorFlow ops DTensor has no rule for: same values.

Run here without DTensor, against the op each replaces (the DTensor runs
are in `test_layer_support.py`).
"""

import unittest

import numpy as np
import tensorflow as tf

import flexflow_keras  # noqa: F401  (devices first)
from flexflow_keras.runtime import op_rules


class OpRulesTest(unittest.TestCase):
    def test_flip_by_gather_is_flip_bit_for_bit(self):
        x = tf.reshape(tf.range(24.0), (2, 3, 4))
        for axis in (None, 1, -1, (0, 2)):
            expected = tf.reverse(
                x, list(range(3)) if axis is None else
                [axis] if isinstance(axis, int) else list(axis)
            )
            np.testing.assert_array_equal(
                op_rules.flip_by_gather(x, axis), expected
            )

    def test_dilated_kernel_convolution_equals_dilated_convolution(self):
        rng = np.random.default_rng(0)
        x = rng.random((2, 9, 9, 3), dtype=np.float32)
        kernel = rng.random((3, 3, 3, 4), dtype=np.float32)
        for rates, padding in (((2, 2), "SAME"), ((3, 1), "VALID")):
            expected = tf.nn.convolution(x, kernel, padding=padding,
                                         dilations=rates)
            got = tf.nn.convolution(
                x, op_rules.dilate_kernel(kernel, rates), padding=padding
            )
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

    def test_dilated_kernel_has_zeros_between_taps(self):
        kernel = tf.reshape(tf.range(1.0, 4.0), (3, 1, 1))
        dilated = op_rules.dilate_kernel(kernel, (3,))
        np.testing.assert_array_equal(
            tf.reshape(dilated, [-1]), [1, 0, 0, 2, 0, 0, 3]
        )

    def test_replicated_switch_is_set_unless_the_user_set_it(self):
        import os

        key = "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.AVGPOOLGRAD"
        op_rules.enable()
        self.assertEqual(os.environ.get(key), "1")
        saved = os.environ[key]
        try:
            os.environ[key] = "0"
            op_rules.enable()
            self.assertEqual(os.environ[key], "0")
        finally:
            os.environ[key] = saved


if __name__ == "__main__":
    unittest.main()
