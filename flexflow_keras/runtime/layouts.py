"""DTensor meshes and layouts from a strategy, and the segments they form.

Each op's `ParallelConfig(dims, device_ids)` becomes a mesh whose axes are
the op's split dims (degree > 1), in order, named `a0`, `a1`, ...; its
devices are `np.reshape(device_ids, degrees)`. Naming axes by position
(not by tensor dim) lets `dims=(4, 1)` and `dims=(1, 4)` on the same
devices share one mesh, so activations move between them by `relayout`.

A *segment* is a maximal run of consecutive ops (topological order) on one
mesh. DTensor runs a function whose data goes mesh A -> mesh B -> mesh A
(forward then backward) into a hang on this TensorFlow (measured), so the
step runs one function per segment when there are several.

In a mesh strategy (`mesh_space.MeshSpec.of`: every config a block of
one N-D mesh), every op runs on that mesh: its split dims on the axes
its block spans (`mesh_space.axes_on`), replicated along the others,
so an op left unsplit runs replicated on the whole mesh. That is how a
model's own step (one DTensor function, one mesh) runs hybrid layouts
and ops that DTensor runs only replicated.
"""

import dataclasses
from typing import Any

import numpy as np
from tensorflow.experimental import dtensor

from flexflow_keras import partition
from flexflow_keras.graph import Op, OpGraph
from flexflow_keras.mesh_space import MeshSpec
from flexflow_keras.strategy import Strategy

UNSHARDED = dtensor.UNSHARDED


def mesh_shape(dims: tuple[int, ...]) -> tuple[int, ...]:
    """Mesh axis sizes of a config: its degrees > 1, or `(1,)`."""
    shape = tuple(d for d in dims if d > 1)
    return shape or (1,)


def axis_of_dim(dims: tuple[int, ...]) -> dict[int, str]:
    """Tensor dim -> mesh axis name, for the split dims of a config."""
    names = {}
    for dim, degree in enumerate(dims):
        if degree > 1:
            names[dim] = f"a{len(names)}"
    return names


class MeshCache:
    """One `dtensor.Mesh` per (axis sizes, device ids), built once.

    Args:
        device_names: Full device names; strategy id i is
            `device_names[i]`.
        local_names: The names among them this process drives; None: all
            (one process). In DTensor's multi-client mode each client
            builds the same meshes and feeds only its local devices.
    """

    def __init__(
        self,
        device_names: tuple[str, ...],
        local_names: tuple[str, ...] | None = None,
    ):
        self._names = tuple(_full_name(n) for n in device_names)
        self._local = None if local_names is None else frozenset(
            _full_name(n) for n in local_names
        )
        self._meshes: dict[tuple, Any] = {}

    @property
    def num_devices(self) -> int:
        return len(self._names)

    def get(self, dims: tuple[int, ...], device_ids: tuple[int, ...]) -> Any:
        shape = mesh_shape(dims)
        key = (shape, tuple(device_ids))
        if key not in self._meshes:
            bad = [i for i in device_ids if i >= len(self._names)]
            if bad:
                raise ValueError(
                    f"The strategy uses device ids {bad}, but only "
                    f"{len(self._names)} devices are attached. Received: "
                    f"device_ids={tuple(device_ids)}. Search for this "
                    "machine, or attach as many devices as the strategy's "
                    "machine has."
                )
            n = len(device_ids)
            names = [self._names[i] for i in device_ids]
            local = [p for p, name in enumerate(names)
                     if self._local is None or name in self._local]
            self._meshes[key] = dtensor.Mesh(
                [f"a{i}" for i in range(len(shape))],
                np.arange(n).reshape(shape),
                local,
                [names[p] for p in local],
                global_devices=None if self._local is None else names,
            )
        return self._meshes[key]


def _full_name(name: str) -> str:
    if name.startswith("/job:"):
        return name
    short = name[len("/device:"):] if name.startswith("/device:") else name
    return f"/job:localhost/replica:0/task:0/device:{short}"


def replicated(mesh: Any, rank: int) -> Any:
    return dtensor.Layout.replicated(mesh, rank)


