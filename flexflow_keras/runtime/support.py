"""Why a model must run its own training step, in words for warnings.

`own_step_reasons`: a step or loss override, losses beyond the compiled
loss and the weights' regularizers (an activity regularizer adds one
while the layer is called), masks, mixed precision, an optimizer or
option only Keras's own `apply` runs, a subclassed model. That step runs
as one DTensor function on one device mesh (`model_step.py`), so such a
model's strategies keep every op on one mesh. A model with none of these
may also use strategies over several meshes (`step.py`, Keras's default
step layer by layer).

(Ops DTensor has no rule for run replicated or are replaced:
`op_rules.py`. An op found missing only when a step is traced hands the
model to plain Keras: `fallback.py`.)
"""

from typing import Any

import keras


def own_step_reasons(model: Any) -> list[str]:
    """Why `model` must run its own training step; [] if Keras's default
    step, layer by layer, computes exactly what it does."""
    from flexflow_keras.keras_graph import (
        STEP_METHODS, defined_outside_keras, is_subclassed,
    )
    from flexflow_keras.runtime.optimizers import check_supported

    reasons = ["it is a subclassed model"] if is_subclassed(model) else []
    reasons += [
        f"it overrides {method}"
        for method in STEP_METHODS
        if defined_outside_keras(type(model), method)
    ]
    if getattr(model, "_compile_loss", None) is None:
        reasons.append("it was compiled without a loss")
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        try:
            check_supported(optimizer)
        except NotImplementedError:
            reasons.append(
                f"its optimizer {type(optimizer).__name__} runs Keras's own "
                "apply"
            )
    for layer in model._flatten_layers(include_self=False):
        name = f"layer '{layer.name}'"
        # A weight's regularizer is the layer-by-layer step's too
        # (`step.Executor._penalty`); an activity regularizer is a loss
        # added while the layer is called, which only the model's own
        # step counts.
        if getattr(layer, "activity_regularizer", None) is not None:
            reasons.append(f"{name} has activity_regularizer")
        if getattr(layer, "mask_zero", False) or isinstance(
            layer, keras.layers.Masking
        ):
            reasons.append(f"{name} produces a mask")
        if getattr(layer, "stateful", False):
            # Its state between batches is in variables the model does
            # not track (`RNN.states`): the layer-by-layer step, which
            # carries only tracked state, started each batch from zeros.
            reasons.append(f"{name} is stateful")
        policy = getattr(layer, "dtype_policy", None)
        if policy is not None and (
            policy.compute_dtype != policy.variable_dtype
        ):
            reasons.append(f"{name} uses mixed precision ({policy.name})")
    return reasons
