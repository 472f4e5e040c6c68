"""What TensorFlow's DTensor can run of each layer type: the one table.

The search may only propose what the runtime can execute, and a split
that DTensor refuses would surface half-way through `fit()`. So every
fact about what DTensor runs of a layer type lives here, in `TABLE`:

- `splits`: which output dims a strategy may split, as SOAP kinds
  (`sample`, `attribute`, `parameter`), and which axis of each weight a
  parameter split shards. Dim 0 is always `sample`.
- `inputs`: how each input follows a split output (`partition.py` and
  the runtime's input layouts read it): `MATCHING` (an input dim of the
  output's size and position is split alike), `CHANNELWISE` (also the
  channel dim of a parameter split: BatchNormalization), `FIRST_INPUT`
  (only input 0 follows attribute splits: attention's key/value stay
  whole), `PREFIX` (the input is the output without its last dim:
  Embedding's indices).
- `replicated_ops`: TensorFlow ops of its forward or backward that
  DTensor has no layout rule for; they run replicated through DTensor's
  per-op switch (`runtime/op_rules.enable`). A layer that needs one
  declares no split at all: the search gives it an unsplit config, which
  a one-mesh runtime runs replicated on the mesh (every device computes
  it whole), and the simulator prices it whole (on the live machine,
  with every device's copy of the work where devices share compute).
- `error`: why DTensor cannot run the type at all (the lookup layers:
  their hash-table ops crash it, `crashing_ops`); a model with one
  trains as plain Keras, with one warning naming it (`apply_probes`).
- `host`: the type runs on the host, before each step, when it takes
  the model's own inputs (`keras_graph.hosted_nodes`: a lookup on a raw
  feature, the usual place); its result goes into the step as one more
  input. Elsewhere its `error` holds.

Measured on TF 2.21, CPU, and checked by tests: every declared split
runs forward and backward on DTensor and equals the unsplit op
(`tests/test_graph.py`), and a probe in a fresh process finds exactly
the listed replicated ops (`tests/test_capabilities.py`).

A layer type the table does not list (a custom layer, a Keras layer not
measured here) is probed once on the attached devices before the search
(`runtime/probe.py`, cached on disk); `Probed` is what that finds and
`apply_probes` turns it into the ops' splits.

Why these splits (measured): convolutions split the batch only (DTensor
needs a replicated filter and has no halo exchange off TPU); non-global
pooling the batch only; global pooling may split channels; Dense,
Embedding, BatchNormalization their output channels (parameter);
Dense, LayerNormalization, Embedding, attention queries, elementwise ops,
softmax and concatenation off their axes split sequence dims
(attribute); RNNs, reshapes, unknown ops and ops with several outputs the
batch only; an output without the batch dim nothing.
"""

import dataclasses
import inspect
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

ATTRIBUTE = "attribute"
PARAMETER = "parameter"
SAMPLE = "sample"

Shape = tuple[int, ...]
Shapes = tuple[Shape, ...]

MATCHING = "matching"
CHANNELWISE = "channelwise"
FIRST_INPUT = "first_input"
PREFIX = "prefix"


class LayerCall(NamedTuple):
    """What a rule sees of one layer call: the layer, its input and
    output shapes (batch included), and Keras's `SymbolicArguments`."""

    layer: Any
    ins: Shapes
    outs: Shapes
    arguments: Any


class Splits(NamedTuple):
    """Output dim -> SOAP kind; weight path -> axis a parameter split
    shards (absent: replicated)."""

    kinds: Mapping[int, str]
    weight_axes: Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class Capability:
    """What DTensor runs of one layer type (see the module docstring).

    `error` says why DTensor cannot run the type at all, not even
    replicated (None: it runs); a model with it trains as plain Keras.
    `host`: a call of it on the model's inputs runs on the host instead.
    """

    splits: Callable[[LayerCall], Splits]
    inputs: str = MATCHING
    replicated_ops: tuple[str, ...] = ()
    error: str | None = None
    host: bool = False


