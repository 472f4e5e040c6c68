"""What the DTensor runtime cannot yet run exactly as Keras does.

Why: a strategy must compute what plain Keras computes. A model using
one of these features would train differently under the runtime (its
regularization losses or masks dropped, its dtypes changed), so the
caller trains it as plain Keras instead and says why.
"""

from typing import Any


def unsupported_features(model: Any) -> list[str]:
    """Human-readable reasons the runtime would not match Keras; [] if none."""
    from flexflow_keras.runtime.optimizers import check_supported

    reasons = []
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        try:
            check_supported(optimizer)
        except NotImplementedError as error:
            reasons.append(f"its optimizer is not supported ({error})")
    for layer in model._flatten_layers(include_self=False):
        name = f"layer '{layer.name}'"
        regularizers = [
            attr for attr in vars(layer)
            if attr.endswith("regularizer") and getattr(layer, attr)
        ]
        if regularizers:
            reasons.append(f"{name} has {', '.join(sorted(regularizers))}")
        if getattr(layer, "mask_zero", False) or type(layer).__name__ in (
            "Masking",
        ):
            reasons.append(f"{name} produces a mask")
        policy = getattr(layer, "dtype_policy", None)
        if policy is not None and (
            policy.compute_dtype != policy.variable_dtype
        ):
            reasons.append(
                f"{name} uses mixed precision ({policy.name})"
            )
    return reasons
