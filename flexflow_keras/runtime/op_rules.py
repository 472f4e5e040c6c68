"""TensorFlow ops that DTensor has no layout rule for: run replicated, or
replaced by ops that have one.

TensorFlow 2.21's DTensor has no SPMD rule for some ops that Keras layers
emit, mostly in their gradients. Two remedies, each measured to train
equal to plain Keras:

- `substitutes(mesh)`: while a step is traced, Keras's TensorFlow
  backend builds `keras.ops.flip` (`ReverseV2`, used by `Bidirectional`)
  from gathers, which DTensor shards (same values, bit for bit), and
  `tf.roll` (`keras.ops.roll`: Swin's shifted windows) from slices and
  a concat (`roll_by_slices`, bit for bit too); runs a
  dilated convolution (TensorFlow's `SpaceToBatchND`/`BatchToSpaceND`)
  as its phases beside the batch, with reshapes and transposes (same
  values up to the order of float sums); runs depthwise and separable
  convolutions with a gradient DTensor splits by the batch
  (`depthwise.py`: it has no rule for TensorFlow's); and gathers the inputs of a
  `tf.concat` (what `keras.ops.concatenate` calls), `tf.split` or
  `tf.tile` along the batch axis first (DTensor refuses them along a
  split dim: a GAN joining fake and real batches).
- `substitutes` also makes `tf.argmax`/`argmin` (below) and every
  stateless random draw (`tf.random.
  stateless_*`, what `keras.random.*`, `Dropout`, `GaussianNoise` and
  the random augmentation layers call, and `tf.nn.experimental.
  stateless_dropout`) come out replicated: each device draws the whole
  tensor at its global shape, so the values are what plain Keras draws on
  one device from the same seed (DTensor's own rule for a split output
  mixes each device's id into the seed: other values, measured).
  Consumers take their slice locally; the cost is the draw's redundant
  compute, no communication.
- `substitutes` also writes an einsum's `...` as letters
  (`explicit_einsum`): DTensor refuses every equation with `...`.
- `substitutes` also gives `ScatterNd` int32 indices where they were
  int64 (`_int32_scatter`): DTensor fails on the latter (Keras's
  confusion matrix: `BinaryIoU`, `MeanIoU`).
- `substitutes` also writes out the dims an index that inserts axes
  leaves implicit (`t[:, tf.newaxis]` as `t[:, tf.newaxis, :, :]`):
  DTensor crashes the process on the former (`every_dim_named`).
- `substitutes` also slices tensors whose slice bounds are known only at
  run time (`x[:, h:h + 8]` with a tensor `h`: Keras's `RandomCrop`) by
  `plain_slice`: a constant-size `tf.slice`, or gathers of position
  ranges. DTensor expands such a `StridedSlice` to an empty slice on
  every device, replicated or split (measured, TF 2.21: the slice's sum
  0.0 against 1842432.0); keras.io's TokenLearner failed its first step
  ("input image must be of non-zero size") and trained as plain Keras.
- TensorFlow's stateful random ops (`tf.random.uniform/normal/
  truncated_normal` in a script's own step, as in keras.io's GAN
  examples), which DTensor refuses, run as their stateless twins with
  the key and counter plain Keras's kernels would have:
  `stateful_draws.py`.
- `enable(ops)`: DTensor has a per-op switch to run such an op with
  every input and output replicated (each device computes the whole op;
  the inputs are all-gathered first): the environment variable
  `DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_<MLIR op name, upper case>`,
  read when a step is traced (`tensorflow/dtensor/cc/dtensor_utils.cc`;
  tf-keras set it for `TF.RESOURCESCATTERADD`). The name holds a dot, so
  only `os.environ` can set it. Measured: any value turns it on ("0"
  too), and once DTensor has read it the process keeps it on, even if
  the variable is removed. The runtime sets it when it builds an
  executor, not at import. Which ops need it is
  `capabilities.TABLE`'s `replicated_ops` (measured: each fails without
  the switch and trains equal to plain Keras with it), plus what
  `probe.py` finds for unlisted layers; the layers emitting them declare
  no split, so the search gives them unsplit configs.
"""

import contextlib
import inspect
import os
import string
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf
from keras import tree
from keras.src.backend.config import standardize_data_format
from tensorflow.experimental import dtensor
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import (
    array_ops, gen_linalg_ops, gen_math_ops, nn_ops, stateless_random_ops,
)
from keras.src.backend.tensorflow import nn as tf_nn
from keras.src.backend.tensorflow import numpy as tf_numpy

from flexflow_keras import capabilities
from flexflow_keras.runtime import depthwise

_PREFIX = "DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF."


def enable(ops: Iterable[str] | None = None) -> None:
    """Turns the switch on for `ops` (TensorFlow op names; default: every
    op in the capability table), unless the user set it already."""
    if ops is None:
        ops = capabilities.replicated_ops()
    for op in ops:
        os.environ.setdefault(switch(op), "1")


def switch(op: str) -> str:
    """The environment variable of DTensor's replicated switch for `op`."""
    return _PREFIX + op.upper()


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


