"""Mirrors the public Keras 3 API under `flexflow_keras`.

Why: `import flexflow_keras as keras` must keep every `keras.X` and
`import keras.X.Y` of an existing script working with the same meaning,
while `Model`, `Sequential` and `models` are ours.
"""

import sys
import types
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
