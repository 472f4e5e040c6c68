"""What plain Keras's last, batchless training call changes.

On a dataset of unknown length (`make_csv_dataset`, `filter`, a
generator) Keras's TensorFlow trainer calls its compiled train function
once more at each epoch's end; the function's `next(iterator)` raises
OutOfRange, but TensorFlow has by then run the step's ops that do not
wait for the batch: each `SeedGenerator.next()` (Dropout's mask seeds)
and each optimizer's `iterations += 1` (Adam's bias correction, learning
rate schedules). Measured on Keras 3.15 / TF 2.21: Adam on a filtered
dataset, epoch 2 loss 1.090185 against 1.0903594 for the same data of
known length; keras.io's wide-and-deep script, whose Dropout masks moved
on. The executors run a step per batch from Python, so such a call ran
nothing, and epoch 2 drifted from plain Keras.

`Recorder` counts, while a model's own train step is traced, the seed
draws and optimizer applications one step makes; `replay()` makes them
on the Keras variables when that batchless call comes, as a callback's
writes (`fresh_state`), so the next step starts where Keras's would.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from keras.src.optimizers.base_optimizer import BaseOptimizer
from keras.src.random.seed_generator import SeedGenerator

from flexflow_keras.runtime import fresh_state

_KERAS_NEXT = SeedGenerator.next
_KERAS_APPLY = BaseOptimizer.apply
_RECORDING: list["Recorder"] = []


def _next(self, ordered=True):
    if _RECORDING:
        _RECORDING[-1]._last()[0].append((self, ordered))
    return _KERAS_NEXT(self, ordered)


def _apply(self, *args, **kwargs):
    recorder = _RECORDING[-1] if _RECORDING else None
    if recorder is None or recorder.applying:  # a wrapped optimizer's
        return _KERAS_APPLY(self, *args, **kwargs)
    recorder._last()[1].append(self)
    recorder.applying = True
    try:
        return _KERAS_APPLY(self, *args, **kwargs)
    finally:
        recorder.applying = False


SeedGenerator.next = _next
BaseOptimizer.apply = _apply


class Recorder:
    """The seed draws and optimizer applications of one train step,
    recorded by part (the layer-by-layer executor traces a step as one
    function per segment; the model's own step is one part)."""

    def __init__(self):
        self._parts: dict[Any, tuple[list, list]] = {}
        self.applying = False

    def _last(self) -> tuple[list, list]:
        """The record of the part being traced."""
        return next(reversed(self._parts.values()))

    @property
    def draws(self) -> list[tuple[Any, bool]]:
        return [d for draws, _ in self._parts.values() for d in draws]

    @property
    def applies(self) -> list[Any]:
        return [a for _, applies in self._parts.values() for a in applies]

    @contextlib.contextmanager
    def recording(self, part: Any = None) -> Iterator[None]:
        """Around one trace of (`part` of) the train step: what it draws
        and applies (a new trace of a part replaces its record)."""
        self._parts.pop(part, None)  # the part traced last is last
        self._parts[part] = ([], [])
        _RECORDING.append(self)
        try:
            yield
        finally:
            _RECORDING.pop()

    def replay(self, optimizers: tuple = ()) -> None:
        """The batchless call's changes, on the Keras variables; an
        optimizer in `optimizers` applied besides those recorded (the
        layer-by-layer executor's own updates)."""
        with fresh_state.as_keras():
            for generator, ordered in self.draws:
                _KERAS_NEXT(generator, ordered)
            for optimizer in self.applies + list(optimizers):
                iterations = optimizer.iterations
                iterations.assign(iterations.numpy() + 1)
