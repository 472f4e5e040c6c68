"""Keras variables a step uses that its model does not track.

Why this exists: a model's step may use layers the model does not hold
as attributes. keras.io's `semantic_image_clustering` calls a
module-level `Sequential` of random augmentation layers (and a
`Normalization` it adapted) inside its `call()`: their seed generators'
states and statistics are not in `model.variables`. Left regular
variables inside a DTensor step, each device's program advanced the
seed state in turn, so every augmentation drew other numbers than plain
Keras's (the script's first loss 854 against 1755). Such a variable
must be backed by a StepVariable like the model's own
(`ModelStepExecutor._realize`).

The layers of the graph are known before the first trace (the ops of a
traced `call()` include the untracked ones); anything else (a seed
generator or layer only the user's `train_step` uses) is found while
the step is traced, by `recording`, and the step traced anew.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from keras.src.backend.common.variables import Variable as KerasVariable


@contextlib.contextmanager
def recording(known: set[int], found: list) -> Iterator[None]:
    """While a step is traced: appends to `found` each Keras variable
    read or assigned whose id is not in `known` (once each)."""
    value = KerasVariable.value
    assign = KerasVariable.assign
    seen = set(known) | {id(v) for v in found}

    def note(variable: Any) -> None:
        if id(variable) not in seen:
            seen.add(id(variable))
            found.append(variable)

    def read(variable):
        note(variable)
        return value.fget(variable)

    def write(variable, new_value):
        note(variable)
        return assign(variable, new_value)

    KerasVariable.value = property(read)
    KerasVariable.assign = write
    try:
        yield
    finally:
        KerasVariable.value = value
        KerasVariable.assign = assign
