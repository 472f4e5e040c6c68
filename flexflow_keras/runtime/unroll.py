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
    saved = []
    rnns = [layer] + [
        getattr(layer, name, None) for name in ("forward_layer",
                                                "backward_layer")
    ]  # a Bidirectional wrapper runs two RNN layers
    for rnn in rnns:
        if rnn is None or not hasattr(rnn, "cell"):
            continue
        for name, value in (("unroll", True), ("use_cudnn", False)):
            if hasattr(rnn, name):
                saved.append((rnn, name, getattr(rnn, name)))
                setattr(rnn, name, value)
    try:
        yield
    finally:
        for rnn, name, value in saved:
            setattr(rnn, name, value)
