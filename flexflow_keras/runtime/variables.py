"""Weights live once, sharded, as DVariables; Keras variables mirror them.

Each Keras variable an op reads gets one `DVariable` on the mesh of the
first op that reads it, sharded by that op's parameter split. `push`
copies Keras values in (before running), `pull` gathers them back (at
epoch end, after fit, before get_weights / save).
"""

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context
from tensorflow.python.ops import gen_resource_variable_ops

from flexflow_keras import user_random
from flexflow_keras.runtime import fresh_state, moves
from flexflow_keras.runtime.moves import replicate  # noqa: F401 (re-export)
from flexflow_keras.runtime.layouts import OpPlan, replicated
from flexflow_keras.runtime.tracing import step_function


def to_layout(value: Any, layout: Any) -> Any:
    """A regular tensor or array as a DTensor with `layout`."""
    full = replicate(value, layout.mesh)
    if layout.is_fully_replicated():
        return full
    return dtensor.relayout(full, layout)


def gather(value: Any) -> tf.Tensor:
    """The full value of a DTensor as a regular tensor (eager only)."""
    layout = dtensor.fetch_layout(value)
    if not layout.is_fully_replicated():
        value = dtensor.relayout(value, replicated(layout.mesh, layout.rank))
    return dtensor.unpack(value)[0]


def densified(value: Any) -> Any:
    """A batch's `tf.SparseTensor` (rows for an `Input(sparse=True)`) as
    its dense tensor; any other value as it is.

    DTensor takes dense tensors only: fed sparse rows, the first step
    failed ("got a regular tensor for input 0 (shape [85,2])", the
    indices) and the model trained as plain Keras. Keras's layers compute
    on the dense rows what they compute on the sparse ones (`Dense`'s
    sparse matmul sums the same products), at the dense rows' memory."""
    if isinstance(value, tf.SparseTensor):
        return tf.sparse.to_dense(value)
    return value


def _blocks(layout: Any, shape: Any) -> list[tuple[tuple, bool]]:
    """For each of this process's devices of `layout`'s mesh, in
    `dtensor.unpack` order: the part of a tensor of `shape` it holds (as
    slices), and whether it is the first device holding that part (the
    others hold copies: the mesh axes the layout leaves replicated).
    The cut is `moves.grid_of`'s, the one rule of which device holds
    what."""
    grid = moves.grid_of(layout, shape)
    seen, found = set(), []
    for device, block in enumerate(grid.blocks):
        found.append((tuple(slice(lo, hi) for lo, hi in grid.region(device)),
                      block not in seen))
        seen.add(block)
    return found


def components(dvar: Any) -> list:
    """`dvar`'s per-device variables (`dtensor.unpack` of its handle),
    in its mesh's local device order; unpacked once per DVariable, and
    dropped with it (the handles would keep its memory)."""
    handles = _COMPONENTS.get(id(dvar))
    if handles is None:
        handles = _COMPONENTS[id(dvar)] = dtensor.unpack(dvar.handle)
        weakref.finalize(dvar, _COMPONENTS.pop, id(dvar), None)
    return handles


_COMPONENTS: dict[int, list] = {}


def read_components(variables: list[tuple[Any, Any]]) -> list[Any]:
    """The whole values of (DVariable, layout) pairs, read from each
    DVariable's devices' own variables (`components`): plain reads, one
    per block, and no DTensor op to trace or expand (a replicated one's
    value is its first device's tensor; a split one's, an array).

    DTensor runs its ops asynchronously to plain ones: the reads wait
    for the ops before them (measured: without the waits, a value written
    by DTensor or a plain one could be read as it was before)."""
    context.async_wait()
    values = []
    for dvar, layout in variables:
        handles = components(dvar)
        if layout.is_fully_replicated():
            values.append(_read(handles[0], dvar.dtype))
            continue
        whole = np.empty(dvar.shape, dvar.dtype.as_numpy_dtype)
        for handle, (part, first) in zip(handles,
                                         _blocks(layout, dvar.shape)):
            if first:
                whole[part] = _read(
                    handle, dvar.dtype).numpy()
        values.append(whole)
    return values


def write_components(variables: list[tuple[Any, Any, Any]]) -> None:
    """`read_components`'s inverse for (DVariable, layout, value)
    triples: each device's own variable takes its block of the value;
    DTensor's ops before and after wait for these."""
    context.async_wait()
    for dvar, layout, value in variables:
        value = np.asarray(value)
        handles = components(dvar)
        for handle, (part, _) in zip(handles, _blocks(layout, dvar.shape)):
            with tf.device(handle.device):
                gen_resource_variable_ops.assign_variable_op(
                    handle, tf.convert_to_tensor(
                        value[part],
                        dvar.dtype))
    context.async_wait()


