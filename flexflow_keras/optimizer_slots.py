"""How many state variables an optimizer keeps per weight, by name.

One place for these facts: the planner prices optimizer memory with
them (`optimizer_slots`) and the runtime's update rules
(`runtime/optimizers.py`) name the slots it keeps. No TensorFlow.
"""

from typing import Any

# The optimizers whose update rules the runtime writes itself (the
# layer-by-layer step over several meshes, `runtime/optimizers.py`).
SUPPORTED = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad")

# Optimizer state per weight element, for the simulator's memory figures,
# of the optimizers the runtime does not run (it names its own slots).
_SLOTS = {
    "Adamax": 2, "Nadam": 2, "Adadelta": 2, "Ftrl": 2, "Lion": 1,
    "Lamb": 2, "Muon": 1,
}


def slot_names(optimizer: Any) -> tuple[str, ...]:
    """Slot variables per weight of a supported optimizer, by name."""
    name = type(optimizer).__name__
    if name == "SGD":
        return ("momentum",) if optimizer.momentum != 0 else ()
    if name in ("Adam", "AdamW"):
        return ("m", "v", "v_hat") if optimizer.amsgrad else ("m", "v")
    if name == "RMSprop":
        slots = ["velocity"]
        if optimizer.momentum > 0:
            slots.append("momentum")
        if optimizer.centered:
            slots.append("average_grad")
        return tuple(slots)
    return ("accumulator",)  # Adagrad


def optimizer_slots(optimizer: Any) -> int:
    """Optimizer slot variables per weight (0 for plain SGD)."""
    name = type(optimizer).__name__
    if name in SUPPORTED:
        return len(slot_names(optimizer))
    return _SLOTS.get(name, 2)