def roll_by_slices(mesh: Any, roll: Any) -> Any:
    """`tf.roll` (what `keras.ops.roll` calls) as a slice and a concat
    per axis, or as a gather where the axis's size is known only at run
    time.

    Why: DTensor has no rule for `Roll` (TF 2.21), so a layer that rolls
    (keras.io's Swin Transformer shifts its windows by `ops.roll` along
    height and width) ran it replicated and the search kept the layer
    whole on one device. Slices, concats and gathers keep the other dims'
    splits (the batch). Along the batch axis (a batch rolled to pair each
    sample with another) the input is relaid whole first, as `_concat_on`
    does: a slice of a split dim kept the split, which DTensor then could
    not lay out ("5 rows on 4 devices", measured). Same values, bit for
    bit. A shift or axis known only at run time goes to TensorFlow's op,
    as before."""

    def rolled(input, shift, axis, name=None):
        x = tf.convert_to_tensor(input)
        rank = x.shape.rank
        shifts = tf.get_static_value(shift)
        axes = tf.get_static_value(axis)
        if rank is None or shifts is None or axes is None:
            return roll(input, shift, axis, name=name)
        shifts = np.atleast_1d(shifts).tolist()
        axes = [int(a) % rank for a in np.atleast_1d(axes).tolist()]
        if len(shifts) != len(axes):
            return roll(input, shift, axis, name=name)
        total = {}
        for s, a in zip(shifts, axes):
            # TensorFlow adds the shifts given for one axis.
            total[a] = total.get(a, 0) + int(s)
        if 0 in total and _batch_data(x):
            x = _relaid_whole(mesh, x)
        for a, s in total.items():
            n = x.shape[a]
            if n is not None:
                s %= max(n, 1)
            if not s:
                continue
            if n is None:
                n = tf.shape(x)[a]
                x = tf.gather(x, tf.math.floormod(tf.range(n) - s, n),
                              axis=a)
                continue
            begin, size = [0] * rank, [-1] * rank
            size[a] = n - s
            head = tf.slice(x, begin, size)
            begin[a], size[a] = n - s, s
            tail = tf.slice(x, begin, size)
            x = tf.concat([tail, head], a)
        return x

    return rolled


def _size(x: Any, axis: int) -> Any:
    """Dim `axis` of `x`: an int where the shape knows it, else a
    scalar tensor (an image of any height)."""
    static = x.shape[axis]
    return static if static is not None else tf.shape(x)[axis]


