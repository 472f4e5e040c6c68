"""Depthwise and separable convolutions train split by the batch.

DTensor has no rule for TensorFlow's depthwise-convolution gradients;
through its replicated switch each device computed the whole batch's
gradient, so these layers declared no split and keras.io's
`image_classification_from_scratch.py` (SeparableConv2D) fitted on no
strategy over 4 virtual CPUs: it trained on one device.
`runtime/depthwise.py` writes the gradients with ops DTensor splits.
"""

import itertools
import os
import unittest

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

import runtime_support as support
from flexflow_keras import capabilities
from flexflow_keras.runtime import depthwise, model_step, op_rules
from flexflow_keras.strategy import Strategy


def assert_close(a, b, rtol=1e-5):
    """Equal up to float sums in another order: relative to the
    tensor's largest value (gradients are sums with cancellations).

    The order TensorFlow's own kernels sum in depends on the CPU: on one
    machine a 1x1 kernel's gradient (120 products of terms up to about
    10, summing to 3.1) came out 1.2e-5 from ours (3.8e-6 of its largest
    value), over the 2e-6 this asked before, at every commit. A mix-up
    is off by more than the largest value itself (measured: taps
    flipped 2.1 times it, channels rolled 1.7 times)."""
    a, b = np.asarray(a), np.asarray(b)
    scale = max(float(np.max(np.abs(b))), 1.0)
    np.testing.assert_array_less(np.max(np.abs(a - b)), rtol * scale)


def _values_and_gradients(function, inputs):
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        y = function(*inputs)
        # weights of their own per output element: any mix-up shows (and
        # the output's gradient is laid out as the output is)
        weights = tf.reshape(tf.cos(tf.range(tf.size(y), dtype=y.dtype)),
                             y.shape)
        loss = tf.reduce_sum(tf.square(y) * weights)
    return [y] + tape.gradient(loss, inputs)


class GradientTest(unittest.TestCase):
    """Values and gradients equal TensorFlow's own ops."""

    def test_against_tensorflow(self):
        rng = np.random.default_rng(0)
        cases = itertools.product(
            [(7, 7), (8, 5)], [(3, 3), (1, 1), (2, 3), (5, 5)], [1, 2, 3],
            ["SAME", "VALID"], [1, 2],
        )
        for size, kernel, stride, padding, multiplier in cases:
            if padding == "VALID" and (kernel[0] > size[0]
                                       or kernel[1] > size[1]):
                continue
            x = tf.constant(rng.standard_normal((3,) + size + (4,)),
                            tf.float32)
            k = tf.constant(rng.standard_normal(kernel + (4, multiplier)),
                            tf.float32)
            p = tf.constant(rng.standard_normal((1, 1, 4 * multiplier, 5)),
                            tf.float32)
            strides = [1, stride, stride, 1]
            pairs = [
                (lambda x, k: depthwise.depthwise_conv2d(x, k, strides,
                                                         padding),
                 lambda x, k: tf.nn.depthwise_conv2d(x, k, strides,
                                                     padding), [x, k]),
                (lambda x, k, p: depthwise.separable_conv2d(
                    x, k, p, strides, padding),
                 lambda x, k, p: tf.nn.separable_conv2d(
                     x, k, p, strides, padding), [x, k, p]),
            ]
            for ours, theirs, inputs in pairs:
                with self.subTest(size=size, kernel=kernel, stride=stride,
                                  padding=padding, multiplier=multiplier,
                                  separable=len(inputs) == 3):
                    got = _values_and_gradients(ours, inputs)
                    want = _values_and_gradients(theirs, inputs)
                    for a, b in zip(got, want):
                        assert_close(a, b)

    def test_other_cases_run_tensorflows_op(self):
        """Dilated or NCHW: TensorFlow's op, unchanged."""
        x = tf.ones((1, 6, 6, 2))
        k = tf.ones((3, 3, 2, 1))
        self.assertIsNone(depthwise._geometry(x, k, [1, 1, 1, 1], "SAME",
                                              "NHWC", [1, 2, 2, 1]))
        self.assertIsNone(depthwise._geometry(x, k, [1, 1, 1, 1], "SAME",
                                              "NCHW", None))
        np.testing.assert_allclose(
            depthwise.depthwise_conv2d(x, k, [1, 1, 1, 1], "SAME",
                                       dilations=[2, 2]),
            tf.nn.depthwise_conv2d(x, k, [1, 1, 1, 1], "SAME",
                                   dilations=[2, 2]))