class Unsupported(Exception):
    """A layer DTensor cannot run even replicated: the model trains as
    plain Keras, decided before the search."""


# --- split rules -----------------------------------------------------------


def dims(
    rank: int, attribute: Iterable[int] = (), parameter: int | None = None
) -> dict[int, str]:
    """Sample dim 0, `attribute` dims (inside the rank, not 0), and the
    `parameter` dim."""
    kinds = {0: SAMPLE}
    kinds.update({d: ATTRIBUTE for d in attribute if 0 < d < rank})
    if parameter is not None:
        kinds[parameter] = PARAMETER
    return kinds


def _axes_by_name(layer: Any, **axis_of: int) -> dict[str, int]:
    """Shard axes keyed by variable path, found by variable name."""
    return {
        v.path: axis_of[v.name]
        for v in getattr(layer, "weights", ())
        if v.name in axis_of
    }


def sample_only(call: LayerCall) -> Splits:
    """Convolutions, pooling, RNNs, reshapes, unknown ops."""
    return Splits(dims(len(call.outs[0])), {})


def _replicated(call: LayerCall) -> Splits:
    return Splits({}, {})


def _elementwise(call: LayerCall) -> Splits:
    out = call.outs[0]
    return Splits(dims(len(out), range(1, len(out))), {})


def _dense(call: LayerCall) -> Splits:
    rank = len(call.outs[0])
    return Splits(
        dims(rank, range(1, rank - 1), rank - 1),
        _axes_by_name(call.layer, kernel=1, bias=0),
    )


def _embedding(call: LayerCall) -> Splits:
    rank = len(call.outs[0])
    return Splits(
        dims(rank, range(1, rank - 1), rank - 1),
        _axes_by_name(call.layer, embeddings=1),
    )


def _global_pooling(call: LayerCall) -> Splits:
    out = call.outs[0]
    channels_last = call.layer.data_format == "channels_last"
    return Splits(dims(len(out), (len(out) - 1 if channels_last else 1,)), {})


def _batch_norm(call: LayerCall) -> Splits:
    layer, rank = call.layer, len(call.outs[0])
    if layer.axis % rank != rank - 1:
        return sample_only(call)
    # Every BN variable (gamma, beta, moving stats, renorm) is per channel.
    axes = {v.path: 0 for v in layer.weights if len(v.shape) == 1}
    return Splits(dims(rank, parameter=rank - 1), axes)


def _layer_norm(call: LayerCall) -> Splits:
    layer, rank = call.layer, len(call.outs[0])
    axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    normalized = {a % rank for a in axis}
    middle = [d for d in range(1, rank - 1) if d not in normalized]
    return Splits(dims(rank, middle), {})


def _attention(call: LayerCall) -> Splits:
    return Splits(dims(len(call.outs[0]), (1,)), {})


def softmax_dims(axis: Any, out: Shape) -> dict[int, str]:
    """Every dim but the normalized ones (none when `axis` is None)."""
    if axis is None:
        return {}  # normalizes over every dim, batch included
    axes = axis if isinstance(axis, (list, tuple)) else (axis,)
    skip = {a % len(out) for a in axes}
    return dims(len(out), [d for d in range(1, len(out)) if d not in skip])


def _softmax(call: LayerCall) -> Splits:
    return Splits(softmax_dims(call.layer.axis, call.outs[0]), {})


def _activation(call: LayerCall) -> Splits:
    fn = getattr(call.layer, "activation", None)
    if getattr(fn, "__name__", "") in ("softmax", "log_softmax"):
        return Splits(softmax_dims(-1, call.outs[0]), {})
    return _elementwise(call)


def _binary(call: LayerCall) -> Splits:
    """Merge layers and the same-named binary `keras.ops`; `ops.average`
    (a reduction, not a merge) splits the batch only."""
    from keras.src.layers.layer import Layer

    if not isinstance(call.layer, Layer) and type(call.layer).__name__ \
            not in BINARY_OPS:
        return sample_only(call)
    return _elementwise(call)