@dataclasses.dataclass(frozen=True, eq=False)
class OpPlan:
    """Mesh and layouts of one op.

    Args:
        op: The graph op.
        mesh: Its DTensor mesh.
        axes: Output dim -> mesh axis name, for split dims.
        batch_degree: Parts of the batch dim (1 if not split).
    """

    op: Op
    mesh: Any
    axes: dict[int, str]
    batch_degree: int

    def output_layout(self, index: int, rank: int, sharded_batch: bool):
        """Layout of output `index`; dims only describe output 0."""
        specs = [UNSHARDED] * rank
        for dim, axis in self.axes.items():
            if dim >= rank or (index and dim):
                continue
            if dim == 0 and not sharded_batch:
                continue
            specs[dim] = axis
        return dtensor.Layout(specs, self.mesh)

    def input_layout(
        self, position: int, shape: tuple[int, ...], sharded_batch: bool
    ):
        """Layout an input is moved to before the op runs.

        Split like the output on `partition.split_input_dims` (where the
        op then runs on its slice alone), which is also what the
        simulator moves; replicated elsewhere. DTensor computes correctly
        for any layout; these choices keep the op local.
        """
        split = partition.split_input_dims(self.op, position, shape)
        specs = [UNSHARDED] * len(shape)
        for dim, axis in self.axes.items():
            if dim in split and (dim != 0 or sharded_batch):
                specs[dim] = axis
        return dtensor.Layout(specs, self.mesh)

    def layout_of_call_input(self, position: int, shape: tuple,
                             sharded_batch: bool) -> Any:
        """The layout input `position` of a traced call, of `shape`, is
        moved to; None where it is not the op's input as planned.

        A tensor of the graph's shape (`Op.takes`) takes `input_layout`.
        So does one whose lengths differ from the graph's where the
        layout splits none of the dims that differ: a model whose
        `keras.Input` leaves its length unknown, planned for the arrays
        fit() fed it, predicting on another length (text generation,
        a test set padded otherwise). Left where DTensor propagated it,
        such an input met a recurrent loop's batch-split layouts and
        DTensor refused the step ("TransposeOp SPMD needs communication
        is not supported yet"): the model went to plain Keras for good.
        """
        planned = self.op.input_shapes[position]
        if self.op.takes(position, shape):
            return self.input_layout(position, planned, sharded_batch)
        if len(shape) != len(planned):
            return None
        layout = self.input_layout(position, planned, sharded_batch)
        if any(layout.sharding_specs[dim] != UNSHARDED
               for dim in range(1, len(planned))
               if shape[dim] != planned[dim]):
            return None
        return layout

    def shard_axis_of(self, variable: Any) -> int | None:
        """The axis of `variable`, one of the op's layer's, that the op's
        parameter split shards (`WeightInfo.shard_axis`); None:
        replicated. Matched by path and shape, not by place in the
        layer's list: quantizing or LoRA adds and reorders a layer's
        variables, and matched by place a kernel's scale (1-D) was given
        the kernel's axis 1."""
        path, shape = getattr(variable, "path", None), tuple(variable.shape)
        for info in self.op.weights:
            if info.path == path and info.shape == shape:
                return info.shard_axis
        return None

    def weight_layout(self, shape: tuple[int, ...], shard_axis: int | None):
        """Parameter split shards the weight; otherwise replicated."""
        specs = [UNSHARDED] * len(shape)
        param = self.op.parameter_dim
        if shard_axis is not None and param is not None and param in self.axes:
            specs[shard_axis] = self.axes[param]
        return dtensor.Layout(specs, self.mesh)


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """Consecutive ops on one mesh, run as one DTensor function.

    Args:
        mesh: The shared mesh.
        ops: The op plans, in topological order.
        inputs: Tensors read but made outside (model inputs included).
        outputs: Tensors made here and read outside or by the loss.
    """

    mesh: Any
    ops: tuple[OpPlan, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def plan_ops(
    graph: OpGraph, strategy: Any, meshes: MeshCache
) -> tuple[OpPlan, ...]:
    """One `OpPlan` per op, checked against the graph."""
    plans: list[OpPlan] = []
    by_name: dict[str, OpPlan] = {}
    # The one validation (`Strategy.validate`): every op has a config
    # it can take, on devices that exist.
    Strategy(dict(strategy)).validate(graph, meshes.num_devices)
    spec = MeshSpec.of(strategy, meshes.num_devices)
    home = None if spec is None else meshes.get(spec.shape, spec.devices)
    for op in graph:
        config = strategy[op.name]
        if home is not None:
            mesh = home
            axes = {d: f"a{a}" for d, a in spec.axes(config).items()}
        else:
            mesh = meshes.get(config.dims, config.device_ids)
            axes = axis_of_dim(config.dims)
        owner = op.shares_weights_with and by_name.get(op.shares_weights_with)
        if owner is not None and (
            owner.mesh != mesh
            or owner.axes.get(owner.op.parameter_dim)
            != axes.get(op.parameter_dim)  # the weights' one layout
        ):
            _untied(op, config, owner.op, strategy[owner.op.name])
        plans.append(OpPlan(op, mesh, axes, config.dims[0]))
        by_name[op.name] = plans[-1]
    return tuple(plans)


def _untied(op: Op, config: Any, owner: Op, owner_config: Any) -> None:
    """Raises for a call of a shared layer away from its weights' mesh.

    The weights live once, on the first call's mesh; a call on another
    mesh would need their gradient summed across meshes. Strategies come
    tied (`search_space.tie_shared`: the search, imports and compile()
    tie them), so this is a strategy made or edited by hand.
    """
    if op.output_shape != owner.output_shape:
        raise NotImplementedError(
            f"Op '{op.name}' shares the weights of '{owner.name}' but has "
            "another output shape and another mesh. Give both the same "
            "dims and device_ids."
        )
    raise ValueError(
        f"Op '{op.name}' calls the shared layer of '{owner.name}', whose "
        f"weights live on that op's devices, with another config: "
        f"{config} against {owner_config}. Give every call of a shared "
        "layer the same config (`flexflow_keras.search_space.tie_shared("
        "graph, strategy)` does)."
    )


def segments(graph: OpGraph, plans: tuple[OpPlan, ...]) -> tuple[Segment, ...]:
    """Groups consecutive ops on the same mesh."""
    groups: list[list[OpPlan]] = []
    for plan in plans:
        if groups and groups[-1][0].mesh == plan.mesh:
            groups[-1].append(plan)
        else:
            groups.append([plan])
    result = []
    for group in groups:
        made = {t for p in group for t in p.op.outputs}
        names = {p.op.name for p in group}
        inputs = tuple(
            dict.fromkeys(
                t for p in group for t in p.op.inputs if t not in made
            )
        )
        outputs = tuple(
            t
            for p in group
            for t in p.op.outputs
            if t in graph.outputs
            or any(c.name not in names for c in graph.consumers(t))
        )
        result.append(Segment(group[0].mesh, tuple(group), inputs, outputs))
    return tuple(result)
