"""Keras variables read or written between steps see the strategy's values.

While a model trains under a strategy, its DVariables hold the truth and
the Keras variables are copied from them at epoch ends (`trainer.py`). A
callback that reads `model.optimizer.iterations`, a weight or a metric
variable in `on_train_batch_end` would see the last epoch end's values
(plain Keras: the current ones), and one that writes a weight between
steps would be overwritten by the next step.

So a Keras variable that an executor backs is watched: its first eager
read after a step copies the executor's values out (`sync_out`), and an
eager write marks the executor to copy Keras values in before its next
step (`settle`). The cost is paid only when something reads or writes: a
fit whose callbacks touch no variable copies nothing more than before
(`tests/test_fresh_state.py` counts it). Reads and writes of the
runtime's own code (steps, transfers, metric syncs) run `quiet()`.
"""

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import tensorflow as tf
from keras.src.backend.common.variables import Variable

# id(Keras variable) -> (weak ref to it, weak ref to its executor)
_OWNERS: dict[int, tuple[Any, Any]] = {}
_PENDING: "weakref.WeakSet" = weakref.WeakSet()  # executors Keras wrote
_QUIET = [0]


def watch(executor: Any, variables: Iterable[Any]) -> None:
    """Reads and writes of `variables` go through `executor`'s sync."""
    owner = weakref.ref(executor)
    for var in variables:
        _OWNERS[id(var)] = (weakref.ref(var), owner)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The runtime's own reads and writes: no sync."""
    _QUIET[0] += 1
    try:
        yield
    finally:
        _QUIET[0] -= 1


@contextlib.contextmanager
def as_keras() -> Iterator[None]:
    """Inside the runtime's own code, reads and writes synced as a
    callback's are (`unfed_step.Recorder.replay`)."""
    saved, _QUIET[0] = _QUIET[0], 0
    try:
        yield
    finally:
        _QUIET[0] = saved


def settle() -> None:
    """Before a step: Keras values written since the last step go in."""
    while _PENDING:
        executor = _PENDING.pop()
        with quiet():
            executor.sync_in()


def _owner(var: Any) -> Any:
    if _QUIET[0] or not _OWNERS or not tf.executing_eagerly():
        return None
    entry = _OWNERS.get(id(var))
    if entry is None or entry[0]() is not var:
        return None
    return entry[1]()


def _before_access(var: Any) -> Any:
    executor = _owner(var)
    if executor is not None and executor.dirty:
        with quiet():
            executor.sync_out()
    return executor


_KERAS_VALUE = Variable.value
_KERAS_ASSIGN = Variable.assign


def _value(self):
    _before_access(self)
    return _KERAS_VALUE.fget(self)


def _assign(self, value):
    executor = _before_access(self)
    result = _KERAS_ASSIGN(self, value)
    if executor is not None:
        _PENDING.add(executor)
    return result


Variable.value = property(_value, doc=_KERAS_VALUE.__doc__)
Variable.assign = _assign
