"""Recurrent layers unrolled while a DTensor step is traced."""

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def unrolled(layer: Any) -> Iterator[None]:
    """Recurrent layers run unrolled, without cuDNN, while traced.

    Why: DTensor has no layout propagation for the while-loop TensorLists
    (`tf.TensorListStack`) of a rolled RNN, nor for cuDNN RNN kernels; the
    unrolled loop is plain ops with the same arithmetic.
    """
    saved = {}
    for name, value in (("unroll", True), ("use_cudnn", False)):
        if hasattr(layer, name) and hasattr(layer, "cell"):
            saved[name] = getattr(layer, name)
            setattr(layer, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(layer, name, value)
