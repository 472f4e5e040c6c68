"""What FLOP rules share: the count's types, per-element constants and
small helpers.

Its own module so that `op_specs` (the rules of most layers) and
`op_specs_sequence` (attention and RNNs) both build on it without
importing each other. The counting convention is in `op_specs`'s
docstring.
"""

from typing import Any

Shape = tuple[int, ...]
Shapes = tuple[Shape, ...]

Flops = tuple[float, float, bool]  # forward, backward, flops_exact

SOFTMAX_FLOPS = (5, 4)  # per element: forward, backward
DROPOUT_FLOPS = (2, 1)


def activation_flops(fn: Any) -> tuple[int, int]:
    """Per-element (forward, backward) FLOPs of an activation function."""
    name = getattr(fn, "__name__", "")
    if fn is None or name == "linear":
        return (0, 0)
    if name in ("softmax", "log_softmax"):
        return SOFTMAX_FLOPS
    return (1, 1)


def spec(forward: float, backward: float) -> Flops:
    """An exact count: (forward, backward, flops_exact)."""
    return float(forward), float(backward), True


def call_arg(arguments: Any, position: int, name: str) -> Any:
    """A call's argument by position or keyword; None when absent."""
    if arguments is None:
        return None
    if len(arguments.args) > position:
        return arguments.args[position]
    return arguments.kwargs.get(name)
