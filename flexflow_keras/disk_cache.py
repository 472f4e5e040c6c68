"""JSON files of measured facts: op costs, probed layers, the live machine.

Each is a dict keyed by what was measured, kept in `CACHE_DIR` so that a
second run measures nothing. Written whole to a temporary file and
renamed, so a reader (another process) never sees half a file.
"""

import json
import os

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "flexflow_keras")


def read(path: str) -> dict:
    """The entries at `path`; {} when absent or unreadable (the caller
    measures again)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write(path: str, entries: dict) -> None:
    """Writes `entries` atomically; raises OSError when `path` cannot be
    written (callers that can measure again ignore it)."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(entries, f, indent=0, sort_keys=True)
    os.replace(tmp, path)
