"""Replacements for TensorFlow ops DTensor has no rule for: same values.

Run here without DTensor, against the op each replaces (the DTensor runs
are in `test_layer_support.py`).
"""

import os
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

    def test_roll_by_slices_is_roll_bit_for_bit(self):
        x = tf.reshape(tf.range(120.0), (2, 3, 4, 5))
        rolled = op_rules.roll_by_slices(None, tf.roll)
        cases = [(1, 1), (-1, 2), (7, -1), (0, 3), (4, 2), ([2, -3], [1, 2]),
                 ([1, 1], [2, 2]), ([-5, 2, 9], [3, 1, 0]), (1, 0)]
        for shift, axis in cases:
            np.testing.assert_array_equal(
                rolled(x, shift, axis), tf.roll(x, shift, axis),
                err_msg=f"shift={shift} axis={axis}")
        # An axis whose size is known only at run time: gathers.
        unknown = tf.function(lambda t: rolled(t, [-2, 1], [1, 2]),
                              input_signature=[tf.TensorSpec(
                                  (None, None, None, 5))])
        np.testing.assert_array_equal(unknown(x),
                                      tf.roll(x, [-2, 1], [1, 2]))
        # A shift known only at run time: TensorFlow's op.
        dynamic = tf.function(lambda t, s: rolled(t, s, 1))
        np.testing.assert_array_equal(dynamic(x, tf.constant(2)),
                                      tf.roll(x, 2, 1))

    def test_rolled_windows_keep_the_batch_split(self):
        # keras.io's Swin Transformer shifts its windows with
        # `keras.ops.roll`; DTensor has no rule for `Roll`.
        import keras
        from tensorflow.experimental import dtensor

        mesh = dtensor.create_mesh([("a0", 4)], device_type="CPU")
        x = np.random.default_rng(0).random((8, 6, 6, 3), dtype=np.float32)
        sharded = dtensor.relayout(
            dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, 4)),
            dtensor.Layout.batch_sharded(mesh, "a0", 4))

        def shifted(inputs):
            out = keras.ops.roll(inputs, shift=[-2, -2], axis=[1, 2])
            return keras.ops.roll(out * out, shift=[2, 2], axis=[1, 2])

        def paired(inputs):
            # Each sample mixed with the next (a batch rolled along the
            # batch axis, as a mixup may pair them), then shifted.
            mixed = 0.7 * inputs + 0.3 * keras.ops.roll(inputs, 1, axis=0)
            return keras.ops.roll(mixed * mixed, [-3, 2], [0, 1])

        def whole(t):
            if dtensor.fetch_layout(t).sharding_specs[0] == "a0":
                return np.concatenate([p.numpy() for p in dtensor.unpack(t)])
            return dtensor.unpack(t)[0].numpy()

        for f, split in ((shifted, True), (paired, False)):
            @tf.function
            def step(inputs):
                with op_rules.substitutes(mesh), tf.GradientTape() as tape:
                    tape.watch(inputs)
                    out = f(inputs)
                    total = tf.reduce_sum(out * tf.range(3.0))
                return out, tape.gradient(total, inputs)

            with self.subTest(f.__name__):
                out, grad = step(sharded)
                if split:
                    self.assertEqual(
                        dtensor.fetch_layout(out).sharding_specs[0], "a0")
                self.assertEqual(
                    dtensor.fetch_layout(grad).sharding_specs[0], "a0")
                plain = tf.constant(x)
                with tf.GradientTape() as tape:
                    tape.watch(plain)
                    expected = f(plain)
                    total = tf.reduce_sum(expected * tf.range(3.0))
                np.testing.assert_array_equal(whole(out), expected)
                np.testing.assert_array_equal(whole(grad),
                                              tape.gradient(total, plain))

    def test_dilated_as_phases_equals_keras_dilated_convolution(self):
        # Sizes that are and are not a whole number of phases, kernels
        # of 1 to 3 taps, rates per dim, 1-D to 3-D, all three kinds.
        import itertools

        from keras.src.backend.tensorflow import nn as tf_nn

        rng = np.random.default_rng(0)

        def normal(*shape):
            return tf.constant(rng.normal(size=shape).astype("float32"))

        cases = itertools.product(
            (1, 2, 3), ("same", "valid"), (2, 3), (1, 2, 3), (7, 8),
            ("conv", "depthwise", "separable"),
            ("channels_last", "channels_first"),
        )
        checked = 0
        for spatial, padding, rate, taps, size, kind, data_format in cases:
            if spatial == 3 and (kind != "conv" or size == 8):
                continue
            if data_format == "channels_first" and (
                    kind == "conv" or taps == 1):
                continue  # TensorFlow's CPU Conv2D has no NCHW
            rates = (rate,) * spatial if spatial != 2 else (rate, 5 - rate)
            image = (size,) * spatial
            x = normal(2, *(image + (3,) if data_format == "channels_last"
                            else (3,) + image))
            kernel = ("kernel" if kind != "separable"
                      else "depthwise_kernel")
            arguments = {"inputs": x, "strides": 1, "padding": padding,
                         "data_format": data_format,
                         "dilation_rate": rates}
            if kind == "conv":
                run, arguments["kernel"] = tf_nn.conv, normal(
                    *(taps,) * spatial, 3, 4)
            elif kind == "depthwise":
                run, arguments["kernel"] = tf_nn.depthwise_conv, normal(
                    *(taps,) * spatial, 3, 2)
            else:
                run = tf_nn.separable_conv
                arguments["depthwise_kernel"] = normal(
                    *(taps,) * spatial, 3, 2)
                arguments["pointwise_kernel"] = normal(
                    *(1,) * spatial, 6, 5)
            if (size - (taps - 1) * max(rates) < 1
                    and padding == "valid"):
                continue
            with self.subTest(spatial=spatial, padding=padding, rates=rates,
                              taps=taps, size=size, kind=kind,
                              data_format=data_format):
                expected = run(**arguments)
                got = op_rules.dilated_as_phases(run, dict(arguments),
                                                 rates, kernel)
                self.assertEqual(got.shape, expected.shape)
                np.testing.assert_allclose(got, expected, rtol=1e-4,
                                           atol=1e-4)
                checked += 1
        self.assertGreater(checked, 150)

    def test_dilated_as_phases_on_images_of_any_size(self):
        from keras.src.backend.tensorflow import nn as tf_nn

        rng = np.random.default_rng(1)
        kernel = tf.constant(rng.normal(size=(3, 3, 2, 4)).astype("float32"))

        @tf.function(input_signature=[
            tf.TensorSpec((None, None, None, 2), tf.float32)])
        def phased(x):
            return op_rules.dilated_as_phases(
                tf_nn.conv, {"inputs": x, "kernel": kernel, "strides": 1,
                             "padding": "same",
                             "data_format": "channels_last",
                             "dilation_rate": 2}, (2, 2), "kernel")

        for shape in ((3, 9, 6, 2), (1, 4, 11, 2)):
            x = tf.constant(rng.normal(size=shape).astype("float32"))
            np.testing.assert_allclose(
                phased(x), tf_nn.conv(x, kernel, padding="same",
                                      dilation_rate=2),
                rtol=1e-4, atol=1e-4)

    def test_dilated_convolution_keeps_the_batch_split(self):
        # TensorFlow's SpaceToBatchND has no DTensor rule; the phases
        # are reshapes and transposes that keep dim 0 the batch.
        import keras
        from tensorflow.experimental import dtensor

        mesh = dtensor.create_mesh([("a0", 4)], device_type="CPU")
        layer = keras.layers.Conv2D(4, 3, dilation_rate=3, padding="same")
        layer.build((None, 10, 10, 3))
        kernel = dtensor.copy_to_mesh(layer.kernel.value,
                                      dtensor.Layout.replicated(mesh, 4))
        x = np.random.default_rng(0).random((8, 10, 10, 3), dtype=np.float32)
        batch = dtensor.Layout.batch_sharded(mesh, "a0", 4)
        sharded = dtensor.relayout(
            dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, 4)),
            batch)

        @tf.function
        def step(inputs):
            with op_rules.substitutes(mesh), tf.GradientTape() as tape:
                tape.watch([inputs, kernel])
                out = keras.ops.conv(inputs, kernel, padding="same",
                                     dilation_rate=3)
                total = tf.reduce_sum(out * out)
            return out, tape.gradient(total, [inputs, kernel])

        out, (grad_x, grad_kernel) = step(sharded)
        self.assertEqual(dtensor.fetch_layout(out).sharding_specs[0], "a0")
        self.assertEqual(dtensor.fetch_layout(grad_x).sharding_specs[0],
                         "a0")
        with tf.GradientTape() as tape:
            plain = tf.constant(x)
            tape.watch(plain)
            plain_kernel = tf.constant(layer.kernel.numpy())
            tape.watch(plain_kernel)
            expected = keras.ops.conv(plain, plain_kernel, padding="same",
                                      dilation_rate=3)
            total = tf.reduce_sum(expected * expected)
        expected_grads = tape.gradient(total, [plain, plain_kernel])
        np.testing.assert_allclose(
            np.concatenate([t.numpy() for t in dtensor.unpack(out)]),
            expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(
            np.concatenate([t.numpy() for t in dtensor.unpack(grad_x)]),
            expected_grads[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dtensor.unpack(grad_kernel)[0].numpy(),
                                   expected_grads[1], rtol=1e-4, atol=1e-3)

    def test_grouped_convolutions_keep_the_batch_split(self):
        """TensorFlow has no CPU kernel for a grouped convolution's
        gradients; plain Keras compiles it with XLA, a DTensor step does
        not ("Gradients for grouped convolutions are not supported on
        CPU" without `ungrouped`). Depthwise (one channel a group, a
        multiplier of 2; dilated), two groups of 3 channels, 1-D ones and
        a 3-D one: values and gradients equal plain Keras's, the batch split."""
        import keras
        from tensorflow.experimental import dtensor

        mesh = dtensor.create_mesh([("a0", 4)], device_type="CPU")
        batch = lambda rank: dtensor.Layout.batch_sharded(  # noqa: E731
            mesh, "a0", rank)
        cases = [  # (input shape, kernel shape, conv arguments)
            ((8, 9, 9, 6), (3, 3, 1, 12), {"padding": "same"}),
            ((8, 9, 9, 6), (3, 3, 1, 6),
             {"padding": "same", "dilation_rate": 2}),
            ((8, 9, 9, 6), (3, 3, 3, 4), {"strides": 2}),
            ((8, 11, 6), (3, 2, 9), {}),
            ((8, 11, 6), (3, 1, 12), {"padding": "same"}),
            ((8, 4, 5, 5, 4), (2, 2, 2, 2, 4), {}),  # one per group
        ]
        rng = np.random.default_rng(0)
        for shape, kernel_shape, arguments in cases:
            with self.subTest(shape=shape, kernel=kernel_shape,
                              **arguments):
                x = rng.random(shape, dtype=np.float32)
                w = rng.normal(size=kernel_shape).astype(np.float32)
                rank = len(shape)
                kernel = dtensor.copy_to_mesh(
                    w, dtensor.Layout.replicated(mesh, len(kernel_shape)))
                sharded = dtensor.relayout(dtensor.copy_to_mesh(
                    x, dtensor.Layout.replicated(mesh, rank)), batch(rank))

                @tf.function
                def step(inputs):
                    with op_rules.substitutes(mesh), \
                            tf.GradientTape() as tape:
                        tape.watch([inputs, kernel])
                        out = keras.ops.conv(inputs, kernel, **arguments)
                        total = tf.reduce_sum(out * out)
                    return out, tape.gradient(total, [inputs, kernel])

                out, (grad_x, grad_kernel) = step(sharded)
                for value in (out, grad_x):
                    self.assertEqual(
                        dtensor.fetch_layout(value).sharding_specs[0], "a0")
                with tf.GradientTape() as tape:
                    plain, plain_kernel = tf.constant(x), tf.constant(w)
                    tape.watch([plain, plain_kernel])
                    expected = keras.ops.conv(plain, plain_kernel,
                                              **arguments)
                    total = tf.reduce_sum(expected * expected)
                expected_grads = tape.gradient(total, [plain, plain_kernel])
                whole = lambda t: np.concatenate(  # noqa: E731
                    [part.numpy() for part in dtensor.unpack(t)])
                np.testing.assert_allclose(whole(out), expected,
                                           rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(whole(grad_x), expected_grads[0],
                                           rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(
                    dtensor.unpack(grad_kernel)[0].numpy(),
                    expected_grads[1], rtol=1e-4, atol=1e-3)

    def test_einsum_matmul_equals_keras_matmul(self):
        import keras

        rng = np.random.default_rng(0)
        for shape in ((2, 5, 3), (2, 4, 5, 3)):
            x = rng.random(shape, dtype=np.float32)
            w = rng.random((3, 6), dtype=np.float32)
            np.testing.assert_allclose(op_rules.einsum_matmul(x, w),
                                       keras.ops.matmul(x, w), rtol=1e-6)
            with op_rules.inner_splits_kept(True):  # NumPy in, as a user may
                substituted = keras.ops.matmul(x, w)
            np.testing.assert_allclose(substituted, x @ w, rtol=1e-6)
        ints = op_rules.einsum_matmul(np.ones((2, 3, 4), np.int32),
                                      np.ones((4, 2), np.int32))
        self.assertEqual(ints.dtype, keras.ops.matmul(
            np.ones((2, 3, 4), np.int32), np.ones((4, 2), np.int32)).dtype)

    def test_dense_on_a_sequence_split_keeps_the_split(self):
        # Keras's `tf.tensordot` merges batch and sequence: DTensor
        # gathers a sequence-split input and computes the whole Dense on
        # every device. As an einsum the output stays split.
        import keras
        from tensorflow.experimental import dtensor

        mesh = dtensor.create_mesh([("a0", 4)], device_type="CPU")
        split = dtensor.Layout([dtensor.UNSHARDED, "a0", dtensor.UNSHARDED],
                               mesh)
        self.assertTrue(op_rules.splits_inner_dims(split))
        self.assertFalse(op_rules.splits_inner_dims(
            dtensor.Layout(["a0", dtensor.UNSHARDED, dtensor.UNSHARDED],
                           mesh)))
        dense = keras.layers.Dense(6)
        dense.build((None, 8, 4))
        kernel = dtensor.copy_to_mesh(dense.kernel.value,
                                      dtensor.Layout.replicated(mesh, 2))
        x = np.random.default_rng(0).random((2, 8, 4), dtype=np.float32)
        sharded = dtensor.relayout(
            dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, 3)),
            split)
        keras_matmul = op_rules.tf_numpy.matmul
        for active, expected in ((False, dtensor.UNSHARDED), (True, "a0")):
            with self.subTest(einsum=active):
                @tf.function
                def step(inputs):
                    with op_rules.inner_splits_kept(active):
                        return keras.ops.matmul(inputs, kernel)

                out = step(sharded)
                self.assertEqual(
                    dtensor.fetch_layout(out).sharding_specs[1], expected)
                np.testing.assert_allclose(
                    np.concatenate([t.numpy() for t in dtensor.unpack(out)],
                                   axis=1) if active else
                    dtensor.unpack(out)[0].numpy(),
                    x @ dense.kernel.numpy(), rtol=1e-5)
                self.assertIs(op_rules.tf_numpy.matmul, keras_matmul)

    def test_batch_axis_rules_gather_data_and_keep_weights(self):
        # `tf.split/tile/concat` along dim 0 take a batch whole (DTensor
        # refuses them along a split dim); a weight's dim 0 is not the
        # batch, and its split elsewhere stays (a GRU's (2, 3 x units)
        # bias, parted on axis 0, split on its units).
        from tensorflow.experimental import dtensor

        mesh = dtensor.create_mesh([("a0", 4)], device_type="CPU")
        rows = dtensor.Layout(["a0", dtensor.UNSHARDED], mesh)
        columns = dtensor.Layout([dtensor.UNSHARDED, "a0"], mesh)
        values = np.arange(64, dtype=np.float32).reshape(8, 8)
        batch = dtensor.relayout(dtensor.copy_to_mesh(
            values, dtensor.Layout.replicated(mesh, 2)), rows)
        weight = dtensor.DVariable(dtensor.relayout(dtensor.copy_to_mesh(
            values[:2], dtensor.Layout.replicated(mesh, 2)), columns))

        @tf.function
        def step(x):
            with op_rules.substitutes(mesh):
                first, _ = tf.split(x, 2)
                ones = tf.ones_like(first)
                return (tf.concat([first, ones], 0), tf.tile(first, [2, 1]),
                        tf.split(weight.read_value(), 2)[1])

        joined, tiled, bias = step(batch)
        np.testing.assert_array_equal(
            dtensor.unpack(joined)[0].numpy(),
            np.concatenate([values[:4], np.ones((4, 8))]))
        np.testing.assert_array_equal(dtensor.unpack(tiled)[3].numpy(),
                                      np.tile(values[:4], [2, 1]))
        self.assertEqual(dtensor.fetch_layout(bias).sharding_specs,
                         [dtensor.UNSHARDED, "a0"])
        np.testing.assert_array_equal(
            np.concatenate([t.numpy() for t in dtensor.unpack(bias)], 1),
            values[1:2])

    def test_indices_that_insert_axes_name_every_dim(self):
        x = tf.reshape(tf.range(2 * 3 * 4), (2, 3, 4))
        cases = [
            ((None,), (None, slice(None), slice(None), slice(None))),
            ((slice(None), None), (slice(None), None, slice(None),
                                   slice(None))),
            ((Ellipsis, None), (slice(None), slice(None), slice(None), None)),
            ((None, Ellipsis, 1), (None, slice(None), slice(None), 1)),
            ((0, None), (0, None, slice(None), slice(None))),
        ]
        for spec, named in cases:
            with self.subTest(spec=spec):
                self.assertEqual(op_rules.every_dim_named(x, spec), named)
                np.testing.assert_array_equal(x[named], x[spec])
        # No inserted axis, or an index it cannot read: as it was.
        for spec in ((slice(None), 0), (Ellipsis, 1), ([0, 1], None), 0):
            self.assertIs(op_rules.every_dim_named(x, spec), spec)
        self.assertEqual(op_rules.every_dim_named(x, None),
                         (None, slice(None), slice(None), slice(None)))

    def test_einsum_ellipses_written_as_letters(self):
        x = tf.reshape(tf.range(2 * 3 * 4 * 5, dtype=tf.float32),
                       (2, 3, 4, 5))
        y = tf.ones((2, 3, 6, 5))
        equation = op_rules.explicit_einsum("...ij,...kj->...ik", (x, y))
        self.assertEqual(equation, "abij,abkj->abik")
        np.testing.assert_allclose(
            tf.einsum(equation, x, y),
            tf.einsum("...ij,...kj->...ik", x, y))
        # Broadcasting, an implicit output, no `...`: left as written.
        for equation, operands in (
                ("...ij,...kj->...ik", (x, tf.ones((1, 3, 6, 5)))),
                ("...ij,...kj", (x, y)), ("bij,bkj->bik", (x, y))):
            self.assertEqual(
                op_rules.explicit_einsum(equation, operands), equation)

    def test_int64_scatter_equals_tensorflows(self):
        scatter = op_rules._int32_scatter(tf.scatter_nd)
        indices = tf.constant([[0, 1], [2, 2], [0, 1]], tf.int64)
        updates = tf.constant([1.0, 2.0, 3.0])
        for shape in ((3, 3), tf.constant([3, 3], tf.int64)):
            np.testing.assert_array_equal(
                scatter(indices, updates, shape),
                tf.scatter_nd(indices, updates, shape))

    def test_inserted_axes_run_on_a_split_batch(self):
        # DTensor crashes the process on these indices as written (a
        # segmentation fault), so they run in a process of their own.
        import subprocess
        import sys

        script = """
import numpy as np, tensorflow as tf
import flexflow_keras
from tensorflow.experimental import dtensor
from flexflow_keras.runtime import op_rules
mesh = dtensor.create_mesh([("a0", 4)], device_type="CPU")
values = np.random.default_rng(0).normal(size=(8, 3, 2)).astype("float32")
x = dtensor.relayout(dtensor.copy_to_mesh(
    values, dtensor.Layout.replicated(mesh, 3)),
    dtensor.Layout(["a0", dtensor.UNSHARDED, dtensor.UNSHARDED], mesh))
specs = [(None,), (slice(None), None), (None, Ellipsis),
         (slice(None), None, Ellipsis), (slice(None), slice(None), None)]
@tf.function
def step(x):
    with op_rules.substitutes(mesh), tf.GradientTape() as tape:
        tape.watch(x)
        total = tf.add_n([tf.reduce_sum(x[spec] * x[spec]) for spec in specs])
    return total, tape.gradient(total, x)
total, grad = step(x)
np.testing.assert_allclose(total.numpy(), 5 * (values ** 2).sum(), rtol=1e-5)
got = np.concatenate([g.numpy() for g in dtensor.unpack(grad)])
np.testing.assert_allclose(got, 10 * values, rtol=1e-5)
print("ran")
"""
        env = dict(os.environ, FLEXFLOW_KERAS_CPU_DEVICES="4")
        done = subprocess.run([sys.executable, "-c", script], env=env,
                              capture_output=True, text=True, timeout=300)
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        self.assertIn("ran", done.stdout)

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
