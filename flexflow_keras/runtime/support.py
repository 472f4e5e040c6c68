"""What the DTensor runtime cannot yet run exactly as Keras does.

Why: a strategy must compute what plain Keras computes. A model using
one of these features would train differently under the runtime (its
regularization or `add_loss` losses or masks dropped, its dtypes
changed), so the caller trains it as plain Keras instead and says why.
"""

from typing import Any

import numpy as np

from flexflow_keras.graph import function_of


# Layer types TensorFlow 2.21's DTensor cannot train (measured: a data
# parallel fit of a one-layer model on 4 virtual CPUs).
_NO_DTENSOR = {
    "DepthwiseConv1D": "its gradient op DepthwiseConv2dNativeBackpropFilter",
    "DepthwiseConv2D": "its gradient op DepthwiseConv2dNativeBackpropFilter",
    "SeparableConv1D": "its gradient op DepthwiseConv2dNativeBackpropFilter",
    "SeparableConv2D": "its gradient op DepthwiseConv2dNativeBackpropFilter",
}


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
        kind = type(layer).__name__
        if kind in _NO_DTENSOR:
            reasons.append(
                f"{name} is a {kind}: {_NO_DTENSOR[kind]} has no DTensor "
                "layout rule in TensorFlow 2.21"
            )
        dilation = getattr(layer, "dilation_rate", 1)
        if kind not in _NO_DTENSOR and any(
            d != 1 for d in (dilation if isinstance(dilation, tuple)
                             else (dilation,))
        ):
            reasons.append(
                f"{name} is a dilated convolution (dilation_rate="
                f"{dilation}): its SpaceToBatchND op has no DTensor layout "
                "rule in TensorFlow 2.21"
            )
        if kind == "Bidirectional":
            reasons.append(
                f"{name} is Bidirectional, which crashes TensorFlow 2.21's "
                "DTensor (segmentation fault)"
            )
        regularizers = [
            attr for attr in vars(layer)
            if attr.endswith("regularizer") and getattr(layer, attr)
        ]
        if regularizers:
            reasons.append(f"{name} has {', '.join(sorted(regularizers))}")
        if getattr(layer, "mask_zero", False) or kind == "Masking":
            reasons.append(f"{name} produces a mask")
        policy = getattr(layer, "dtype_policy", None)
        if policy is not None and (
            policy.compute_dtype != policy.variable_dtype
        ):
            reasons.append(
                f"{name} uses mixed precision ({policy.name})"
            )
    return reasons + _add_loss_reasons(model, " ".join(reasons))


def _add_loss_reasons(model: Any, reported: str) -> list[str]:
    """Reasons for the layers whose call adds a loss (`add_loss`), except
    those `reported` already names (regularizers add losses too).

    Nothing in a layer's config says so, and the symbolic call that
    built the model dropped such losses, so this runs one forward pass
    on zeros (batch 1, or the model's fixed batch) in Keras's stateless
    mode: no variable, moving statistic or seed changes.
    """
    import keras

    def zeros(tensor: Any) -> np.ndarray:
        shape = tuple(1 if n is None else n for n in tensor.shape)
        return np.zeros(shape, dtype=tensor.dtype)

    try:
        # A Sequential built from a shape has inputs only on its Functional.
        inputs = keras.tree.map_structure(zeros, function_of(model).input)
        _, _, losses = model.stateless_call(
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            inputs, training=True, return_losses=True,
        )
        names = [  # read before `_clear_losses` below forgets them
            layer.name
            for layer in model._flatten_layers(include_self=False)
            if getattr(layer, "_loss_ids", None)
        ]
    except Exception as error:  # noqa: BLE001 - unknown: assume the worst
        return [
            "its layers could not be checked for add_loss() (a forward "
            f"pass on zeros raised {type(error).__name__}: {error})"
        ]
    finally:
        model._clear_losses()
    if not losses:
        return []
    if not names:
        return ["its call adds a loss (add_loss())"]
    return [
        f"layer '{name}' calls add_loss()" for name in names
        if f"layer '{name}' " not in reported
    ]
