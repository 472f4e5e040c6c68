"""Operator graph of a Keras model: what the simulator, search and runtime see.

A Keras functional (or Sequential, or nested) model becomes an `OpGraph`
with one `Op` per layer call, in topological order. Nested models are
flattened (`outer/inner` names) so that a strategy can place every real
layer; a shared layer called twice gives two ops, the second named
`name#1`, recorded as sharing the first one's weights. Per-type facts
(FLOPs, which output dims may be split) come from `op_specs`.

Imports Keras only to walk the model; no TensorFlow, no DTensor.
"""

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from flexflow_keras.capabilities import ATTRIBUTE, PARAMETER, SAMPLE
SOAP_KINDS = (SAMPLE, ATTRIBUTE, PARAMETER)


@dataclasses.dataclass(frozen=True)
class WeightInfo:
    """One variable an op reads.

    Args:
        path: Keras variable path, e.g. `dense/kernel`.
        shape: Full (unsharded) shape.
        dtype: Variable dtype name.
        trainable: Whether the optimizer updates it.
        shard_axis: Axis split when the op's parameter dim is partitioned;
            `None` means the variable stays replicated.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    shard_axis: int | None = None

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """An edge: a model input or one output of an op.

    Args:
        name: `op_name:index` for op outputs, the input layer name for
            model inputs.
        shape: Static shape, batch included.
        dtype: dtype name.
        producer: Name of the op that makes it; `None` for model inputs.
        index: Output position within the producer.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    producer: str | None = None
    index: int = 0

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    """One call of a Keras layer or operation.

    Args:
        name: Unique op name (the layer name; `outer/inner` when nested;
            `name#k` for the k-th extra call of a shared layer).
        type: Keras class name, e.g. `Dense`, `Add`.
        inputs: Names of the tensors it reads, in call order.
        outputs: Names of the tensors it writes.
        input_shapes: Static input shapes, batch included.
        output_shapes: Static output shapes, batch included.
        dtype: Compute dtype of the outputs.
        weights: Variables it reads (empty for weightless ops).
        shares_weights_with: Name of the op that owns the same variables
            (shared layers); `None` when the weights are its own.
        forward_flops: FLOPs of the forward pass over the whole batch.
        backward_flops: FLOPs of the backward pass over the whole batch.
        flops_exact: False when the FLOPs are an estimate.
        partitionable: Output dim -> SOAP kind (`sample`, `attribute`,
            `parameter`) for the dims a strategy may split.
        layer: The Keras `Operation` object (not compared).
        arguments: Keras `SymbolicArguments` of the call (not compared).
        tensor_names: id(KerasTensor) -> tensor name, for `fill_arguments`.
    """

    name: str
    type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    dtype: str
    weights: tuple[WeightInfo, ...] = ()
    shares_weights_with: str | None = None
    forward_flops: float = 0.0
    backward_flops: float = 0.0
    flops_exact: bool = False
    partitionable: Mapping[int, str] = dataclasses.field(
        default_factory=dict
    )
    layer: Any = dataclasses.field(default=None, repr=False, compare=False)
    arguments: Any = dataclasses.field(
        default=None, repr=False, compare=False
    )
    tensor_names: Mapping[int, str] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def output_shape(self) -> tuple[int, ...]:
        """Shape of output 0: the tensor that `ParallelConfig.dims` splits."""
        return self.output_shapes[0]

    @property
    def rank(self) -> int:
        return len(self.output_shape)

    @property
    def parameter_dim(self) -> int | None:
        for dim, kind in self.partitionable.items():
            if kind == PARAMETER:
                return dim
        return None

    @property
    def weight_bytes(self) -> int:
        return sum(w.num_bytes for w in self.weights)

    @property
    def trainable_weight_bytes(self) -> int:
        return sum(w.num_bytes for w in self.weights if w.trainable)

    @property
    def output_bytes(self) -> int:
        itemsize = np.dtype(self.dtype).itemsize
        return sum(math.prod(s) for s in self.output_shapes) * itemsize

    def fill_arguments(
        self, values: Mapping[str, Any]
    ) -> tuple[tuple, dict]:
        """Call arguments of this op with tensors looked up by name.

        Why: the runtime replays each call with its own (sharded) values
        while keeping every non-tensor argument the user passed.
        """
        from keras import tree
        from keras.src.backend.common.keras_tensor import KerasTensor

        def swap(x):
            if isinstance(x, KerasTensor):
                return values[self.tensor_names[id(x)]]
            return x

        args = tree.map_structure(swap, self.arguments.args)
        kwargs = tree.map_structure(swap, self.arguments.kwargs)
        return args, kwargs


