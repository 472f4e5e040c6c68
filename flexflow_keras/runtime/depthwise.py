"""Depthwise convolution whose gradient DTensor can split by the batch.

Why: TensorFlow 2.21's DTensor has a layout rule for the forward
`DepthwiseConv2dNative` but none for its two gradients
(`DepthwiseConv2dNativeBackpropInput`, `...BackpropFilter`). Through
DTensor's replicated switch every device all-gathered the whole batch
and computed the whole gradient, so `DepthwiseConv2D` and
`SeparableConv2D` declared no split: keras.io's
`image_classification_from_scratch.py` (an Xception-like net of
SeparableConv2D) needed the whole model's activations on each of 4
virtual CPU devices, fitted none, and trained on one device (it still
does, for what DTensor holds on CPU devices beside that:
`planner.DTENSOR_CPU_MEMORY_FACTOR`; at 90x90 the split step is 1.7x as
fast as the replicated one, `docs/RUNTIME.md`).

Here the forward is TensorFlow's own op, and the gradient is written
with ops DTensor splits by the batch, one kernel tap at a time (the
sum TensorFlow's kernels compute, in another order):
- kernel: for tap (a, b), the input window the tap saw (a strided slice
  of the padded input) times the output gradient, summed over batch and
  positions: each device sums its rows and DTensor all-reduces; the
  taps one after another, so one tap's product is alive at a time;
- input: the transposed convolution as TensorFlow's forward depthwise
  op, which DTensor splits: the output gradient with zeros between its
  positions (strides), padded, through the flipped kernel.

NHWC, dilation 1 and known spatial sizes only (Keras's CPU path is
NHWC, and `op_rules` writes a dilated kernel out); anything else runs
TensorFlow's op as before.
"""

from typing import Any

import tensorflow as tf

# TensorFlow's own ops, kept before `op_rules.substitutes` replaces the
# public names while a step is traced.
_TF_DEPTHWISE = tf.nn.depthwise_conv2d
_TF_SEPARABLE = tf.nn.separable_conv2d


def depthwise_conv2d(input: Any, filter: Any, strides: Any, padding: Any,
                     data_format: Any = None, dilations: Any = None,
                     name: Any = None) -> Any:
    """`tf.nn.depthwise_conv2d`, same arguments and values, with a
    gradient DTensor splits by the batch (module docstring)."""
    geometry = _geometry(input, filter, strides, padding, data_format,
                         dilations)
    if geometry is None:
        return _TF_DEPTHWISE(input, filter, strides, padding,
                             data_format=data_format, dilations=dilations,
                             name=name)
    return _depthwise(input, filter, geometry)


def separable_conv2d(input: Any, depthwise_filter: Any,
                     pointwise_filter: Any, strides: Any, padding: Any,
                     data_format: Any = None, dilations: Any = None,
                     name: Any = None) -> Any:
    """`tf.nn.separable_conv2d` as TensorFlow computes it (a depthwise
    convolution, then a 1x1 convolution), the depthwise part through
    `depthwise_conv2d`."""
    geometry = _geometry(input, depthwise_filter, strides, padding,
                         data_format, dilations)
    if geometry is None:
        return _TF_SEPARABLE(input, depthwise_filter, pointwise_filter,
                             strides, padding, data_format=data_format,
                             dilations=dilations, name=name)
    depthwise = _depthwise(input, depthwise_filter, geometry)
    return tf.nn.conv2d(depthwise, pointwise_filter, [1, 1, 1, 1], "VALID",
                        data_format="NHWC", name=name)


class _Geometry:
    """A depthwise convolution's static sizes: strides, kernel, the
    output's spatial size and the padding before and after each
    spatial dim."""

    def __init__(self, padding, strides, kernel, out, pads):
        self.padding = padding  # SAME or VALID
        self.strides = strides  # (sh, sw)
        self.kernel = kernel  # (kh, kw)
        self.out = out  # (oh, ow)
        self.pads = pads  # ((top, bottom), (left, right))
        self.tf_strides = [1, strides[0], strides[1], 1]