def _concatenate(call: LayerCall) -> Splits:
    out = call.outs[0]
    axis = call.layer.axis % len(out)
    return Splits(
        dims(len(out), [d for d in range(1, len(out)) if d != axis]), {}
    )


BINARY_OPS = (
    "Add", "Subtract", "Multiply", "Divide", "TrueDivide", "Maximum",
    "Minimum",
)

_UNLAID_AUGMENTATION = (
    "TensorFlow's DTensor cannot lay out its ops (a slice or reshape of "
    "a tensor whose size is known only at run time), even replicated; "
    "augment in the tf.data pipeline"
)

# Weightless shape and dtype ops that run on the host with the lookups
# they feed (`keras_graph.hosted_nodes`): `StringLookup()(ops.expand_dims(
# raw))` as keras.io's wide-and-deep script writes it. (Keras's weightless
# preprocessing layers may feed them too: `keras_graph._host_feeder`.)
HOST_FEEDERS = frozenset({
    "ExpandDims", "Squeeze", "Reshape", "Cast", "Identity",
    "ConvertToTensor", "Flatten",
})

# TensorFlow ops that crash the process under DTensor (measured, TF 2.21:
# a segmentation fault), so nothing runs them there; `crashing_ops`
# finds them in a traced graph. Python inside the graph crashes DTensor
# outright. An op on a lookup table (StringLookup, IntegerLookup,
# TextVectorization, `tf.lookup`) raises "does not implement layout
# propagation" without its replicated switch and crashes with it
# (measured: LookupTableFindV2 and LookupTableSizeV2, static and mutable
# tables); every `LookupTable*` op takes the same table resource, so all
# are refused.
CRASH_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
CRASH_OP_PREFIXES = ("LookupTable",)


def crashing_ops(op_types: Iterable[str]) -> tuple[str, ...]:
    """The op types in `op_types` that crash DTensor (`CRASH_OPS`)."""
    return tuple(sorted(
        t for t in set(op_types)
        if t in CRASH_OPS or t.startswith(CRASH_OP_PREFIXES)
    ))


def crash_reason(crashing: Iterable[str]) -> str:
    """Why a layer running `crashing` (`crashing_ops`) cannot run on
    DTensor, in words for the plain-Keras warning."""
    crashing = sorted(crashing)
    names = ", ".join(crashing)
    if any(t.startswith(CRASH_OP_PREFIXES) for t in crashing):
        return (
            f"it looks values up in a hash table ({names}: tf.lookup, "
            "StringLookup, IntegerLookup), which crashes TensorFlow's "
            "DTensor even replicated; do the lookup in the tf.data "
            "pipeline (dataset.map) and feed the model the indices"
        )
    return (
        f"it runs Python inside the graph ({names}: tf.numpy_function / "
        "tf.py_function), which DTensor cannot run; write it with "
        "TensorFlow or keras.ops"
    )


# TensorFlow ops DTensor has no rule for, by the layers that emit them.
_AVG_POOL_GRAD = {1: "AvgPoolGrad", 2: "AvgPoolGrad", 3: "AvgPool3DGrad"}


