"""A digest of the code a layer class runs, for keys of what is kept on disk.

Why: a verdict kept per machine under a layer's class name and config
outlives an edit of the class. The probe told a user whose layer DTensor
could not run that it still could not, with the old error and a line
number no longer in the script, after they had rewritten the call as
the notice invited (`runtime/probe.py`). The digest covers the code of
the class and of its bases outside Keras and TensorFlow: their methods,
the functions nested in them, and the functions and classes of the
user's they name from their module. Not covered: values a method reads
from a closure or a global that is not code (a flag), which keep the
key as it was.
"""

import functools
import hashlib
import inspect
import types
from typing import Any

# Modules whose code does not change under a script: installed
# libraries the package itself is tied to.
_LIBRARIES = ("keras", "tensorflow", "tf_keras", "flexflow_keras",
              "numpy", "builtins", "abc", "typing")


@functools.lru_cache(maxsize=1024)
def class_digest(cls: type) -> str | None:
    """16 hex digits naming the code of `cls` (module docstring); None
    for a class whose code is all the libraries' (a Keras layer), so
    that keys of those stay as they were. Kept per class object: an
    edited class, defined again, is another object."""
    digest = hashlib.sha1()
    if not _add_class(digest, cls, set()):
        return None
    return digest.hexdigest()[:16]


def _from_library(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in _LIBRARIES


def _add_class(digest: Any, cls: type, seen: set[int]) -> bool:
    """Adds the code of `cls` and its bases outside the libraries;
    whether there was any."""
    added = False
    for klass in cls.__mro__:
        if id(klass) in seen or _from_library(klass):
            continue
        seen.add(id(klass))
        added = True
        digest.update(klass.__qualname__.encode())
        for name, value in sorted(vars(klass).items()):
            function = _function_of(value)
            if function is not None:
                digest.update(name.encode())
                _add_function(digest, function, seen)
    return added


def _function_of(value: Any) -> Any:
    """The Python function behind a method, static or class method or
    property getter; None for anything else."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    if value is None:
        return None
    value = inspect.unwrap(value)
    return value if isinstance(value, types.FunctionType) else None


def _add_function(digest: Any, function: Any, seen: set[int]) -> None:
    if id(function) in seen or _from_library(function):
        return
    seen.add(id(function))
    _add_code(digest, function.__code__, function.__globals__, seen)


def _add_code(digest: Any, code: types.CodeType, scope: dict,
              seen: set[int]) -> None:
    """The bytecode, names and constants of `code` (line numbers left
    out: a line added above a class does not change what it runs), its
    nested functions', and the code of what it names from `scope`."""
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _add_code(digest, const, scope, seen)
        elif isinstance(const, frozenset):  # `in {...}`: order by value
            digest.update(repr(sorted(map(repr, const))).encode())
        else:
            digest.update(repr(const).encode())
    for name in code.co_names:
        value = scope.get(name)
        if isinstance(value, types.FunctionType):
            _add_function(digest, value, seen)
        elif isinstance(value, type):
            _add_class(digest, value, seen)