def dilated_as_phases(convolution: Any, arguments: dict,
                      rates: tuple[int, ...], kernel: str) -> tf.Tensor:
    """A dilated convolution (Keras's backend `convolution`, called with
    `arguments`, stride 1) as TensorFlow's `SpaceToBatchND` computes it,
    from ops DTensor has rules for: the padded input is cut into its
    `prod(rates)` phases (every `rate`-th pixel from each offset), the
    phases go beside the batch, each gets the undilated convolution with
    `valid` padding, and the outputs are woven back. Each output is the
    same sum of products as Keras's; only the layout moves. The batch
    stays dim 0 throughout, so DTensor keeps a split of the batch."""
    inputs = tf.convert_to_tensor(arguments["inputs"])
    spatial = len(rates)
    channels_last = (arguments.get("data_format") or
                     "channels_last") == "channels_last"
    first = 1 if channels_last else 2
    taps = arguments[kernel].shape[:spatial]
    same = arguments["padding"].lower() == "same"
    pads = [[0, 0]] * (spatial + 2)
    cut = [_size(inputs, 0)]
    if not channels_last:
        cut.append(_size(inputs, 1))
    kept = [slice(None)] * (spatial + 2)
    for i, rate in enumerate(rates):
        axis = first + i
        span = (int(taps[i]) - 1) * rate
        before = span // 2 if same else 0
        after = span - before if same else 0
        total = _size(inputs, axis) + before + after
        extra = -total % rate  # to a whole number of phases
        pads[axis] = [before, after + extra]
        cut += [(total + extra) // rate, rate]
        kept[axis] = slice(0, total - span)
    if channels_last:
        cut.append(_size(inputs, -1))
    x = tf.reshape(tf.pad(inputs, pads), cut)
    offsets = [first + 2 * i + 1 for i in range(spatial)]
    others = [d for d in range(1, len(cut)) if d not in offsets]
    x = tf.transpose(x, [0] + offsets + others)
    x = tf.reshape(x, [-1] + [cut[d] for d in others])
    y = convolution(**dict(arguments, inputs=x, padding="valid",
                           dilation_rate=1))
    # (batch, offsets..., then the convolution's own dims)
    y = tf.reshape(y, cut[:1] + list(rates)
                   + [_size(y, d) for d in range(1, spatial + 2)])
    weave = [0] + ([] if channels_last else [1 + spatial])
    for i in range(spatial):
        weave += [spatial + first + i, 1 + i]  # (size, offset) pairs
    if channels_last:
        weave.append(1 + 2 * spatial)
    y = tf.transpose(y, weave)
    merged = cut[:1] + ([] if channels_last else [_size(y, 1)])
    for i in range(spatial):
        merged.append(_size(y, first + 2 * i) * rates[i])
    if channels_last:
        merged.append(_size(y, -1))
    return tf.reshape(y, merged)[tuple(kept)]


def _undilated(convolution: Any, kernel: str) -> Any:
    """Keras's backend `convolution` (Keras passes its arguments by
    position), a dilated one run as phases beside the batch
    (`dilated_as_phases`) instead of through TensorFlow's
    `SpaceToBatchND`, which DTensor has no rule for. Convolutions split
    only the batch (`capabilities.TABLE`), which the phases keep.
    (Before, the kernel had its holes written in as zeros: it grows to
    `(taps - 1) * rate + 1` a side, and so did the work. keras.io's
    DeepLabV3+, rates 6 to 18, took 6.2x plain Keras's time; one Conv2D
    at rate 6, 108 ms a step against plain Keras's 22.5.)"""
    signature = inspect.signature(convolution)

    def run(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        spatial = len(arguments["inputs"].shape) - 2
        rate = arguments["dilation_rate"]
        rates = (rate,) * spatial if isinstance(rate, int) else tuple(rate)
        if all(r == 1 for r in rates) or any(
                s != 1 for s in tree.flatten(arguments["strides"])):
            # Strides as well: TensorFlow's own error, as plain Keras.
            return convolution(**arguments)
        return dilated_as_phases(convolution, arguments, rates, kernel)

    return run


# The arguments of Keras's backend `conv`, which `ungrouped` is called
# with (Keras passes them by position).
_KERAS_CONV = inspect.signature(tf_nn.conv)


def ungrouped(mesh: Any, convolution: Any) -> Any:
    """Keras's backend `conv` whose kernel has fewer input channels than
    its input (`groups` > 1), on a CPU mesh, as a depthwise convolution,
    whose gradients TensorFlow's CPU kernels compute.

    Why: TensorFlow 2.21 has no CPU kernel for a grouped convolution's
    gradients ("Gradients for grouped convolutions are not supported on
    CPU"). Plain Keras compiles such a convolution with XLA
    (`_conv_xla`), which a DTensor step does not: keras.io's focal
    modulation network (a depthwise `Conv2D(groups=dim)`) and any
    ConvNeXt-like model trained as plain Keras on one device.

    How (`_grouped_as_depthwise`): each input channel through the
    kernel of each output of its group, a depthwise convolution with the
    group's outputs as its multiplier, whose gradient `depthwise` splits
    by the batch; then the products of a group's input channels summed.
    The same multiplications as the grouped convolution and one op
    whatever the number of groups (keras.io's MelGAN has 256); only the
    order of the sums differs. 3-D or channels-first: each group's slice
    through its slice of the kernel, concatenated. A GPU mesh runs
    TensorFlow's grouped op."""
    if mesh.device_type() != "CPU":
        return convolution

    def run(*args, **kwargs):
        bound = _KERAS_CONV.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        inputs = tf.convert_to_tensor(arguments["inputs"])
        kernel = tf.convert_to_tensor(arguments["kernel"])
        first = standardize_data_format(
            arguments["data_format"]) == "channels_first"
        axis = 1 if first else -1
        channels, per_group = inputs.shape[axis], kernel.shape[-2]
        if channels is None or per_group is None \
                or channels == per_group:
            return convolution(**arguments)
        groups = channels // per_group
        arguments["inputs"] = inputs
        if not first and len(inputs.shape) in (3, 4):
            return _grouped_as_depthwise(arguments, kernel, groups)
        parts = tf.split(inputs, groups, axis=axis)
        kernels = tf.split(kernel, groups, axis=-1)
        return tf.concat([
            convolution(**dict(arguments, inputs=part, kernel=weights))
            for part, weights in zip(parts, kernels)
        ], axis=axis)

    return run


def _grouped_as_depthwise(arguments: dict, kernel: Any,
                          groups: int) -> tf.Tensor:
    """`ungrouped`'s channels-last 1-D or 2-D convolution: a depthwise
    one whose kernel for input channel `g * c + j` and multiplier `m` is
    the grouped kernel's `[..., j, g * outputs + m]`, then the `c` input
    channels of each group summed."""
    taps = tuple(kernel.shape[:-2])
    per_group, filters = kernel.shape[-2], kernel.shape[-1]
    outputs = filters // groups
    rank = len(taps)
    depthwise_kernel = tf.reshape(
        tf.transpose(
            tf.reshape(kernel, taps + (per_group, groups, outputs)),
            tuple(range(rank)) + (rank + 1, rank, rank + 2)),
        taps + (groups * per_group, outputs))
    # Keras's depthwise op prepends to them as tuples.
    for name in ("strides", "dilation_rate"):
        if isinstance(arguments[name], list):
            arguments[name] = tuple(arguments[name])
    products = tf_nn.depthwise_conv(
        **dict(arguments, kernel=depthwise_kernel))
    if per_group == 1:
        return products
    # The batch as -1 and the other sizes as numbers where the trace
    # knows them: DTensor's reshape needs a shape it can read.
    spatial = [-1] + [
        size if size is not None else tf.shape(products)[index]
        for index, size in enumerate(products.shape[1:-1], start=1)]
    grouped = tf.reshape(products, spatial + [groups, per_group, outputs])
    return tf.reshape(tf.reduce_sum(grouped, axis=-2), spatial + [filters])


def computed_from_constants(x: Any, depth: int = 8) -> bool:
    """Whether graph tensor `x` comes from constants and tensor shapes
    alone (no value of an input or variable, no stateful op within
    `depth` ops): what TensorFlow's shape inference folds at trace time,
    as `ops.expand_dims(16, -1)` or a batch size from `ops.shape`."""
    op = getattr(x, "op", None)
    if op is None:
        return True  # not a graph tensor: a Python or NumPy value
    if op.type in ("Const", "Shape", "ShapeN", "Size", "Rank"):
        return True
    if depth == 0 or not op.inputs or op._is_stateful:
        return False
    return all(computed_from_constants(i, depth - 1) for i in op.inputs)


def read_from_variables(x: Any, depth: int = 4) -> bool:
    """Whether graph tensor `x` is a variable's value (read, then cast,
    copied or reshaped): a weight, whose dim 0 is not the batch (a GRU's
    bias of shape (2, 3 x units), parted by `ops.split` on axis 0)."""
    op = getattr(x, "op", None)
    if op is None:
        return isinstance(x, tf.Variable)
    if op.type in ("ReadVariableOp", "VarHandleOp"):
        return True
    if depth == 0 or op.type not in ("Identity", "Cast", "Reshape",
                                     "DTensorLayout", "Relayout"):
        return False
    return read_from_variables(op.inputs[0], depth - 1)


def _batch_data(x: Any) -> bool:
    """Whether `x` may hold a batch along dim 0: neither computed from
    constants and shapes (a shape vector) nor a weight."""
    return not computed_from_constants(x) and not read_from_variables(x)


def _static_int(x: Any) -> int | None:
    """`x` (an axis, a multiple) as a Python int, or None where it is
    known only at run time."""
    value = tf.get_static_value(x) if tf.is_tensor(x) else x
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _relaid_whole(mesh: Any, x: Any) -> tf.Tensor:
    """`x` replicated on every device of `mesh`."""
    return dtensor.relayout(x, dtensor.Layout.replicated(mesh, x.shape.rank))


def _on_batch_axis(axis: Any, rank: int | None) -> bool:
    """Whether `axis` is the batch axis of a tensor of `rank` (or may
    be: an axis known only at run time)."""
    at = _static_int(axis)
    return bool(rank) and (at is None or at % rank == 0)


def _concat_on(mesh: Any, concat: Any) -> Any:
    """TensorFlow's `tf.concat`; along the batch axis, its inputs and
    output whole.

    Why: DTensor refuses to concatenate along a split dim ("Concat op
    SPMD with concat dimension in sharded dimension is not supported",
    TF 2.21), and a GAN's own step joins its fake and real batches along
    the batch axis, by `tf.concat` (keras.io's "Customizing what happens
    in fit" guide, DCGAN) or by `keras.ops.concatenate`, which calls
    `tf.concat` too. Along another axis it runs as TensorFlow does (a
    graph's Concatenate ops get their inputs laid out per op, never
    split along the concat axis)."""

    def concatenated(values, axis, *args, **kwargs):
        if not isinstance(values, (list, tuple)) or not values:
            return concat(values, axis, *args, **kwargs)
        xs = [tf.convert_to_tensor(x) for x in values]
        if not _on_batch_axis(axis, xs[0].shape.rank) or not any(
                _batch_data(x) for x in xs):
            # Constants (a shape vector: a causal mask's tile multiples)
            # are split nowhere; relaid, they would lose the static value
            # that DTensor's Tile and Reshape rules need. Weights keep
            # their layouts.
            return concat(values, axis, *args, **kwargs)
        return _relaid_whole(mesh, concat(
            [_relaid_whole(mesh, x) for x in xs], axis, *args, **kwargs))

    return concatenated


def _split_on(mesh: Any, split: Any) -> Any:
    """TensorFlow's `tf.split` (what `keras.ops.split` calls); along the
    batch axis, its input and outputs whole.

    Why: DTensor refuses it over a split batch ("Spliting over sharded
    dimension is not supported"; uneven sizes: "requires dimension 0 to
    be divisible by sharding", measured, TF 2.21, 2 virtual CPUs): a
    step that parts a batch it joined (a prior-preservation or
    two-view loss)."""

    def parted(value, num_or_size_splits, axis=0, *args, **kwargs):
        value = tf.convert_to_tensor(value)
        if not _on_batch_axis(axis, value.shape.rank) \
                or not _batch_data(value):
            return split(value, num_or_size_splits, axis, *args, **kwargs)
        return [_relaid_whole(mesh, part) for part in split(
            _relaid_whole(mesh, value), num_or_size_splits, axis,
            *args, **kwargs)]

    return parted


def _tile_on(mesh: Any, tile: Any) -> Any:
    """TensorFlow's `tf.tile` (what `keras.ops.tile` calls); repeating
    the batch axis, its input whole (`multiples` untouched: DTensor's
    rule needs their static value).

    Why: DTensor refuses it ("tile op with input sharded at dimension
    where `multiple` > 1 is not supported", measured, TF 2.21)."""

    def tiled(value, multiples, *args, **kwargs):
        value = tf.convert_to_tensor(value)
        times = (tf.get_static_value(multiples) if tf.is_tensor(multiples)
                 else multiples)
        first = None if times is None or not len(times) else times[0]
        if not value.shape.rank or not _batch_data(value) or (
                _static_int(first) == 1):
            return tile(value, multiples, *args, **kwargs)
        # The output's layout stays DTensor's to choose: forced whole,
        # a consumer split on a batch dim of unknown size would need an
        # all-scatter DTensor cannot do ("requires slice on input axis 0
        # which is dynamic").
        return tile(_relaid_whole(mesh, value), multiples, *args, **kwargs)

    return tiled


# Stateless draws, by their name in `tf.random` (and in
# `stateless_random_ops`, which `tf.nn.experimental.stateless_dropout` and
# `tf.image.stateless_random_*` call).
_DRAWS = {
    "stateless_uniform": "stateless_random_uniform",
    "stateless_normal": "stateless_random_normal",
    "stateless_truncated_normal": "stateless_truncated_normal",
    "stateless_categorical": "stateless_categorical",
    "stateless_gamma": "stateless_random_gamma",
    "stateless_binomial": "stateless_random_binomial",
    "stateless_poisson": "stateless_random_poisson",
    "stateless_parameterized_truncated_normal":
        "stateless_parameterized_truncated_normal",
}


def replicated_draw(draw: Any, mesh: Any) -> Any:
    """`draw` (a stateless random op, or `tf.argmax`) with its output
    whole on every device of `mesh`: the values plain TensorFlow draws on
    one device."""

    def run(*args, **kwargs):
        def whole(value):
            if isinstance(value, tf.Tensor) and value.shape.rank is not None:
                return _relaid_whole(mesh, value)
            return value

        return tree.map_structure(whole, draw(*args, **kwargs))

    return run


def whole_on(mesh: Any, op: Any) -> Any:
    """`op` with its tensor inputs and outputs whole on every device of
    `mesh`.

    For `tf.math.top_k`: DTensor runs its forward on a split input, but
    its gradient (a `ScatterNd` into the input's flattened size) indexes
    the global size into each device's part (measured, keras.io's
    Switch Transformer router: "indices[599] = [5990] does not index
    into shape [1500]", its first step failed and it trained as plain
    Keras). Whole, each device computes the whole op: the routing
    decisions of a batch, small beside the experts they route to.
    """

    def whole(value):
        # a scalar (top_k's `k` as a tensor) is whole already
        if isinstance(value, tf.Tensor) and value.shape.rank:
            return _relaid_whole(mesh, value)
        return value

    def run(*args, **kwargs):
        args, kwargs = tree.map_structure(
            lambda v: whole(tf.convert_to_tensor(v))
            if isinstance(v, (tf.Tensor, tf.Variable)) else v,
            (args, kwargs))
        return tree.map_structure(whole, op(*args, **kwargs))

    return run


def _table_lookups_whole(mesh: Any, take: Any) -> Any:
    """`keras.ops.take` (Keras's backend `take`, a `tf.gather`; not the
    gathers of our own rolled RNN loops), its output whole on every device
    when its shape is fully known while the step is traced with the
    batch dim unknown: then it holds no batch (a lookup of a weight by
    indices kept in a variable or made from constants: keras.io's Swin
    Transformer takes its relative position bias from a table so).
    Why: DTensor's layout propagation gave such an output the split of
    the batch-split tensor it is later added to, on a dim the gather
    cannot split ("input and output layout do not agree on non-axis dim
    1", TF 2.21), and the layer trained whole on one device. Whole, each
    device looks up the whole (small) result, as plain Keras does. (A
    step retried with its batch dim known gathers batch lookups whole
    too: the same values, moved once more.)"""

    def lookup(x, indices, *args, **kwargs):
        out = take(x, indices, *args, **kwargs)
        if isinstance(out, tf.Tensor) and out.shape.rank \
                and out.shape.is_fully_defined():
            return _relaid_whole(mesh, out)
        return out

    return lookup


def _draw_substitutes(mesh: Any) -> list[tuple[Any, str, Any]]:
    """(module, name, replacement) for every stateless draw, and for
    `tf.argmax`/`argmin`: DTensor's ArgMax gives a split output of a
    replicated input without slicing it (measured: "SPMD expansion
    resulted in op output inconsistent with the provided layout.
    Expected shape: <128,3> got shape: <32,3>", Keras's accuracy on
    one-hot targets of integer or boolean dtype, whose argmax sees no
    cast), so its output is pinned whole as well."""
    found = [
        (module, name, replicated_draw(getattr(module, name), mesh))
        for module in (tf, tf.math) for name in ("argmax", "argmin")
    ]
    for api_name, module_name in _DRAWS.items():
        for module, name in ((tf.random, api_name),
                             (stateless_random_ops, module_name)):
            if hasattr(module, name):
                found.append((module, name,
                              replicated_draw(getattr(module, name), mesh)))
    return found


def _run_time_bound(bound: Any) -> bool:
    return isinstance(bound, (tf.Tensor, tf.Variable)) and (
        tf.get_static_value(bound) is None)


def _bound(index: Any, dim: Any) -> tf.Tensor:
    """A Python slice bound as a position in [0, dim] (negative from the
    end, clamped past either end, as Python and `StridedSlice` read it)."""
    index = tf.cast(index, tf.int32)
    return tf.clip_by_value(tf.where(index < 0, index + dim, index), 0, dim)


def _static_length(part: slice) -> int | None:
    """`n` for a slice `start:start + n` (its stop an addition of its
    start and a constant), else None."""
    start, stop = part.start, part.stop
    op = getattr(stop, "op", None)
    if not isinstance(start, tf.Tensor) or op is None \
            or op.type not in ("AddV2", "Add"):
        return None
    for this, other in (op.inputs, op.inputs[::-1]):
        if this.name == start.name:
            value = tf.get_static_value(other)
            if value is not None and int(value) >= 0:
                return int(value)
    return None


def plain_slice(tensor: Any, spec: Any) -> Any:
    """`tensor[spec]` as a `tf.slice` of constant size, or else as
    gathers of position ranges, when `spec` holds only step-1 slices (and
    at most one `...`) and some bound is a run-time tensor; None for any
    other indexing (left to TensorFlow's own). DTensor's rule for `Slice`
    needs its size constant ("failed to extract constant"; `h + 32 - h`
    is not, so `_static_length` reads it off the stop)."""
    spec = spec if isinstance(spec, tuple) else (spec,)
    rank = tensor.shape.rank
    plain = all(part is Ellipsis or (
        isinstance(part, slice) and part.step in (None, 1)) for part in spec)
    if rank is None or not plain or sum(p is Ellipsis for p in spec) > 1:
        return None
    if not any(_run_time_bound(bound) for part in spec
               if isinstance(part, slice)
               for bound in (part.start, part.stop)):
        return None
    spec = _written_out(spec, rank)
    if spec is None:
        return None
    shape = tf.shape(tensor, out_type=tf.int32)
    bounds = []
    for dim, part in enumerate(spec):
        if part.start is None and part.stop is None:
            # The whole dim: its size where known (with -1 the output
            # dim is unknown, and DTensor cannot split an unknown dim).
            known = tensor.shape[dim]
            bounds.append((0, -1 if known is None else int(known)))
            continue
        start = 0 if part.start is None else _bound(part.start, shape[dim])
        length = _static_length(part)
        if length is None:
            stop = shape[dim] if part.stop is None else _bound(
                part.stop, shape[dim])
            length = tf.maximum(stop - start, 0)
        bounds.append((start, length))
    if all(isinstance(length, int) for _, length in bounds):
        # A bound past the end fails loudly here (Python would shorten
        # the slice).
        return tf.slice(tensor, tf.stack([b for b, _ in bounds]),
                        [length for _, length in bounds])
    for dim, (part, (start, length)) in enumerate(zip(spec, bounds)):
        if part.start is not None or part.stop is not None:
            tensor = tf.gather(tensor, tf.range(start, start + length),
                               axis=dim)
    return tensor


def _names_a_dim(part: Any) -> bool:
    """Whether `part` of an index takes one dim: a slice or a scalar."""
    if isinstance(part, (slice, int, np.integer)):
        return True
    return (isinstance(part, (tf.Tensor, tf.Variable))
            and part.shape.rank == 0)


def _written_out(parts: tuple, rank: int) -> tuple | None:
    """`parts` of an index (at most one `...`) with the dims of a
    rank-`rank` tensor it leaves implicit, at its `...` or after its last
    entry, written as `:`; None when it names more dims than there are."""
    implicit = rank - sum(_names_a_dim(part) for part in parts)
    if implicit < 0:
        return None
    whole = (slice(None),) * implicit
    for at, part in enumerate(parts):
        if part is Ellipsis:
            return parts[:at] + whole + parts[at + 1:]
    return parts + whole


def every_dim_named(tensor: Any, spec: Any) -> Any:
    """`spec`, when it inserts axes (`None`, `tf.newaxis`), with the dims
    it leaves implicit (an `...`, or dims after its last entry) written
    out as `:`: the same slice. Other specs are returned as they are.

    Why: DTensor's rule for a `StridedSlice` that inserts an axis crashes
    the process (a segmentation fault, no Python error) when the index
    does not name every dim, split or replicated, forward or backward
    (measured, TF 2.21, 2 virtual CPUs: `t[None]`, `t[:, tf.newaxis]`,
    `t[None, ...]`, `t[:, None, ...]` and `t[:, :, None]` on a rank-3
    tensor), while the same slices with every dim named run: a user's
    layer computing `t[:, tf.newaxis]` took the probe down with it.
    """
    parts = spec if isinstance(spec, tuple) else (spec,)
    rank = getattr(tensor.shape, "rank", None)
    if rank is None or not any(part is None for part in parts):
        return spec
    if sum(part is Ellipsis for part in parts) > 1 or not all(
            part is None or part is Ellipsis or _names_a_dim(part)
            for part in parts):
        return spec
    written = _written_out(parts, rank)
    # None: it names more dims than there are; TensorFlow's error says so.
    return spec if written is None else written


def _sliced_plainly(getitem: Any) -> Any:
    def sliced(tensor, spec):
        spec = every_dim_named(tensor, spec)
        result = plain_slice(tensor, spec)
        return getitem(tensor, spec) if result is None else result

    return sliced


def explicit_einsum(equation: str, operands: Any) -> str:
    """`equation` with its `...` written as letters, where every operand
    with a `...` gives it the same dims (as far as they are known); else
    `equation` as it is.

    Why: DTensor refuses any einsum whose equation holds `...`
    ("Broadcasting is unimplemented for einsum", measured, TF 2.21,
    split or replicated, even when nothing broadcasts): a user's layer
    computing `tf.einsum("...ij,...kj->...ik", q, k)` trained as plain
    Keras. The same product with letters for those dims runs.
    """
    if not isinstance(equation, str) or "..." not in equation \
            or "->" not in equation:
        return equation
    inputs, output = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    if len(terms) != len(operands):
        return equation
    shapes = []
    for term, operand in zip(terms, operands):
        if "..." not in term:
            continue
        shape = getattr(operand, "shape", None)
        rank = getattr(shape, "rank", None)
        if rank is None:
            return equation
        named = len(term) - 3
        at = term.index("...")
        shapes.append(tuple(shape[at:at + rank - named]))
    if not shapes or any(len(s) != len(shapes[0]) for s in shapes):
        return equation
    for dims in zip(*shapes):  # a dim of 1 against another broadcasts
        if len({d for d in dims if d is not None}) > 1:
            return equation
    free = [c for c in string.ascii_letters if c not in equation]
    if len(free) < len(shapes[0]):
        return equation
    letters = "".join(free[:len(shapes[0])])
    return equation.replace(" ", "").replace("...", letters)


def _explicit(einsum: Any) -> Any:
    """TensorFlow's `Einsum` op (`gen_linalg_ops.einsum(inputs,
    equation)`: what `tf.einsum`, `keras.ops.einsum` and the einsum
    gradient, which writes `...` itself, all make) with `...` written
    out (`explicit_einsum`)."""

    def run(inputs, equation, *args, **kwargs):
        return einsum(inputs, explicit_einsum(equation, inputs), *args,
                      **kwargs)

    return run


def _int32_scatter(scatter_nd: Any) -> Any:
    """`scatter_nd` with int64 indices (and shape) taken as int32.

    Why: DTensor expands a `ScatterNd` with int64 indices with an int32
    constant for its shape and fails ("input shape[0] expected type
    int64 != int32", measured, TF 2.21, split or replicated), while the
    same op with int32 indices runs. Keras's confusion matrix scatters
    int64 indices (`BinaryIoU`, `MeanIoU`: such a model trained as
    plain Keras from its first step), and so does the gradient of a
    `gather_nd` with int64 indices. A position past int32 would need a
    tensor of 2**31 elements along one dim."""

    def scatter(indices, updates, shape, *args, **kwargs):
        indices = tf.convert_to_tensor(indices)
        if indices.dtype == tf.int64:
            indices = tf.cast(indices, tf.int32)
            if isinstance(shape, (tf.Tensor, tf.Variable)):
                shape = tf.cast(shape, tf.int32)
        return scatter_nd(indices, updates, shape, *args, **kwargs)

    return scatter


def _distinct_operands(mat_mul: Any) -> Any:
    """`mat_mul`, with one tensor passed as both operands made two.

    Why: DTensor lays out a MatMul of a tensor with itself inconsistently
    when the tensor is split on its rows: the similarity matrix
    `f @ f^T` of a contrastive loss (keras.io's semantic image
    clustering) failed with "SPMD expansion resulted in op output
    inconsistent with the provided layout. Expected shape: <16,32> got
    shape: <32,32>" (measured, TF 2.21, 2 virtual CPUs), while the same
    product of `f` and `tf.identity(f)` runs. The identity costs
    nothing; the values are the same."""

    def distinct(a, b, *args, **kwargs):
        if a is b:
            b = tf.identity(b)
        return mat_mul(a, b, *args, **kwargs)

    return distinct


@contextlib.contextmanager
def substitutes(mesh: Any) -> Iterator[None]:
    """While a DTensor step on `mesh` is traced: Keras ops built from
    ops that DTensor has rules for, and random draws that equal plain
    TensorFlow's."""
    saved = _draw_substitutes(mesh) + [
        (tf_numpy, "flip", flip_by_gather),
        # `keras.ops.roll` calls `tf.roll`, as a user's own layer may.
        (tf, "roll", roll_by_slices(mesh, tf.roll)),
        # In a user's step, and through `keras.ops`: along the batch.
        (tf, "concat", _concat_on(mesh, tf.concat)),
        (tf, "split", _split_on(mesh, tf.split)),
        (tf, "tile", _tile_on(mesh, tf.tile)),
        (tf_nn, "conv", ungrouped(mesh, _undilated(tf_nn.conv, "kernel"))),
        (tf_nn, "depthwise_conv", _undilated(tf_nn.depthwise_conv,
                                             "kernel")),
        (tf_nn, "separable_conv", _undilated(tf_nn.separable_conv,
                                             "depthwise_kernel")),
        # Keras's backend (and a user's layer) call these through `tf.nn`.
        (tf.nn, "depthwise_conv2d", depthwise.depthwise_conv2d),
        (tf.nn, "separable_conv2d", depthwise.separable_conv2d),
        (tf_numpy, "take", _table_lookups_whole(mesh, tf_numpy.take)),
        (tf.math, "top_k", whole_on(mesh, tf.math.top_k)),
        (tf.nn, "top_k", whole_on(mesh, tf.nn.top_k)),
        # `tf.sort` and `tf.argsort` (`keras.ops.sort/argsort`) call it
        # as `nn_ops.top_k`.
        (nn_ops, "top_k", whole_on(mesh, nn_ops.top_k)),
        (tensor_lib.Tensor, "__getitem__",
         _sliced_plainly(tensor_lib.Tensor.__getitem__)),
        (gen_linalg_ops, "einsum", _explicit(gen_linalg_ops.einsum)),
        # Keras's `ops.scatter` calls `tf.scatter_nd`; TensorFlow's
        # gradients and confusion matrix, `array_ops.scatter_nd`.
        (tf, "scatter_nd", _int32_scatter(tf.scatter_nd)),
        (array_ops, "scatter_nd", _int32_scatter(array_ops.scatter_nd)),
        # Every 2-D matmul (`tf.matmul`, `@`, `keras.ops.matmul`).
        (gen_math_ops, "mat_mul", _distinct_operands(gen_math_ops.mat_mul)),
    ]
    saved = [(module, name, getattr(module, name), new)
             for module, name, new in saved]
    for module, name, _, new in saved:
        setattr(module, name, new)
    try:
        yield
    finally:
        for module, name, old, _ in saved:
            setattr(module, name, old)


def int32_indices(operation: Any, args: tuple, kwargs: dict) -> tuple:
    """An Embedding's int64 indices as int32 (same rows), while a step is
    traced.

    Why: Keras's sparse optimizer update of the table's IndexedSlices
    gradient (Adagrad, RMSprop, Adadelta, Adafactor: `capabilities.
    SPARSE_UPDATE_OPTIMIZERS`) builds a ScatterNd whose shape is int32
    beside the int64 indices, which DTensor's MLIR import refuses ("input
    shape[0] expected type int64 != int32 ... adagrad/cond/ScatterNd";
    measured, TF 2.21, even under data parallelism). A StringLookup's
    result is int64: keras.io's movielens transformer met it. Applied to
    every Embedding call while a step is traced, an op's or one inside a
    layer of the user's (keras.io's English-Spanish Transformer: token
    ids into a positional embedding, RMSprop).
    """
    if type(operation).__name__ != "Embedding" or not args \
            or getattr(operation, "input_dim", 2**31) >= 2**31:
        return args, kwargs
    ids = args[0]
    if isinstance(ids, tf.Tensor) and ids.dtype == tf.int64:
        args = (tf.cast(ids, tf.int32),) + tuple(args[1:])
    return args, kwargs


def splits_inner_dims(layout: Any) -> bool:
    """Whether `layout` splits a dim between the first and the last (a
    sequence, a height): what `tf.tensordot` loses (`inner_splits_kept`)."""
    specs = layout.sharding_specs
    return any(spec != dtensor.UNSHARDED for spec in specs[1:-1])


def einsum_matmul(x1: Any, x2: Any) -> tf.Tensor:
    """`keras.ops.matmul` of a dense tensor of rank 3 or more by a matrix
    (a `Dense` layer on a sequence) as `tf.einsum`, in Keras's dtypes:
    each output element is the same sum of products as Keras's
    `tf.tensordot` computes (up to the order of float sums)."""
    from keras.src.backend.common import dtypes

    x1, x2 = tf.convert_to_tensor(x1), tf.convert_to_tensor(x2)
    compute = dtypes.result_type(x1.dtype, x2.dtype, float)
    result = dtypes.result_type(x1.dtype, x2.dtype)
    lead = "abcdefghijklmnopqrstuvw"[: x1.shape.rank - 1]
    out = tf.einsum(f"{lead}y,yz->{lead}z", tf.cast(x1, compute),
                    tf.cast(x2, compute))
    return tf.cast(out, result)


def _einsum_applies(x1: Any, x2: Any) -> bool:
    if isinstance(x1, tf.SparseTensor) or isinstance(x2, tf.SparseTensor):
        return False
    # Tensors, variables and NumPy arrays alike (a tuple shape has no rank).
    rank1, rank2 = (tf.TensorShape(getattr(x, "shape", None)).rank
                    for x in (x1, x2))
    if rank1 is None or not 3 <= rank1 <= 24 or rank2 != 2:
        return False
    from keras.src.backend.common import dtypes

    kinds = {dtypes.standardize_dtype(x.dtype) for x in (x1, x2)}
    return kinds != {"int8"}  # Keras's int8 path keeps its int32 output


@contextlib.contextmanager
def inner_splits_kept(active: bool) -> Iterator[None]:
    """While a layer whose input is split on an inner dim
    (`splits_inner_dims`) is traced, with `active`: `keras.ops.matmul`
    of a tensor of rank 3 or more by a matrix runs as `einsum_matmul`.
    Why: Keras's TensorFlow backend runs it as `tf.tensordot`, which
    merges the leading dims into one; DTensor cannot keep a split of a
    dim merged after the first, so it gathered the whole input and
    computed the whole product on every device (measured, 4 virtual
    CPUs: Dense 64->128 on (32, 32, 64) split on the sequence, forward
    and backward 4.0 ms with a replicated output; as an einsum 1.9 ms,
    the sequence split kept). Only then: with the batch split alone the
    einsum ran slower on CPU (2.2 vs 1.4 ms) and the tensordot keeps the
    split."""
    if not active:
        yield
        return
    keras_matmul = tf_numpy.matmul

    def matmul(x1: Any, x2: Any) -> Any:
        if _einsum_applies(x1, x2):
            return einsum_matmul(x1, x2)
        return keras_matmul(x1, x2)

    tf_numpy.matmul = matmul
    try:
        yield
    finally:
        tf_numpy.matmul = keras_matmul