def _table() -> dict[str, Capability]:
    sample = Capability(sample_only)
    elementwise = Capability(_elementwise)

    def replicated(*ops: str) -> Capability:
        return Capability(_replicated, replicated_ops=ops)

    def cannot_run(why: str) -> Capability:
        return Capability(_replicated, error=why)

    def on_host(why: str) -> Capability:
        return Capability(_replicated, error=(
            f"{why}. It runs on the host before each step instead only "
            "where it takes the model's own inputs (`keras.Input`s, "
            "reshaped or cast at most) and its result is not a model "
            "output"
        ), host=True)

    table = {
        "Dense": Capability(_dense),
        "EinsumDense": sample,
        "Embedding": Capability(_embedding, PREFIX),
        "BatchNormalization": Capability(_batch_norm, CHANNELWISE),
        "LayerNormalization": Capability(_layer_norm),
        "MultiHeadAttention": Capability(_attention, FIRST_INPUT),
        "Softmax": Capability(_softmax),
        "LogSoftmax": Capability(_softmax),
        "Dropout": elementwise,
        "Concatenate": Capability(_concatenate),
        "Matmul": sample,
        # Keras unrolls or flips these while a step is traced
        # (runtime/unroll.py, op_rules.flip_by_gather).
        "Bidirectional": sample,
        # Their image transform has no rule, nor (when a layer before
        # them trains) the matrix inverse of its gradient.
        **{
            f"Random{kind}": replicated(
                "ImageProjectiveTransformV3", "MatrixInverse"
            )
            for kind in ("Rotation", "Zoom", "Translation", "Shear")
        },
        # Preprocessing layers. Normalization's mean and variance are
        # plain tensors the runtime replicates (`layer_constants`).
        "Normalization": sample,
        "Discretization": replicated("Bucketize"),
        # multi_hot and count (one_hot needs none).
        "CategoryEncoding": replicated("DenseBincount"),
        # Integer inputs (string inputs need none).
        "Hashing": replicated("AsString"),
        "StringLookup": on_host(crash_reason(["LookupTableFindV2"])),
        "IntegerLookup": on_host(crash_reason(["LookupTableFindV2"])),
        "TextVectorization": on_host(crash_reason(["LookupTableFindV2"])),
        # Random augmentations whose TensorFlow code DTensor cannot lay
        # out even replicated (measured, TF 2.21): a StridedSlice of a
        # tensor of unknown length (Equalization's, inside both), a
        # Reshape to a shape known only at run time, a Gamma draw.
        "RandAugment": on_host(_UNLAID_AUGMENTATION),
        "AugMix": on_host(_UNLAID_AUGMENTATION),
        "RandomElasticTransform": on_host(_UNLAID_AUGMENTATION),
        # SparseCross has no rule, and even with its switch on
        # SparseToDense has no layout for its result.
        "HashedCrossing": on_host(
            "its SparseCross / SparseToDense have no DTensor layout even "
            "replicated; cross the features in the tf.data pipeline"
        ),
    }
    for n in (1, 2, 3):
        table[f"Conv{n}D"] = sample
        table[f"Conv{n}DTranspose"] = sample
        table[f"MaxPooling{n}D"] = sample
        table[f"AveragePooling{n}D"] = replicated(_AVG_POOL_GRAD[n])
        table[f"GlobalMaxPooling{n}D"] = Capability(_global_pooling)
        table[f"GlobalAveragePooling{n}D"] = Capability(_global_pooling)
        table[f"ZeroPadding{n}D"] = sample
        table[f"Cropping{n}D"] = sample
        table[f"UpSampling{n}D"] = sample
    for n in (1, 2):
        # Their gradients have no DTensor rule; the runtime writes them
        # with ops that have one (`runtime/depthwise.py`).
        table[f"DepthwiseConv{n}D"] = sample
        table[f"SeparableConv{n}D"] = sample
    for name in ("SimpleRNN", "GRU", "LSTM"):
        table[name] = sample
    for name in (*BINARY_OPS, "Average"):
        table[name] = Capability(_binary)
    for name in (
        "Activation ReLU LeakyReLU ELU Relu Relu6 Sigmoid Tanh Exp "
        "Log Sqrt Square Abs Absolute Negative Gelu Silu Softplus Softsign "
        "Elu Selu LeakyRelu HardSigmoid HardSilu"
    ).split():
        table[name] = Capability(_activation)
    table["PReLU"] = sample  # its alpha is shaped like a sample
    for name in (
        "Reshape Flatten Permute RepeatVector Identity ExpandDims Squeeze "
        "GetItem Cast Rescaling GaussianNoise GaussianDropout "
        "SpatialDropout1D SpatialDropout2D SpatialDropout3D"
    ).split():
        table[name] = sample
    return table


TABLE: Mapping[str, Capability] = _table()
DEFAULT = Capability(sample_only)