class OpGraph:
    """Ops of one model in topological order, with the tensors between them.

    Args:
        ops: Ops, producers before consumers.
        tensors: Every tensor by name (model inputs and op outputs).
        inputs: Names of the model's input tensors, in model order.
        outputs: Names of the model's output tensors, in model order.
        batch_size: Global batch the shapes were built for.
    """

    def __init__(
        self,
        ops: tuple[Op, ...],
        tensors: Mapping[str, TensorInfo],
        inputs: tuple[str, ...],
        outputs: tuple[str, ...],
        batch_size: int,
    ):
        self._ops = tuple(ops)
        self._by_name = {op.name: op for op in self._ops}
        if len(self._by_name) != len(self._ops):
            raise ValueError("Op names must be unique.")
        self._tensors = dict(tensors)
        self._inputs = tuple(inputs)
        self._outputs = tuple(outputs)
        self._batch_size = batch_size
        consumers: dict[str, list[Op]] = {t: [] for t in self._tensors}
        for op in self._ops:
            for t in dict.fromkeys(op.inputs):
                consumers[t].append(op)
        self._consumers = {t: tuple(c) for t, c in consumers.items()}

    @property
    def ops(self) -> tuple[Op, ...]:
        return self._ops

    @property
    def tensors(self) -> Mapping[str, TensorInfo]:
        return self._tensors

    @property
    def inputs(self) -> tuple[str, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[str, ...]:
        return self._outputs

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def __len__(self) -> int:
        return len(self._ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self._ops)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __repr__(self) -> str:
        return (
            f"OpGraph(num_ops={len(self._ops)}, batch_size="
            f"{self._batch_size}, inputs={self._inputs}, "
            f"outputs={self._outputs})"
        )

    def op(self, name: str) -> Op:
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(
                f"The model has no op named '{name}'. "
                f"Known ops: {sorted(self._by_name)}"
            ) from None

    def consumers(self, tensor: str) -> tuple[Op, ...]:
        return self._consumers[tensor]

    def producer(self, tensor: str) -> Op | None:
        name = self._tensors[tensor].producer
        return None if name is None else self._by_name[name]

    def predecessors(self, op: Op) -> tuple[Op, ...]:
        found = (self.producer(t) for t in dict.fromkeys(op.inputs))
        return tuple(dict.fromkeys(p for p in found if p is not None))

    def successors(self, op: Op) -> tuple[Op, ...]:
        found = (c for t in op.outputs for c in self._consumers[t])
        return tuple(dict.fromkeys(found))

    @property
    def weight_bytes(self) -> int:
        """Bytes of all variables, shared ones counted once."""
        return sum(
            op.weight_bytes for op in self._ops if not op.shares_weights_with
        )


def build_graph(model: Any, batch_size: int) -> OpGraph:
    """The `OpGraph` of a built Keras model for a global batch size.

    Args:
        model: A functional or Sequential Keras model (nested models are
            flattened). Subclassed models have no graph to walk.
        batch_size: Global batch size; fills the batch dim of every shape.

    Returns:
        The `OpGraph`.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            "`batch_size` must be a positive integer. "
            f"Received: batch_size={batch_size!r}"
        )
    function = _as_function(model)
    if function is None:
        raise ValueError(
            f"Model '{model.name}' has no graph of layers to parallelize: "
            "only functional and Sequential models (built, with a known "
            "input shape) can be turned into an OpGraph. Received: a "
            f"{type(model).__name__}. Build it with `keras.Input(...)` or "
            "give the Sequential model an `Input` layer."
        )
    builder = _GraphBuilder(batch_size)
    inputs = builder.add_inputs(function)
    outputs = builder.walk(function, prefix="", bindings={})
    return OpGraph(
        builder.ops, builder.tensors, inputs, outputs, batch_size
    )


def has_graph(model: Any) -> bool:
    """Whether `build_graph` can walk `model` (functional or Sequential)."""
    return _as_function(model) is not None


def function_of(model: Any) -> Any:
    """What runs `model`'s layers: its Keras `Function` (a Sequential's
    inner one), else the model itself (e.g. a Sequential not yet built)."""
    function = _as_function(model)
    return model if function is None else function


def trace_call(model: Any, inputs: Any) -> str | None:
    """Gives a model a graph: its `call` run on symbolic inputs (see
    `needs_trace`). Returns None, or why its call cannot be traced.

    The layers called inside `call()` record their calls, as in a
    functional model, so each becomes an op; inner models are flattened
    as usual. The model still runs its own `call()` (and step); the
    graph only names the layer calls a strategy places. A model without
    a `call()` (a VAE whose `train_step` calls its encoder and decoder)
    gets the graphs of the functional models it holds, side by side.

    Args:
        model: A Keras model.
        inputs: `keras.Input`s (any structure) shaped like `fit`'s data.
    """
    import inspect

    import keras

    try:
        if type(model).call is keras.Model.call:
            function = _inner_models(model)
        else:
            kwargs = {}
            if "training" in inspect.signature(model.call).parameters:
                kwargs["training"] = False
            outputs = model.call(inputs, **kwargs)
            function = keras.Model(inputs, outputs, name=model.name)
    except Exception as error:  # noqa: BLE001 - any failure: no graph
        return f"{type(error).__name__}: {error}"
    # Not through Keras's __setattr__: the trace must not become a
    # tracked sublayer (weights, saving) of the model.
    object.__setattr__(model, "_ff_traced_function", function)
    return None


def _inner_models(model: Any) -> Any:
    """One functional model over the functional models `model` holds."""
    import keras

    parts = [
        _own_function(layer)
        for layer in model._flatten_layers(include_self=False,
                                           recursive=False)
    ]
    parts = [p for p in parts if p is not None]
    if not parts:
        raise ValueError(
            "it has no call() and holds no functional or Sequential model"
        )
    return keras.Model(
        [t for p in parts for t in p.inputs],
        [t for p in parts for t in p.outputs],
        name=model.name,
    )


def is_traced(model: Any) -> bool:
    """Whether `model`'s graph comes from `trace_call`."""
    return "_ff_traced_function" in vars(model)


