"""`tf.Variable`s a model's step writes that Keras does not know.

Why this exists: keras.io's AdaMatch counts its steps in
`self.current_step = tf.Variable(0)` and calls `assign_add(1)` in its
`train_step`. Keras variables are backed by StepVariables on the mesh
(`ModelStepExecutor._realize`); a raw `tf.Variable` stayed a regular,
single-device one, which DTensor lets each device's program write in
turn: on a mesh of 2 the counter went up by 2 a step, and the loss
weight the script schedules with it was wrong from the second step.

Such a variable, where the traced step writes it, is swapped in the
function's captures for a replicated DVariable copy of it (one per
variable, shared by the functions of every batch size). The copy takes
the variable's value before each call and gives it back after, so that
code outside the step (a callback, the script, the next epoch) sees each
step's value as in Keras. Variables the step only reads stay as they are:
a read is the same on every device.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from tensorflow.experimental import dtensor

from flexflow_keras.runtime.layouts import replicated
from flexflow_keras.runtime.variables import to_layout

# Ops that only read a resource variable.
_READS = frozenset({"ReadVariableOp", "VariableShape"})


class RawVariables:
    """The replicated copies of the raw variables a step writes, on
    `mesh`; `swap_in` gives a traced function its copies."""

    def __init__(self, mesh: Any):
        self._mesh = mesh
        # id(variable) -> (variable, copy, the copy's layout)
        self._copies: dict[int, tuple[Any, Any, Any]] = {}

    def swap_in(self, concrete: Any) -> tuple[tuple[Any, Any, Any], ...]:
        """Replaces, in `concrete`'s captures, each raw variable it
        writes by its copy; returns those (variable, copy, layout)."""
        written = _written_raw_variables(concrete)
        if not written:
            return ()
        pairs = tuple(self._copy_of(variable) for variable in written)
        by_handle = {id(raw.handle): copy.handle for raw, copy, _ in pairs}
        concrete.set_external_captures([
            by_handle.get(id(value), value)
            for value in concrete.captured_inputs
        ])
        return pairs

    def _copy_of(self, variable: Any) -> tuple[Any, Any, Any]:
        pair = self._copies.get(id(variable))
        if pair is None:
            layout = replicated(self._mesh, variable.shape.rank)
            copy = dtensor.DVariable(to_layout(variable.read_value(), layout))
            pair = self._copies[id(variable)] = (variable, copy, layout)
        return pair


def copy_in(pairs: tuple[tuple[Any, Any, Any], ...]) -> None:
    """Each raw variable's value into its copy (before a step)."""
    for raw, copy, layout in pairs:
        copy.assign(to_layout(raw.read_value(), layout))


def copy_out(pairs: tuple[tuple[Any, Any, Any], ...]) -> None:
    """Each copy's value back into its raw variable (after a step)."""
    for raw, copy, _ in pairs:
        raw.assign(dtensor.unpack(copy.read_value())[0])


@contextlib.contextmanager
def left_as_they_were(concrete: Any) -> Iterator[None]:
    """While `concrete` runs for a measurement (a probe of a layer): the
    raw variables it writes get their values back after. Why: a layer of
    the user's that counts its calls in a `tf.Variable` counted the
    probe's runs too (3 more on a new machine), and trained apart from
    plain Keras from there."""
    saved = [(variable, tf.identity(variable.read_value()))
             for variable in _written_raw_variables(concrete)]
    try:
        yield
    finally:
        for variable, value in saved:
            variable.assign(value)


def _written_raw_variables(concrete: Any) -> list:
    """The regular (not DTensor) variables `concrete` captures and
    passes to an op other than a read."""
    internal = {id(external): placeholder
                for external, placeholder in concrete.graph.captures}
    found = []
    for variable in concrete.graph.variables:
        handle = getattr(variable, "handle", None)
        if (handle is None or handle.dtype != tf.resource
                or dtensor.is_dtensor(handle)
                or id(handle) not in internal):
            continue
        consumers = internal[id(handle)].consumers()
        if any(op.type not in _READS for op in consumers):
            found.append(variable)
    return found