def _read(handle: Any, dtype: Any) -> tf.Tensor:
    with tf.device(handle.device):
        return gen_resource_variable_ops.read_variable_op(handle, dtype)


class Transfers:
    """Keras values <-> DVariables.

    Where this process holds every device of the mesh, each DVariable is
    read and written through its devices' own variables
    (`read_components`, `write_components`): no DTensor op at all. Why:
    eagerly, each relayout and assignment is a DTensor dispatch of its
    own (copying the 52 variables of a Transformer block in took 118 ms,
    and out 47 ms, at every epoch boundary, measured on 4 virtual CPU
    devices), and a compiled function per direction, which cut that to
    8-10 ms and 5-6 ms, took 4.7-5.1 s to trace and expand for the 764
    variables of Inception-v3 the first time. With DTensor's multi-client
    mode (devices of other processes) the compiled functions remain.

    Each pair is `(keras_variable, dvariable, layout)`.
    """

    def __init__(self, mesh: Any):
        self._mesh = mesh
        self._functions: dict[tuple, Any] = {}
        self._local = len(mesh.local_devices()) == mesh.size

    def copy_in(self, pairs: list[tuple[Any, Any, Any]]) -> None:
        """Keras values -> DVariables (laid out as each pair says)."""
        if pairs and self._local:
            with fresh_state.quiet():
                write_components([(dvar, layout, var.value)
                                  for var, dvar, layout in pairs])
            return
        if pairs:
            assign_all = self._compiled("in", pairs, _assign_all)
            with fresh_state.quiet():
                values = [replicate(padded(var.value), self._mesh)
                          for var, _, _ in pairs]
            assign_all(values)

    def copy_out(self, pairs: list[tuple[Any, Any, Any]]) -> None:
        """DVariables -> Keras values (the shards gathered)."""
        if pairs and self._local:
            values = read_components([(dvar, layout)
                                      for _, dvar, layout in pairs])
            with fresh_state.quiet(), user_random.copying_in():
                for (var, _, _), value in zip(pairs, values):
                    var.assign(value)
            return
        if pairs:
            read_all = self._compiled("out", pairs, _read_all)
            with fresh_state.quiet(), user_random.copying_in():
                for (var, _, _), value in zip(pairs, read_all()):
                    var.assign(dtensor.unpack(value)[0])

    def _compiled(self, direction: str, pairs: list, make: Any) -> Any:
        """The compiled `make(pairs)`, traced once per variable set."""
        key = (direction,) + tuple(id(dvar) for _, dvar, _ in pairs)
        if key not in self._functions:
            self._functions[key] = step_function(make(pairs))
        return self._functions[key]


# DTensor specializes a function on the values of its small inputs (up
# to about 20 elements, measured on TF 2.21) and expands it again, once,
# when one changes: the optimizer's iteration count and learning rate
# copied in at the second epoch cost a second SPMD expansion of the copy
# function, and a batch of 16 labels one of the train step. Inputs
# smaller than this go in padded to it.
SMALL_INPUT_ELEMENTS = 64


def padded(value: Any) -> Any:
    """`value`, or, if DTensor would take it for a small constant, its
    flattened elements padded with zeros to `SMALL_INPUT_ELEMENTS`
    (`unpadded` inverts it inside the function)."""
    value = tf.convert_to_tensor(value)
    size = value.shape.num_elements()
    if size is None or size >= SMALL_INPUT_ELEMENTS:
        return value
    return tf.pad(tf.reshape(value, [-1]),
                  [[0, SMALL_INPUT_ELEMENTS - size]],
                  constant_values=tf.zeros([], value.dtype))


def unpadded(value: Any, shape: Any, batch_unknown: bool = False) -> Any:
    """`padded`'s inverse, inside a function: `value` as it was, of
    `shape` (a TensorShape or tuple).

    With `batch_unknown`, its first dim stays as unknown as the function
    was traced with: the element count comes from the padded value's
    own shape, so a step traced on an unknown batch does not learn its
    size here (Keras's per-output loss trackers weigh a known batch
    otherwise: losses 2.7% off on a last partial batch).
    """
    size = tf.TensorShape(shape).num_elements()
    if size is None or size >= SMALL_INPUT_ELEMENTS:
        return value
    if batch_unknown:
        count = tf.shape(value)[0] - (SMALL_INPUT_ELEMENTS - size)
        return tf.reshape(value[:count], [-1] + list(shape[1:]))
    return tf.reshape(value[:size], shape)


def _assign_all(pairs: list[tuple[Any, Any, Any]]) -> Any:
    """A function assigning replicated values (`padded`) to the pairs'
    DVariables, each relaid to its layout."""
    targets = [(dvar, layout) for _, dvar, layout in pairs]

    def assign_all(values):
        for (dvar, layout), value in zip(targets, values):
            value = unpadded(value, dvar.shape)
            dvar.assign(dtensor.relayout(value, layout))

    return assign_all


