"""TensorFlow's C++ log level, lowered after TensorFlow has loaded.

TensorFlow reads `TF_CPP_MIN_LOG_LEVEL` once, when it loads, and hands it
to Abseil's logging, which every C++ `LOG(INFO)` line then checks
(DTensor's two `dtensor_device.cc` lines per SPMD expansion among them).
A script that imports TensorFlow before this package (`import tensorflow
as tf` on its first line, as most published scripts do) has loaded it
with the default, INFO. Abseil's threshold can still be set while the
process runs: `absl::SetMinLogLevel`, which TensorFlow's framework
library exports. Its C++ name carries Abseil's release
(`absl::lts_YYYYMMDD::`), so it is found in the library's symbol names
rather than written here.

Everything is best effort: where the library or the symbol is not found,
nothing changes and the INFO lines show, as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re

# `absl::[lts_YYYYMMDD::]SetMinLogLevel(absl::LogSeverityAtLeast)`,
# mangled; the enum is passed as an int.
_SET_MIN_LOG_LEVEL = re.compile(
    rb"_ZN4absl(?:\d+lts_\d+)?14SetMinLogLevelENS\d*_?18LogSeverityAtLeastE")

_FRAMEWORK = "libtensorflow_framework.so.2"


def _framework_path() -> str | None:
    """Path of TensorFlow's framework library, if TensorFlow is installed
    the usual way (the shared library beside its package)."""
    import tensorflow as tf  # already loaded where this is called
    path = os.path.join(os.path.dirname(tf.__file__), _FRAMEWORK)
    return path if os.path.exists(path) else None


def _symbol(path: str) -> str | None:
    """The mangled name of `SetMinLogLevel` in the library at `path`."""
    with open(path, "rb") as f, mmap.mmap(
            f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        found = _SET_MIN_LOG_LEVEL.search(data)
        return found.group(0).decode("ascii") if found else None


def set_min_log_level(level: int) -> bool:
    """Sets the loaded TensorFlow's C++ log threshold to `level` (0 INFO,
    1 WARNING, 2 ERROR, 3 FATAL, as `TF_CPP_MIN_LOG_LEVEL`). Returns
    whether it was set."""
    try:
        path = _framework_path()
        name = path and _symbol(path)
        if not name:
            return False
        function = getattr(ctypes.CDLL(path), name)
        function.argtypes = [ctypes.c_int]
        function.restype = None
        function(level)
        return True
    except Exception:  # noqa: BLE001 - a quieter console is not worth a
        return False  # failed import: anything unexpected leaves it as is