def needs_trace(model: Any) -> bool:
    """Whether `model`'s graph must come from `trace_call`: a subclassed
    model (no graph of its own), or a functional or Sequential one whose
    inputs have unknown non-batch dims (`keras.Input((None,))`: the
    simulator needs the shapes `fit` feeds)."""
    if is_traced(model):
        return False
    function = _own_function(model)
    if function is None:
        return is_subclassed(model)
    return any(None in tuple(t.shape)[1:] for t in function.inputs)


def is_subclassed(model: Any) -> bool:
    """A Keras model with no functional graph of its own (its `call()`
    is Python code)."""
    from keras.src.models.sequential import Sequential

    return not isinstance(model, Sequential) and _own_function(model) is None


def _as_function(model: Any) -> Any:
    """The Keras `Function` behind a model (its trace, if it has one),
    or None."""
    traced = vars(model).get("_ff_traced_function")
    return traced if traced is not None else _own_function(model)


def _own_function(model: Any) -> Any:
    """The Keras `Function` a model was built as, or None."""
    from keras.src.models.functional import Functional
    from keras.src.models.sequential import Sequential

    if isinstance(model, Sequential):
        if model._functional is None and model.built is False:
            return None
        return model._functional
    if isinstance(model, Functional):
        return model
    return None


def _call_index(node: Any) -> int:
    """Position of a call among all calls of its layer (user order)."""
    return node.operation._inbound_nodes.index(node)


