"""`Model` and `Sequential`: Keras models whose compile() plans parallelism.

Only wires the stages together (graph -> search -> runtime); each stage
lives in its own module.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
from keras.models import clone_model, model_from_json  # noqa: F401
from keras.models import save_model  # noqa: F401
from keras.src import api_export


class Model(keras.Model):
    """A `keras.Model` that searches a parallel strategy at `compile()`."""


class Sequential(keras.Sequential):
    """A `keras.Sequential` that searches a parallel strategy at `compile()`."""


# Saved files name the Keras classes, so plain `keras.models.load_model`
# reads what flexflow_keras saves; `load_model` below maps them back.
api_export.REGISTERED_OBJS_TO_NAMES[Model] = "keras.Model"
api_export.REGISTERED_OBJS_TO_NAMES[Sequential] = "keras.Sequential"
_OWN_CLASSES = {
    "keras.Model": Model,
    "keras.Functional": Model,
    "keras.Sequential": Sequential,
}


@contextlib.contextmanager
def _keras_names_load_as_ours() -> Iterator[None]:
    """While loading, Keras's model class names resolve to our classes.

    Why: saved configs name `keras.Model`/`keras.Functional` with no
    registered name, so `custom_objects` is never consulted for them.
    """
    table = api_export.REGISTERED_NAMES_TO_OBJS
    saved = {name: table.get(name) for name in _OWN_CLASSES}
    table.update(_OWN_CLASSES)
    try:
        yield
    finally:
        for name, obj in saved.items():
            if obj is None:
                table.pop(name, None)
            else:
                table[name] = obj


def load_model(
    filepath: Any,
    custom_objects: dict | None = None,
    compile: bool = True,
    safe_mode: bool = True,
) -> keras.Model:
    """`keras.models.load_model`, returning flexflow_keras models.

    Reads files saved by plain Keras too.
    """
    # Plain Keras saves functional models as registered name `Functional`.
    objects = {"Functional": Model}
    objects.update(custom_objects or {})
    with _keras_names_load_as_ours():
        return keras.models.load_model(
            filepath,
            custom_objects=objects,
            compile=compile,
            safe_mode=safe_mode,
        )