def _geometry(input, filter, strides, padding, data_format, dilations):
    """The convolution's `_Geometry`, or None where TensorFlow's op runs
    (not NHWC, dilated, explicit padding, unknown sizes)."""
    if data_format not in (None, "NHWC"):
        return None
    if dilations is not None and any(d != 1 for d in _pair(dilations)):
        return None
    if not isinstance(padding, str) or padding.upper() not in ("SAME",
                                                               "VALID"):
        return None
    shape = getattr(input, "shape", None)
    kernel_shape = getattr(filter, "shape", None)
    if shape is None or kernel_shape is None or shape.rank != 4 \
            or kernel_shape.rank != 4:
        return None
    size = (shape[1], shape[2])
    kernel = (kernel_shape[0], kernel_shape[1])
    if None in size or None in kernel or shape[3] is None:
        return None
    strides = list(strides)
    if len(strides) == 4:
        if strides[0] != 1 or strides[3] != 1:
            return None
        strides = strides[1:3]
    if len(strides) != 2:
        return None
    out, pads = [], []
    for n, k, s in zip(size, kernel, strides):
        if padding.upper() == "SAME":
            o = -(-n // s)
            total = max((o - 1) * s + k - n, 0)
            pads.append((total // 2, total - total // 2))
        else:
            o = (n - k) // s + 1
            pads.append((0, 0))
        out.append(o)
    if min(out) < 1:
        return None
    return _Geometry(padding.upper(), tuple(strides), kernel, tuple(out),
                     tuple(pads))


def _pair(value):
    value = list(value) if not isinstance(value, int) else [value] * 2
    return value[1:3] if len(value) == 4 else value


def _depthwise(x: Any, kernel: Any, g: _Geometry) -> Any:
    @tf.custom_gradient
    def run(x, kernel):
        y = _TF_DEPTHWISE(x, kernel, g.tf_strides, g.padding,
                          data_format="NHWC")

        def grad(dy):
            return _input_gradient(dy, kernel, x, g), \
                _kernel_gradient(dy, x, kernel, g)

        return y, grad

    return run(x, kernel)


def _taps(g: _Geometry):
    return [(a, b) for a in range(g.kernel[0]) for b in range(g.kernel[1])]


def _window(padded: Any, a: int, b: int, g: _Geometry) -> Any:
    """The padded input's values tap (a, b) read: (batch, oh, ow, C)."""
    (sh, sw), (oh, ow) = g.strides, g.out
    return padded[:, a:a + sh * (oh - 1) + 1:sh,
                  b:b + sw * (ow - 1) + 1:sw, :]


def _kernel_gradient(dy: Any, x: Any, kernel: Any, g: _Geometry) -> Any:
    """Tap by tap, each tap after the one before (a control
    dependency): run side by side, every tap's product with the output
    gradient was alive at once, nine times the activations (keras.io's
    Xception-like net was killed for memory at 20 GiB)."""
    channels, multiplier = kernel.shape[2], kernel.shape[3]
    padded = tf.pad(x, [[0, 0], list(g.pads[0]), list(g.pads[1]), [0, 0]])
    dy = tf.reshape(dy, [-1, g.out[0], g.out[1], channels, multiplier])
    taps, previous = [], []
    for a, b in _taps(g):
        with tf.control_dependencies(previous):
            window = tf.expand_dims(_window(padded, a, b, g), -1)
            tap = tf.reduce_sum(window * dy, axis=[0, 1, 2])
        taps.append(tap)
        previous = [tap]
    return tf.reshape(tf.stack(taps), kernel.shape)


def _input_gradient(dy: Any, kernel: Any, x: Any, g: _Geometry) -> Any:
    """The transposed convolution, as the forward depthwise op (which
    DTensor splits): the output gradient with zeros between its
    positions (strides), padded by the kernel's size less one, run
    through the spatially flipped kernel, one channel per input channel
    and multiplier, then summed over the multiplier; the padding cut
    off."""
    channels, multiplier = kernel.shape[2], kernel.shape[3]
    (sh, sw), (oh, ow) = g.strides, g.out
    (kh, kw) = g.kernel
    (top, bottom), (left, right) = g.pads
    height = x.shape[1] + top + bottom
    width = x.shape[2] + left + right
    wide = channels * multiplier
    if sh > 1 or sw > 1:  # zeros between the positions taps read
        dy = tf.reshape(dy, [-1, oh, 1, ow, 1, wide])
        dy = tf.pad(dy, [[0, 0], [0, 0], [0, sh - 1], [0, 0], [0, sw - 1],
                         [0, 0]])
        dy = tf.reshape(dy, [-1, oh * sh, ow * sw, wide])
        dy = dy[:, :(oh - 1) * sh + 1, :(ow - 1) * sw + 1, :]
    rows = (oh - 1) * sh + 1
    cols = (ow - 1) * sw + 1
    dy = tf.pad(dy, [[0, 0], [kh - 1, height - rows], [kw - 1, width - cols],
                     [0, 0]])
    flipped = tf.reshape(tf.gather(tf.gather(kernel, list(range(kh - 1, -1,
                                                                -1)), axis=0),
                                   list(range(kw - 1, -1, -1)), axis=1),
                         [kh, kw, wide, 1])
    dx = _TF_DEPTHWISE(dy, flipped, [1, 1, 1, 1], "VALID",
                       data_format="NHWC")
    if multiplier > 1:
        dx = tf.reduce_sum(tf.reshape(
            dx, [-1, height, width, channels, multiplier]), axis=-1)
    return dx[:, top:top + x.shape[1], left:left + x.shape[2], :]
