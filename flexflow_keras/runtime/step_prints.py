"""`tf.print` in a model's step prints once per step, as in plain Keras.

DTensor runs every op of the step on every device of its mesh, a print
op too: a `tf.print("loss", loss)` in a user's `train_step` printed its
line once per device (4 lines a step on 4 virtual CPUs, and once more
per device on each host of a cluster).

While the step is traced (`model_step.ModelStepExecutor._trace`),
`tf.print` called in the step's own graph prints nothing there: its
arguments are kept, their tensors become extra outputs of the step, and
after each run of the step `tf.print` prints them, eagerly, with the
same arguments (`PrintedOnce.replay`). The line comes at the end of the
step rather than inside it; what it says is the same.

A `tf.print` inside a `tf.cond` branch, a loop body or a nested
`tf.function` runs in a graph of its own, where whether and how often it
prints is known only inside: it stays in the step and prints once per
device.

Planning runs the user's layers too (op costs measured, layers probed on
the devices): a `tf.print` in a custom layer's `call` printed its line
at each of those runs before the first step. They print nothing
(`silenced`).
"""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
from keras import tree
from keras.src.backend.common.variables import Variable as KerasVariable


class PrintedOnce:
    """The `tf.print` calls of one trace of a step: for each, its
    arguments with the tensors taken out (`calls`), and the tensors, in
    order (`tensors`), which the step returns beside its outputs."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, list[int], dict]] = []
        self.tensors: list[Any] = []

    def clear(self) -> None:
        """Nothing kept: a trace of the step begins."""
        self.calls, self.tensors = [], []

    def keep(self, inputs: tuple, kwargs: dict) -> None:
        """One call's arguments, its tensors kept for the step's outputs."""
        flat = tree.flatten(list(inputs))
        positions = []
        for index, value in enumerate(flat):
            if isinstance(value, (tf.Tensor, tf.Variable, KerasVariable)):
                positions.append(index)
                self.tensors.append(tf.convert_to_tensor(value))
                flat[index] = None  # its value comes after each run
        structure = tree.pack_sequence_as(list(inputs), flat)
        self.calls.append((structure, positions, dict(kwargs)))

    def replay(self, values: list) -> None:
        """Prints each kept call once, with `values` (the kept tensors'
        values after the step ran, regular tensors) in their places,
        through `tf.print` as it is now (`silenced` prints nothing)."""
        values = iter(values)
        for structure, positions, kwargs in self.calls:
            flat = tree.flatten(structure)
            for index in positions:
                flat[index] = next(values)
            tf.print(*tree.pack_sequence_as(structure, flat), **kwargs)


@contextlib.contextmanager
def kept(graph: Any, printed: PrintedOnce) -> Iterator[None]:
    """While a step's body is traced into `graph`: `tf.print` called in
    `graph` itself is kept in `printed` (emptied first) instead of
    printing on every device; called in any other graph, it prints as
    it would."""
    printed.clear()
    previous = tf.print

    def print_in_step(*inputs: Any, **kwargs: Any) -> Any:
        if tf.compat.v1.get_default_graph() is not graph:
            return previous(*inputs, **kwargs)
        printed.keep(inputs, kwargs)
        # An op, as `tf.print` returns in a graph: a step may hold it in
        # `tf.control_dependencies`.
        return tf.no_op()

    tf.print = print_in_step
    try:
        yield
    finally:
        tf.print = previous


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """The package's own runs of the user's code (planning, the layout
    recording `realized.record` runs and undoes) print nothing:
    `tf.print` called meanwhile, eagerly or while a graph is traced,
    does nothing."""
    previous, tf.print = tf.print, _print_nothing
    try:
        yield
    finally:
        tf.print = previous


def _print_nothing(*inputs: Any, **kwargs: Any) -> None:
    del inputs, kwargs


def split(outputs: Any, printed: PrintedOnce | None,
          regular: Callable[[Any], Any]) -> Any:
    """A step's `(outputs, printed tensors)`: prints the kept calls
    (each tensor made `regular` first) and returns the outputs."""
    outputs, values = outputs
    if printed is not None and printed.calls:
        printed.replay([regular(v) for v in values])
    return outputs
