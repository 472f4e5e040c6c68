"""A training loop of the user's own, said once per model.

The package parallelizes what runs through a model's `compile()`,
`fit()`, `evaluate()` and `predict()` (and `train_on_batch` and the
like): the step it traces there runs under the searched strategy. A
script that trains by its own loop instead (keras.io's "Writing a
training loop from scratch": `model(x, training=True)` under a
`tf.GradientTape`, then `optimizer.apply`) calls the model directly;
nothing of the package is involved, and that loop runs as plain Keras on
one device. Without a word, a user who changed the import would take it
for parallel training, so the first such call of each model says it,
with the way to be served: move the step into `train_step`.

A call counts as a loop's when a gradient tape is recording and no
package entry point of any model is running (inside
`fit()`, a GAN's own step calls its sub-models under tapes: those run
under the strategy, or as plain Keras with the fallback's own warning).
"""

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from tensorflow.python.eager import record

from flexflow_keras import notices

# How many package entry points are running, in any thread: a process
# count, not a per-thread one, because Keras's steps may run on other
# threads (a tf.distribute strategy's replica threads).
_depth = 0
_lock = threading.Lock()

# This package's name: AutoGraph leaves its code as written, and a model
# whose class derives from one of its classes is ours.
_PACKAGE = __name__.split(".")[0]

# Models whose loop was said.
_SAID: "weakref.WeakSet[Any]" = weakref.WeakSet()

# Model methods whose work is the package's: a model called inside them
# is called by the package's step, its search or its probes.
ENTRY_POINTS = ("compile", "fit", "evaluate", "predict", "train_on_batch",
                "test_on_batch", "predict_on_batch")


@contextlib.contextmanager
def entered() -> Iterator[None]:
    """Marks the package's own work for the calls made inside it."""
    global _depth
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1


def mark_entry_points(cls: type) -> type:
    """`cls` with each of `ENTRY_POINTS` it inherits run inside
    `entered()`. Those it defines itself enter in their own bodies: a
    wrapper's frame would shift the `stacklevel` of the warnings they
    give onto this module instead of the user's line."""
    for name in ENTRY_POINTS:
        if name not in cls.__dict__:
            setattr(cls, name, _entered(cls, name))
    return cls


def _entered(cls: type, name: str) -> Any:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with entered():
            return getattr(super(cls, self), name)(*args, **kwargs)

    run.__name__ = run.__qualname__ = name
    return run


def keep_package_unconverted() -> None:
    """Tells AutoGraph to run the package's code as written, as it runs
    Keras's (TensorFlow's `CONVERSION_RULES` list `keras`).

    Why: a loop of the user's own inside a `tf.function` calls our
    `Model.__call__`, and AutoGraph converted it and everything it
    called: `note_call`'s warning came from a generated file, after
    TensorFlow's "AutoGraph could not transform <function
    _formatwarnmsg> ... Please report this to the TensorFlow team" (the
    keras.io guide "Writing a training loop from scratch"; plain Keras
    prints neither). Our functions are library code, written for eager
    and graph mode alike; the package traces its own with
    `autograph=False`. The rule list is TensorFlow's private module; if
    it moves, conversion stays as it was."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:
        return
    if any(isinstance(rule, config.DoNotConvert)
           and rule.matches(_PACKAGE) for rule in config.CONVERSION_RULES):
        return
    config.CONVERSION_RULES = (
        tuple(config.CONVERSION_RULES) + (config.DoNotConvert(_PACKAGE),)
    )


def note_call(model: Any) -> None:
    """Warns once per model when `model` is called under a recording
    gradient tape outside every package entry point."""
    if _depth or model in _SAID or not record.could_possibly_record():
        return
    _SAID.add(model)
    outer = _plain_keras_trainer()
    if outer is not None:
        cls = type(outer)
        notices.must_tell(
            f"Model '{model.name}' is called in the training of "
            f"'{outer.name}', and '{outer.name}' is a plain Keras model "
            f"({cls.__module__}.{cls.__qualname__} derives from Keras's "
            "Model, not flexflow_keras's): it trains as plain Keras on one "
            "device, not under a searched strategy. Build it from "
            "flexflow_keras's Model or Sequential (`keras.Model` after "
            "`import flexflow_keras as keras`) to train under one.",
            stacklevel=3,
        )
        return
    notices.must_tell(
        f"Model '{model.name}' is called under a tf.GradientTape outside "
        "fit(): a training loop of your own runs as plain Keras on one "
        "device, not under a searched strategy. flexflow_keras "
        "parallelizes compile()/fit()/evaluate()/predict(); to train "
        "under a strategy, put the loop's step in the model's "
        "`train_step` and call fit() (keras.io's guide 'Customizing what "
        "happens in fit()').",
        stacklevel=3,
    )


def _plain_keras_trainer() -> Any:
    """The plain Keras model (not ours) whose fit, evaluate or
    `*_on_batch` is running further up the stack, if any.

    Why: its step calls our models under tapes, which looked like a loop
    of the user's own, so the notice named the wrong cause (keras.io's
    masked language model, whose class derived from `tf.keras.Model`
    before `tf.keras` followed the import, named its inner
    `Sequential`). Read only when a notice is given, once per model."""
    import sys

    import keras

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in ENTRY_POINTS:
            owner = frame.f_locals.get("self")
            # Ours: its class derives from one of this package (its
            # models module imports this one, so no import of it here).
            if isinstance(owner, keras.Model) and not any(
                    c.__module__.startswith(_PACKAGE + ".")
                    for c in type(owner).__mro__):
                return owner
        frame = frame.f_back
    return None
