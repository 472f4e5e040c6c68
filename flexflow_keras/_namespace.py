"""Mirrors the public Keras 3 API under `flexflow_keras`.

Why: `import flexflow_keras as keras` must keep every `keras.X` and
`import keras.X.Y` of an existing script working with the same meaning,
while `Model`, `Sequential` and `models` are ours, and what builds or
loads a model (`applications`, `saving.load_model`) returns ours.
"""

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

# Keras submodules that are not public API.
_PRIVATE = frozenset({"src", "api"})


def public_names(module: types.ModuleType) -> list[str]:
    return [n for n in dir(module) if not n.startswith("_")]


def mirror(namespace: dict[str, Any], package: str, own: set[str]) -> None:
    """Copies keras's public names into `namespace`; aliases submodules.

    Args:
        namespace: The package's `globals()`.
        package: The package name (`flexflow_keras`).
        own: Names the package defines itself and keeps.
    """
    import keras

    for name in public_names(keras):
        if name in own or name in _PRIVATE:
            continue
        value = getattr(keras, name)
        namespace[name] = value
        if isinstance(value, types.ModuleType):
            _alias_modules(value, f"{package}.{name}")


def _alias_modules(module: types.ModuleType, alias: str) -> None:
    """Registers `module` and its public submodules under `alias`."""
    if alias in sys.modules:
        return
    sys.modules[alias] = module
    for name in public_names(module):
        value = getattr(module, name)
        if isinstance(value, types.ModuleType) and value.__name__.startswith(
            module.__name__ + "."
        ):
            _alias_modules(value, f"{alias}.{name}")


def mirror_with(
    namespace: dict[str, Any], package: str, name: str,
    replace: Callable[[str, Any], Any],
) -> None:
    """Mirrors keras.`name` as a module tree of our own, in which each
    public value is `replace(value_name, value)`.

    Why: `keras.applications.ResNet50()` and `keras.saving.load_model()`
    return plain Keras models, which would train unparallelized. A value
    reached by several paths (`applications.VGG16`,
    `applications.vgg16.VGG16`) is replaced once, so both are one object.
    """
    import keras

    memo: dict[int, tuple[Any, Any]] = {}  # one replacement per value

    def replace_once(value_name: str, value: Any) -> Any:
        if id(value) not in memo:  # the value is kept alive in memo
            memo[id(value)] = (value, replace(value_name, value))
        return memo[id(value)][1]

    namespace[name] = _copy_module(
        getattr(keras, name), f"{package}.{name}", replace_once
    )


def _copy_module(
    module: types.ModuleType, alias: str, replace: Callable[[str, Any], Any]
) -> types.ModuleType:
    copy = sys.modules.get(alias)
    if copy is not None:
        return copy
    copy = types.ModuleType(alias, module.__doc__)
    sys.modules[alias] = copy
    for name in public_names(module):
        value = getattr(module, name)
        if isinstance(value, types.ModuleType) and value.__name__.startswith(
            module.__name__ + "."
        ):
            value = _copy_module(value, f"{alias}.{name}", replace)
        else:
            value = replace(name, value)
        setattr(copy, name, value)
    return copy


def returning(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A decorator: the function, with `convert` applied to its result."""

    def decorate(function: Any) -> Any:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return convert(function(*args, **kwargs))

        return wrapper

    return decorate


# What `tf.keras` gets from us: the names whose plain Keras values would
# build or load a model that trains unparallelized. `tf.keras.layers`
# stays TensorFlow's flavour (it holds a few legacy names ours lacks;
# its classes are Keras's own, as ours are); `tf.keras` has no `saving`.
TF_KERAS_ROUTED = ("Model", "Sequential", "models", "applications", "utils")


def route_tf_keras(namespace: dict[str, Any]) -> None:
    """Points TensorFlow's `tf.keras` at our model classes and builders.

    Why: with Keras 3 installed, `tf.keras` *is* Keras
    (`keras._tf_keras.keras`), so a script whose imports were changed to
    flexflow_keras still reached plain Keras through the attribute:
    keras.io's masked language model subclasses `tf.keras.Model` and
    trained as plain Keras on one device, and the only word of it was
    the own-loop notice about a nested `Sequential` of ours. After
    `import flexflow_keras`, `tf.keras.Model`, `tf.keras.Sequential`,
    `tf.keras.models`, `tf.keras.applications` and `tf.keras.utils` are
    ours. `import keras` still gives plain Keras, untouched. A `tf.keras`
    that is another Keras (`TF_USE_LEGACY_KERAS` with `tf_keras`) is left
    alone.
    """
    import keras
    import tensorflow as tf

    tf_keras = tf.keras
    # Loads the lazy module; Keras 3's flavour holds Keras's own Model.
    if getattr(tf_keras, "Model", None) is not keras.Model:
        return
    for name in TF_KERAS_ROUTED:
        # Through the lazy loader when it is one: it sets the module's
        # attribute and its own copy alike.
        setattr(tf_keras, name, namespace[name])
