"""TensorFlow ops that DTensor has no layout rule for: run replicated, or
replaced by ops that have one.

TensorFlow 2.21's DTensor has no SPMD rule for some ops that Keras layers
emit, mostly in their gradients. Two remedies, each measured to train
equal to plain Keras:

- `substitutes()`: while a step is traced, Keras's TensorFlow backend
  builds `keras.ops.flip` (`ReverseV2`, used by `Bidirectional`) from
  gathers, which DTensor shards; same values, bit for bit.
- `enable()`: DTensor has a per-op switch to run such an op
with every input and output replicated (each device computes the whole
op; the inputs are all-gathered first): the environment variable
`DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_<MLIR op name, upper case>`,
read when a step is traced (`tensorflow/dtensor/cc/dtensor_utils.cc`;
tf-keras set it for `TF.RESOURCESCATTERADD`). The name holds a dot, so
only `os.environ` can set it.

The table holds the ops measured here to then train equal to plain Keras
(a one-layer model per op, fit under data parallelism on 4 virtual CPUs):
what each layer costs is its replicated op's all-gather, which the
simulator does not price yet.
"""

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from keras.src.backend.tensorflow import numpy as tf_numpy

# op name -> the layers that emit it (for the docs and messages).
REPLICATED_OPS = {
    "AvgPoolGrad": "AveragePooling1D/2D/3D (gradient)",
    "DepthwiseConv2dNativeBackpropFilter": (
        "DepthwiseConv1D/2D, SeparableConv1D/2D (filter gradient)"
    ),
    "DepthwiseConv2dNativeBackpropInput": (
        "DepthwiseConv1D/2D, SeparableConv1D/2D (input gradient)"
    ),
}

_PREFIX = "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF."


def enable() -> None:
    """Turns the switch on for every op in `REPLICATED_OPS` (unless the
    user set it already)."""
    for op in REPLICATED_OPS:
        os.environ.setdefault(_PREFIX + op.upper(), "1")


def flip_by_gather(x: Any, axis: Any = None) -> tf.Tensor:
    """`keras.ops.flip` as gathers (DTensor has no rule for `ReverseV2`,
    what `tf.reverse` emits)."""
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    axes = range(rank) if axis is None else [
        a % rank for a in (axis if isinstance(axis, (list, tuple))
                           else (axis,))
    ]
    for a in axes:
        x = tf.gather(x, tf.range(tf.shape(x)[a] - 1, -1, -1), axis=a)
    return x


@contextlib.contextmanager
def substitutes() -> Iterator[None]:
    """While a DTensor step is traced: Keras ops built from ops that
    DTensor has rules for."""
    keras_flip = tf_numpy.flip
    tf_numpy.flip = flip_by_gather
    try:
        yield
    finally:
        tf_numpy.flip = keras_flip