class SplitBatchTest(unittest.TestCase):
    """On a 4-device mesh with the batch split: no replicated switch,
    the input's gradient split as the input, values as TensorFlow's."""

    def test_gradients_split(self):
        self.assertFalse([name for name in os.environ
                          if "DEPTHWISECONV2DNATIVE" in name])
        self.assertEqual(capabilities.TABLE["SeparableConv2D"]
                         .replicated_ops, ())
        mesh = dtensor.create_mesh([("batch", 4)], device_type="CPU")
        rng = np.random.default_rng(1)
        x0 = rng.standard_normal((8, 9, 9, 4)).astype("float32")
        k0 = rng.standard_normal((3, 3, 4, 2)).astype("float32")
        split = dtensor.Layout(["batch"] + [dtensor.UNSHARDED] * 3, mesh)
        x = dtensor.relayout(dtensor.copy_to_mesh(
            x0, dtensor.Layout.replicated(mesh, 4)), split)
        k = dtensor.copy_to_mesh(k0, dtensor.Layout.replicated(mesh, 4))

        @tf.function
        def step(x, k):
            return _values_and_gradients(
                lambda x, k: depthwise.depthwise_conv2d(
                    x, k, [1, 2, 2, 1], "SAME"), [x, k])

        got = step(x, k)
        want = _values_and_gradients(
            lambda x, k: tf.nn.depthwise_conv2d(x, k, [1, 2, 2, 1], "SAME"),
            [tf.constant(x0), tf.constant(k0)])
        self.assertEqual(dtensor.fetch_layout(got[1]), split)
        for a, b in zip(got, want):
            whole = dtensor.relayout(a, dtensor.Layout.replicated(
                mesh, a.shape.rank))
            assert_close(dtensor.unpack(whole)[0], b)


ROWS, SIZE, BATCH = 40, 12, 8  # 5 batches


def build(mod):
    """An Xception-like net, as keras.io's image classification script:
    separable convolutions (one strided), a depthwise convolution with
    a channel multiplier, batch norm, a residual and dropout."""
    inputs = mod.Input((SIZE, SIZE, 3))
    h = mod.layers.Rescaling(1.0 / 255)(inputs)
    # No bias before a batch norm: its gradient is rounding noise, which
    # Adam scales up to the learning rate (weights then differ by noise).
    h = mod.layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(h)
    h = mod.layers.BatchNormalization()(h)
    h = mod.layers.Activation("relu")(h)
    residual = h
    h = mod.layers.SeparableConv2D(8, 3, padding="same", use_bias=False)(h)
    h = mod.layers.BatchNormalization()(h)
    h = mod.layers.Activation("relu")(h)
    h = mod.layers.SeparableConv2D(16, 3, strides=2, padding="same")(h)
    residual = mod.layers.Conv2D(16, 1, strides=2, padding="same")(residual)
    h = mod.layers.add([h, residual])
    h = mod.layers.DepthwiseConv2D(3, depth_multiplier=2,
                                   padding="valid")(h)
    h = mod.layers.GlobalAveragePooling2D()(h)
    h = mod.layers.Dropout(0.25, seed=3)(h)
    outputs = mod.layers.Dense(3, activation="softmax")(h)
    return mod.Model(inputs, outputs)


class SeparableModelTest(unittest.TestCase):
    def test_trains_split_equal_to_plain_keras(self):
        rng = np.random.default_rng(2)
        x = rng.integers(0, 256, (ROWS, SIZE, SIZE, 3)).astype("float32")
        y = rng.integers(0, 3, ROWS)
        histories, models, messages = support.fit_plain_and_ours(
            build, lambda graph: Strategy.data_parallel(graph, 4), BATCH, 11,
            dict(optimizer="adam", loss="sparse_categorical_crossentropy",
                 metrics=["accuracy"]),
            x=x, y=y, epochs=2, shuffle=False, validation_split=0.2,
            verbose=0)
        self.assertFalse([m for m in messages if "plain Keras" in m
                          or "one device" in m], messages)
        ours = models["ours"]
        convs = [op for op, config in ours.strategy.items()
                 if "separable" in op or "depthwise" in op]
        self.assertEqual(len(convs), 3, sorted(ours.strategy))
        for op in convs:
            self.assertEqual(ours.strategy[op].dims[0], 4, op)
        executor = ours.strategy_executor
        self.assertIsInstance(executor, model_step.ModelStepExecutor)
        self.assertEqual(executor.replicated_ops, [])
        self.assertFalse([name for name in os.environ
                          if name.startswith(op_rules.switch("Depthwise"))])
        for key, values in histories["plain"].items():
            np.testing.assert_allclose(histories["ours"][key], values,
                                       rtol=1e-5, err_msg=key)
        for a, b in zip(models["plain"].get_weights(),
                        models["ours"].get_weights()):
            # relative to the weight's size: the gradients are sums in
            # another order, and Adam scales a small gradient's rounding
            assert_close(b, a, 1e-5)


if __name__ == "__main__":
    unittest.main()