def listed(layer: Any) -> Capability | None:
    """The table's entry for `layer`, None for a type it does not list
    (a custom class, even one named like a Keras layer)."""
    cls = type(layer)
    if not cls.__module__.startswith("keras."):
        return None
    return TABLE.get(cls.__name__)


def of_type(op_type: str) -> Capability:
    """The entry for a Keras type name (the default for others)."""
    return TABLE.get(op_type, DEFAULT)


def argument_index(arguments: Any, position: int, name: str) -> int | None:
    """Which of a call's input tensors (`arguments.keras_tensors`, an
    op's inputs: Keras's flattening order, args then kwargs by sorted
    name, every occurrence counted) is its argument at `position` or
    keyword `name`; None when that argument is not one tensor. By
    argument, not by tensor: in `mha(x, x)` the query is input 0 and the
    value input 1, though both are `x`."""
    import keras

    count = iter(range(len(arguments.keras_tensors)))
    args, kwargs = arguments.convert(
        lambda x: next(count) if isinstance(x, keras.KerasTensor) else None
    )
    index = args[position] if len(args) > position else kwargs.get(name)
    return index if isinstance(index, int) else None


_FIRST_INPUTS: "weakref.WeakKeyDictionary[Any, int]" = (
    weakref.WeakKeyDictionary()
)


def first_input(op: Any) -> int:
    """The input of `op` that a `FIRST_INPUT` layer's attribute splits
    follow: its call's first argument (attention's query), wherever
    Keras put it among the inputs (`mha(query=q, value=v, key=k)` lists
    the key first); input 0 for an op without call arguments. Kept per
    op (it never changes; the simulator asks per part of every edge)."""
    index = _FIRST_INPUTS.get(op)
    if index is None:
        index = _FIRST_INPUTS[op] = _first_input(op)
    return index


def _first_input(op: Any) -> int:
    if op.arguments is None or op.layer is None:
        return 0
    try:
        first = next(iter(inspect.signature(op.layer.call).parameters))
    except (StopIteration, TypeError, ValueError):
        return 0
    index = argument_index(op.arguments, 0, first)
    return 0 if index is None else index


def replicated_ops() -> frozenset[str]:
    """Every TensorFlow op the table runs replicated."""
    return frozenset(op for c in TABLE.values() for op in c.replicated_ops)


def splits(
    layer: Any, ins: Shapes, outs: Shapes, arguments: Any = None
) -> Splits:
    """What a strategy may split of one call of `layer` (the table's rule,
    the default for unlisted types), restricted to what is valid
    whatever the rule said."""
    call = LayerCall(layer, ins, outs, arguments)
    capability = listed(layer) or DEFAULT
    if not outs or not outs[0]:
        return Splits({}, {})
    return _restrict(capability.splits(call), call)


def _restrict(found: Splits, call: LayerCall) -> Splits:
    """Several outputs cannot all follow one `dims` (sample only), and
    an output without the batch dim (a reduction over the batch, a
    scalar) must not be split as if it had one."""
    kinds, axes = dict(found.kinds), dict(found.weight_axes)
    if len(call.outs) != 1:
        kinds = {0: SAMPLE} if 0 in kinds else {}
        axes = {}
    if not _has_batch_dim(call):
        kinds, axes = {}, {}
    return Splits(kinds, axes)


def _has_batch_dim(call: LayerCall) -> bool:
    """Whether output 0 starts with the batch dim of the inputs."""
    ins, outs = call.ins, call.outs
    tensors = getattr(call.arguments, "keras_tensors", None)
    if tensors is not None and len(tensors) == len(ins):
        batches = {
            shape[0]
            for kt, shape in zip(tensors, ins)
            if kt.shape and kt.shape[0] is None
        }
    else:
        batches = {shape[0] for shape in ins if shape}
    return not batches or outs[0][0] in batches


# --- what a probe finds (runtime/probe.py) ----------------------------------