class _GraphBuilder:
    """Walks Keras nodes depth-first through nested models."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.ops: list[Op] = []
        self.tensors: dict[str, TensorInfo] = {}
        self.names: dict[int, str] = {}  # id(KerasTensor) -> tensor name
        self.first_op_of_layer: dict[int, str] = {}

    def add_inputs(self, function: Any) -> tuple[str, ...]:
        names = []
        for kt in function.inputs:
            layer = kt._keras_history.operation
            name = layer.name if layer is not None else kt.name
            fixed = kt.shape[0] if kt.shape else None
            if fixed is not None and fixed != self.batch_size:
                # Every shape downstream would carry the fixed batch.
                raise ValueError(
                    f"Model input '{name}' has a fixed batch size of "
                    f"{fixed}, which differs from the global batch size. "
                    f"Received: batch_size={self.batch_size}. Use "
                    f"batch_size={fixed}, or leave the batch dim of "
                    "`keras.Input` as None."
                )
            self.tensors[name] = TensorInfo(
                name, self.static_shape(kt, name), str(kt.dtype)
            )
            self.names[id(kt)] = name
            names.append(name)
        return tuple(names)

    def static_shape(self, kt: Any, where: str) -> tuple[int, ...]:
        shape = list(kt.shape)
        if shape and shape[0] is None:
            shape[0] = self.batch_size
        if any(d is None for d in shape):
            raise ValueError(
                f"Tensor of '{where}' has an unknown dimension; the search "
                "needs static shapes. Received: shape="
                f"{tuple(kt.shape)}. Give `keras.Input` a full `shape=` "
                "(only the batch dim may be None)."
            )
        return tuple(int(d) for d in shape)

    def walk(
        self, function: Any, prefix: str, bindings: dict[int, str]
    ) -> tuple[str, ...]:
        """Adds the ops of `function`; returns its output tensor names."""
        self.names.update(bindings)
        by_depth = function._nodes_by_depth
        nodes = [
            node
            for depth in sorted(by_depth, reverse=True)
            for node in sorted(
                by_depth[depth],
                key=lambda n: _call_index(n) if n.operation else 0,
            )
            if node.operation is not None and not node.is_input
        ]
        # `name#k` numbers the calls of a shared layer in the user's order.
        call_rank = {}
        for node in nodes:
            calls = call_rank.setdefault(id(node.operation), [])
            calls.append(_call_index(node))
        for node in nodes:
            index = _call_index(node)
            rank = sorted(call_rank[id(node.operation)]).index(index)
            base = prefix + node.operation.name
            self.add_node(node, base if rank == 0 else f"{base}#{rank}")
        return tuple(self.names[id(kt)] for kt in function.outputs)

    def add_node(self, node: Any, name: str) -> None:
        operation = node.operation
        inner = _as_function(operation)
        in_kts = node.arguments.keras_tensors
        if inner is not None:
            bindings = {
                id(inner_kt): self.names[id(kt)]
                for inner_kt, kt in zip(inner.inputs, in_kts)
            }
            out_names = self.walk(inner, name + "/", bindings)
            for kt, out in zip(node.outputs, out_names):
                self.names[id(kt)] = out
            return
        self.add_op(name, node, in_kts)

    def add_op(self, name: str, node: Any, in_kts: list) -> None:
        from flexflow_keras import op_specs

        operation = node.operation
        inputs = tuple(self.names[id(kt)] for kt in in_kts)
        input_shapes = tuple(self.tensors[t].shape for t in inputs)
        output_shapes = tuple(
            self.static_shape(kt, name) for kt in node.outputs
        )
        outputs = tuple(f"{name}:{i}" for i in range(len(node.outputs)))
        for i, (kt, out) in enumerate(zip(node.outputs, outputs)):
            self.tensors[out] = TensorInfo(
                out, output_shapes[i], str(kt.dtype), name, i
            )
            self.names[id(kt)] = out
        spec = op_specs.describe(
            operation, input_shapes, output_shapes, node.arguments
        )
        weights = tuple(
            WeightInfo(
                v.path,
                tuple(int(d) for d in v.shape),
                str(v.dtype),
                bool(v.trainable),
                spec.weight_shard_axes.get(v.path),
            )
            for v in getattr(operation, "weights", ())
        )
        owner = self.first_op_of_layer.setdefault(id(operation), name)
        dtype = str(node.outputs[0].dtype) if node.outputs else "float32"
        self.ops.append(
            Op(
                name=name,
                type=type(operation).__name__,
                inputs=inputs,
                outputs=outputs,
                input_shapes=input_shapes,
                output_shapes=output_shapes,
                dtype=dtype,
                weights=weights,
                shares_weights_with=(
                    owner if owner != name and weights else None
                ),
                forward_flops=float(spec.forward_flops),
                backward_flops=float(spec.backward_flops),
                flops_exact=spec.flops_exact,
                partitionable=dict(spec.partitionable),
                layer=operation,
                arguments=node.arguments,
                tensor_names={id(kt): self.names[id(kt)] for kt in in_kts},
            )
        )
