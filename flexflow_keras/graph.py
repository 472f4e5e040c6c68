"""Operator graph: what the simulator, search and runtime see.

An `OpGraph` holds one `Op` per layer call, in topological order, with
the tensors between them. Nested models are flattened (`outer/inner`
names) so that a strategy can place every real layer; a shared layer
called twice gives two ops, the second named `name#1`, recorded as
sharing the first one's weights. Per-type facts (FLOPs, which output dims
may be split) come from `op_specs`.

Pure data: no Keras, no TensorFlow. `keras_graph.py` builds graphs from
Keras models (the one bridge); an op's `layer`, `arguments` and
`tensor_names` are that bridge's handles, opaque here (not compared).
"""

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
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
        hosted_by: For an input of the step that the host computes
            before it (`keras_graph.hosted_nodes`: a lookup layer on a
            raw feature), that layer call's name; else None.
        varying: Dims whose size changes from batch to batch (a token
            sequence padded to each batch's longest): `shape` holds the
            size they are priced at (`keras_graph.VARYING_DIM_SIZE`),
            and no strategy splits them.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    producer: str | None = None
    index: int = 0
    hosted_by: str | None = None
    varying: tuple[int, ...] = ()

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
        tensor_names: id(KerasTensor) -> tensor name, for
            `keras_graph.fill_arguments`.
        varying_inputs: Per input, its `TensorInfo.varying` dims (empty
            when no input has any).
        gradient_inputs: Per input, whether the loss's gradient reaches
            it: an op upstream has trainable weights (empty: every
            input). The step's gradient is taken with respect to the
            trainable weights only, so TensorFlow computes no gradient
            of a model input or of a frozen base's outputs; the
            simulator prices no such gradient (`input_needs_gradient`).
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
    varying_inputs: tuple[tuple[int, ...], ...] = ()
    gradient_inputs: tuple[bool, ...] = ()

    def input_needs_gradient(self, pos: int) -> bool:
        """Whether the step computes the gradient of input `pos`
        (`gradient_inputs`)."""
        return not self.gradient_inputs or self.gradient_inputs[pos]

    @property
    def trains_weights(self) -> bool:
        """Whether the step computes gradients of weights of this op."""
        return any(w.trainable for w in self.weights)

    @property
    def has_backward(self) -> bool:
        """Whether any gradient is computed for this op: of a weight or
        of an input."""
        return self.trains_weights or any(
            self.input_needs_gradient(k) for k in range(len(self.inputs)))

    def takes(self, pos: int, shape: Sequence[int | None]) -> bool:
        """Whether a tensor of `shape` is this op's input `pos` as the
        graph has it: the same rank and dims, the batch dim and the
        input's `varying` dims (a length that changes from batch to
        batch) aside. The one test by which the runtime knows a traced
        call's tensors for the graph's."""
        planned = self.input_shapes[pos]
        varying = (self.varying_inputs[pos] if self.varying_inputs
                   else ())
        return len(shape) == len(planned) and all(
            dim == 0 or dim in varying or shape[dim] == planned[dim]
            for dim in range(len(planned)))

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


class OpGraph:
    """Ops of one model in topological order, with the tensors between them.

    Args:
        ops: Ops, producers before consumers.
        tensors: Every tensor by name (model inputs and op outputs).
        inputs: Names of the step's input tensors: the model's inputs
            an op reads, in model order, then the results of the calls
            run on the host before the step (`TensorInfo.hosted_by`).
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
    def hosted_inputs(self) -> tuple[str, ...]:
        """The inputs of the step that the host computes before it (their
        `TensorInfo.hosted_by`), in input order."""
        return tuple(t for t in self._inputs if self._tensors[t].hosted_by)

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

    def needs_gradient(self, tensor: str) -> bool:
        """Whether the step computes the gradient of `tensor`: an op
        that reads it says so (`Op.gradient_inputs`)."""
        return any(
            op.input_needs_gradient(k)
            for op in self._consumers.get(tensor, ())
            for k, name in enumerate(op.inputs) if name == tensor)

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
