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

Every eager write of a watched variable is also counted, the runtime's
own included (`written_since`): an executor whose Keras values were
copied out at an epoch's end, and not written since, need not copy them
back in at the next epoch's start (for Inception-v3 that copy was a
function of 764 variables, 4.7 s to trace and expand on 4 virtual CPUs).
A watched variable written inside a graph that is not the runtime's (a
plain Keras function, a user's `tf.function`) counts as written at every
check from then on: those writes are not seen one by one.
"""

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import tensorflow as tf
from keras.src.backend.common.variables import Variable
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.callbacks.swap_ema_weights import SwapEMAWeights

# id(Keras variable) -> (weak ref to it, weak ref to its executor)
_OWNERS: dict[int, tuple[Any, Any]] = {}
_PENDING: "weakref.WeakSet" = weakref.WeakSet()  # executors Keras wrote
_QUIET = [0]
_WRITES = [0]  # eager writes of watched variables so far
# id(watched variable) -> `_WRITES` at its last eager write, or
# `_IN_GRAPHS` once something other than the runtime wrote it in a graph
_LAST_WRITE: dict[int, float] = {}
_IN_GRAPHS = float("inf")


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


def writes() -> int:
    """The count of eager writes of watched variables so far: an
    executor keeps it at each copy between Keras and itself."""
    return _WRITES[0]


def written_since(variables: Iterable[Any], count: int) -> bool:
    """Whether any of `variables` was written after `writes()` was
    `count` (or in a graph not the runtime's, ever)."""
    return any(_LAST_WRITE.get(id(var), -1) > count for var in variables)


class LastCopy:
    """When an executor's values and its Keras variables were last made
    equal (made from the Keras values, or copied either way): the one
    rule both executors apply before copying Keras values in."""

    def __init__(self) -> None:
        self._at = writes()

    def mark(self) -> None:
        """They are equal now."""
        self._at = writes()

    def stale(self, variables: Iterable[Any]) -> bool:
        """Whether any of `variables` was written since the last mark."""
        return written_since(variables, self._at)


def _note_write(var: Any) -> None:
    entry = _OWNERS.get(id(var))
    if entry is None or entry[0]() is not var:
        return
    if tf.executing_eagerly():
        if _LAST_WRITE.get(id(var)) != _IN_GRAPHS:
            _WRITES[0] += 1
            _LAST_WRITE[id(var)] = _WRITES[0]
    elif not _QUIET[0]:
        _LAST_WRITE[id(var)] = _IN_GRAPHS


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
    _written(self, executor)
    return result


def _written(var: Any, executor: Any) -> None:
    """`var` was written eagerly: counted, and `executor` (its owner
    when the write is synced, else None) copies it in before its next
    step."""
    _note_write(var)
    if executor is not None:
        _PENDING.add(executor)


Variable.value = property(_value, doc=_KERAS_VALUE.__doc__)
Variable.assign = _assign


def _averaged_and_trained(optimizer: Any) -> list[Any]:
    """An EMA optimizer's weights and their averages (a swap writes both)."""
    return [*optimizer._trainable_variables,
            *optimizer._model_variables_moving_average]


# Keras functions that write a Keras variable's tf.Variable (its `value`)
# eagerly rather than through `assign`, so `_assign` never sees the write:
# (class, method, the Keras variables a call writes, from its arguments).
# Unseen, the next step ran on the executor's own values.
# - The TensorFlow optimizer with `use_ema` puts the averages into the
#   weights at the end of fit(): evaluate() after fit() ran on the last
#   trained weights (loss 0.019 off plain Keras's;
#   `tests/test_feature_combinations.py`).
# - `SwapEMAWeights` swaps the averages in for validation, evaluate and
#   predict and out again for training: every validation ran on the
#   trained weights (val_loss 0.40 against plain Keras's 0.54 after one
#   epoch; `tests/test_fresh_state.py`).
_RAW_WRITERS = (
    (TFOptimizer, "_overwrite_model_variables_with_average_value",
     lambda optimizer, trainable_variables: trainable_variables),
    (SwapEMAWeights, "_tf_swap_variables",
     lambda callback, optimizer: _averaged_and_trained(optimizer)),
    (SwapEMAWeights, "_tf_finalize_ema_values",
     lambda callback, optimizer: _averaged_and_trained(optimizer)),
)


def _counting_writes(method: Any, written: Any) -> Any:
    """`method`, counting each Keras variable `written` names as an eager
    write (as `_assign` counts one)."""

    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        for var in written(self, *args, **kwargs):
            if isinstance(var, Variable):
                _written(var, _owner(var))
        return result

    return counted


for _cls, _name, _written_by in _RAW_WRITERS:
    setattr(_cls, _name, _counting_writes(getattr(_cls, _name), _written_by))