@dataclasses.dataclass(frozen=True)
class Probed:
    """What running one unlisted layer on DTensor found.

    Args:
        replicated_ops: TensorFlow ops that needed DTensor's replicated
            switch.
        error: Why it does not run even so (None: it runs).
        splits_batch: False when it ran only with its inputs replicated.
            A layer that needs replicated ops or inputs declares no
            split, like the table's replicated entries.
    """

    replicated_ops: tuple[str, ...] = ()
    error: str | None = None
    splits_batch: bool = True

    @property
    def replicated(self) -> bool:
        return bool(self.replicated_ops) or not self.splits_batch

    def to_json(self) -> dict:
        return {"replicated_ops": list(self.replicated_ops),
                "error": self.error, "splits_batch": self.splits_batch}

    @classmethod
    def from_json(cls, data: Mapping) -> "Probed":
        return cls(
            tuple(data.get("replicated_ops", ())), data.get("error"),
            bool(data.get("splits_batch", True)),
        )


# Optimizers whose update keeps an Embedding's IndexedSlices gradient
# sparse (Keras's elementwise ops on IndexedSlices: `ops.square` in
# Adagrad, RMSprop, Adadelta, Adafactor). With the table split on its
# columns DTensor's first step fails ("SPMD expansion resulted in op
# output inconsistent with the provided layout"; measured, TF 2.21:
# `Embedding(20, 12)` split 4 ways, then `Dense(1)`; keras.io's movielens
# transformer); with the table whole it runs. SGD, Adam, AdamW, Nadam,
# Adamax, Lion and Ftrl densify the gradient and run with it split.
SPARSE_UPDATE_OPTIMIZERS = frozenset({
    "Adagrad", "RMSprop", "Adadelta", "Adafactor",
})


def for_optimizer(graph: Any, optimizer: Any) -> Any:
    """`graph` without the Embedding table splits (Parameter) that
    `optimizer` cannot run (`SPARSE_UPDATE_OPTIMIZERS`); unchanged for
    other optimizers."""
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    sparse = any(
        cls.__name__ in SPARSE_UPDATE_OPTIMIZERS
        and cls.__module__.startswith("keras.")
        for cls in type(inner).__mro__
    )
    if not sparse:
        return graph
    ops = tuple(
        dataclasses.replace(op, partitionable={
            d: k for d, k in op.partitionable.items() if k != PARAMETER
        }) if op.type == "Embedding" else op
        for op in graph
    )
    return type(graph)(
        ops, graph.tensors, graph.inputs, graph.outputs, graph.batch_size
    )


def cannot_run(graph: Any) -> dict[str, str]:
    """Op name -> why DTensor cannot run it, for the ops of `graph` whose
    layer type the table lists as such (`Capability.error`)."""
    found = {}
    for op in graph:
        capability = listed(op.layer) if op.layer is not None else None
        if capability is not None and capability.error:
            found[op.name] = capability.error
    return found


def apply_probes(graph: Any, probed: Mapping[str, Probed]) -> Any:
    """`graph` with the probed ops' splits: unchanged (the batch) for a
    layer that runs as is, none for one that runs only replicated.

    Raises:
        Unsupported: naming each op that does not run on DTensor at all,
            probed so or listed so (`cannot_run`).
    """
    failed = cannot_run(graph)
    failed.update({name: p.error for name, p in probed.items() if p.error})
    if failed:
        by_reason: dict[str, list[str]] = {}
        for name, error in sorted(failed.items()):
            by_reason.setdefault(error, []).append(f"'{name}'")
        listing = "; ".join(
            f"{', '.join(names)}: {error}"
            for error, names in by_reason.items()
        )
        raise Unsupported(
            f"TensorFlow's DTensor cannot run these layers, even "
            f"replicated: {listing}"
        )
    ops = tuple(
        dataclasses.replace(op, partitionable={})
        if op.name in probed and probed[op.name].replicated else op
        for op in graph
    )
    return type(graph)(
        ops, graph.tensors, graph.inputs, graph.outputs, graph.batch_size
    )
