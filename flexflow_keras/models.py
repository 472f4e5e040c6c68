"""`Model` and `Sequential`: Keras models whose compile() plans parallelism.

Only wires the stages together (graph -> search -> runtime); each stage
lives in its own module.
"""

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
_OWN_CLASSES = {"Model": Model, "Functional": Model, "Sequential": Sequential}


def load_model(
    filepath: Any,
    custom_objects: dict | None = None,
    compile: bool = True,
    safe_mode: bool = True,
) -> keras.Model:
    """`keras.models.load_model`, returning flexflow_keras models."""
    objects = dict(_OWN_CLASSES)
    objects.update(custom_objects or {})
    return keras.models.load_model(
        filepath, custom_objects=objects, compile=compile, safe_mode=safe_mode
    )