def _read_all(pairs: list[tuple[Any, Any, Any]]) -> Any:
    """A function reading the pairs' DVariables, each made replicated."""
    sources = [(dvar, replicated(layout.mesh, layout.rank))
               for _, dvar, layout in pairs]

    def read_all():
        return [dtensor.relayout(dvar.read_value(), whole)
                for dvar, whole in sources]

    return read_all


def _needs_copy(value: Any) -> bool:
    """Whether `value` is a regular tensor DTensor refuses to take in a
    step (larger than a scalar; not a string, a variable's handle or a
    variant) and the step needs as a replicated DTensor copy.

    Eager tensors only: a graph tensor a layer kept from an earlier trace
    (keras.io's focal modulation network sets `self.gates = tf.split(...)`
    in `call`) has no value to copy, and the layer's next call replaces
    it before reading it."""
    return (isinstance(value, tf.Tensor) and not tf.is_symbolic_tensor(value)
            and bool(value.shape.rank)
            and value.dtype not in (tf.string, tf.resource, tf.variant)
            and not dtensor.is_dtensor(value))


def _whole_copy(value: Any, mesh: Any) -> Any:
    """`value` as a DTensor held whole on every device of `mesh`."""
    return to_layout(value, replicated(mesh, value.shape.rank))


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
            if _needs_copy(value):
                found.append((each, name, _whole_copy(value, mesh)))
    return found


def captures_on_mesh(concrete: Any, mesh: Any) -> None:
    """Gives a traced function replicated DTensor copies on `mesh` of the
    regular tensors it captured (a `tf.constant` a loss object made in
    its `__init__`, a module-level constant a layer multiplies by:
    keras.io's Zero-DCE convolves with such kernels in its own step).
    DTensor refuses a captured regular tensor larger than a scalar ("got
    a regular tensor for input 15 ... but was expecting a DTensor"), and
    copying is what a script's own `dtensor.copy_to_mesh` would do: the
    values are unchanged, held whole on every device. Eager, after the
    trace and before the first call; resources (variables) and strings
    are left as they are."""
    captured = list(concrete.captured_inputs)
    copied = [_whole_copy(value, mesh) if _needs_copy(value) else value
              for value in captured]
    if any(a is not b for a, b in zip(captured, copied)):
        concrete.set_external_captures(copied)


def argument_constants(arguments: Any, mesh: Any) -> list[tuple]:
    """(arguments, "args" or "kwargs", the same with replicated DTensor
    copies) for a layer call whose arguments hold tensors of their own
    (`keras.ops.add(x, tf_constant)`; keras.io's movielens transformer
    adds an Embedding of `tf.range` computed while the model was built).
    Swapped in while a step is traced (`attributes_set`): Keras fills a
    call's arguments from these, and DTensor refuses a captured regular
    tensor larger than a scalar."""
    from keras import tree

    if arguments is None:
        return []

    def copied(value):
        return _whole_copy(value, mesh) if _needs_copy(value) else value

    changes = []
    for name in ("args", "kwargs"):
        value = vars(arguments)[name]
        leaves = tree.flatten(value)
        new = tree.map_structure(copied, value)
        if any(a is not b for a, b in zip(leaves, tree.flatten(new))):
            changes.append((arguments, name, new))
    return changes


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
            trainable, non_trainable = layer_variables(plan.op.layer)
            for var in trainable + non_trainable:
                if id(var) in self._dvars:
                    continue
                layout = plan.weight_layout(tuple(var.shape),
                                            plan.shard_axis_of(var))
                self._keras[id(var)] = var
                self._layouts[id(var)] = layout
                self.mesh_of[id(var)] = plan.mesh
                self._dvars[id(var)] = dtensor.DVariable(
                    to_layout(var.value, layout), trainable=var.trainable
                )
        groups: dict[Any, list] = {}  # mesh -> (keras, dvariable, layout)
        for key, var in self._keras.items():
            groups.setdefault(self.mesh_of[key], []).append(
                (var, self._dvars[key], self._layouts[key])
            )
        self._by_mesh = [(Transfers(mesh), pairs)
                         for mesh, pairs in groups.items()]

    def dvariable(self, var: Any) -> Any:
        return self._dvars[id(var)]

    def layout(self, var: Any) -> Any:
        return self._layouts[id(var)]

    def keras_variables(self) -> list:
        return list(self._keras.values())

    def push(self) -> None:
        """Keras values -> DVariables."""
        for transfers, pairs in self._by_mesh:
            transfers.copy_in(pairs)

    def pull(self) -> None:
        """DVariables -> Keras values (gathers the shards)."""
        for transfers, pairs in self._by_mesh:
            transfers.copy_out(pairs)
