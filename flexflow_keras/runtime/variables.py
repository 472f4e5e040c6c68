"""Weights live once, sharded, as DVariables; Keras variables mirror them.

Each Keras variable an op reads gets one `DVariable` on the mesh of the
first op that reads it, sharded by that op's parameter split. `push`
copies Keras values in (before running), `pull` gathers them back (at
epoch end, after fit, before get_weights / save).
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from tensorflow.experimental import dtensor

from flexflow_keras.runtime.layouts import OpPlan, replicated


def to_layout(value: Any, layout: Any) -> Any:
    """A regular tensor or array as a DTensor with `layout`."""
    value = tf.convert_to_tensor(value)
    full = dtensor.copy_to_mesh(value, replicated(layout.mesh, value.shape.rank))
    return dtensor.relayout(full, layout)


def gather(value: Any) -> tf.Tensor:
    """The full value of a DTensor as a regular tensor (eager only)."""
    layout = dtensor.fetch_layout(value)
    full = dtensor.relayout(value, replicated(layout.mesh, layout.rank))
    return dtensor.unpack(full)[0]


def layer_constants(layer: Any, mesh: Any) -> list[tuple[Any, str, Any]]:
    """(layer, attribute, replicated DTensor copy) for each tensor a layer
    or its sublayers keep as a plain attribute (Normalization's `mean`
    and `variance`, say). Eager, before tracing: DTensor refuses a
    captured regular tensor larger than a scalar in a step."""
    found = []
    for each in layer._flatten_layers() if hasattr(
        layer, "_flatten_layers"
    ) else [layer]:
        for name, value in list(vars(each).items()):
            if (isinstance(value, tf.Tensor) and value.shape.rank
                    and value.dtype != tf.string
                    and not dtensor.is_dtensor(value)):
                found.append((each, name, to_layout(
                    value, replicated(mesh, value.shape.rank)
                )))
    return found


@contextlib.contextmanager
def attributes_set(changes: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Sets `object.name = value` for each change, and back after."""
    saved = [(obj, name, vars(obj)[name]) for obj, name, _ in changes]
    for obj, name, value in changes:
        object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            object.__setattr__(obj, name, value)


def layer_variables(layer: Any) -> tuple[list, list]:
    """Trainable and non-trainable variables, in `stateless_call` order."""
    if not hasattr(layer, "non_trainable_variables"):
        return [], []
    return list(layer.trainable_variables), list(layer.non_trainable_variables)


class VariableStore:
    """The DVariables of a model under one strategy.

    Args:
        plans: Op plans in topological order.
    """

    def __init__(self, plans: tuple[OpPlan, ...]):
        self._dvars: dict[int, Any] = {}
        self._keras: dict[int, Any] = {}
        self._layouts: dict[int, Any] = {}
        self.mesh_of: dict[int, Any] = {}
        for plan in plans:
            layer = plan.op.layer
            infos = {}
            for var, info in zip(getattr(layer, "weights", ()), plan.op.weights):
                infos[id(var)] = info
            trainable, non_trainable = layer_variables(layer)
            for var in trainable + non_trainable:
                if id(var) in self._dvars:
                    continue
                info = infos.get(id(var))
                shape = tuple(var.shape)
                layout = plan.weight_layout(
                    shape, info.shard_axis if info is not None else None
                )
                self._keras[id(var)] = var
                self._layouts[id(var)] = layout
                self.mesh_of[id(var)] = plan.mesh
                self._dvars[id(var)] = dtensor.DVariable(
                    to_layout(var.value, layout), trainable=var.trainable
                )

    def dvariable(self, var: Any) -> Any:
        return self._dvars[id(var)]

    def layout(self, var: Any) -> Any:
        return self._layouts[id(var)]

    def keras_variables(self) -> list:
        return list(self._keras.values())

    def push(self) -> None:
        """Keras values -> DVariables."""
        for key, var in self._keras.items():
            self._dvars[key].assign(to_layout(var.value, self._layouts[key]))

    def pull(self) -> None:
        """DVariables -> Keras values (gathers the shards)."""
        for key, var in self._keras.items():
            var.assign(gather(self._dvars[key].read_value()))
