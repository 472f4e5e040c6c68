"""What every DTensor trace of a model's step runs under: the step's own
(`model_step.py`) and the probe of a layer (`probe.py`), which must run
the layer as the step will.

Why one place: the probe traced layers under fewer rules than the step,
and each rule the step had and the probe lacked made a layer the step
runs look unrunnable, or crash: TensorFlow's stateful draws (keras.io's
ShiftViT's DropPath, probed unrunnable, so its model trained as plain
Keras) and TensorFlow's own cond (Keras's SpectralNormalization, a
segmentation fault in the probe).
"""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from flexflow_keras.runtime import deferred, op_rules, stateful_draws


@contextlib.contextmanager
def traced_as_steps(
    mesh: Any, variables: Sequence[Any], random_state: Any, kind: str,
    unseeded_key: int,
) -> Iterator[None]:
    """While a step on `mesh` is traced: `keras.ops.cond` runs both
    branches and selects (`deferred.conds_selected`, over the step's
    `variables`), ops DTensor has no rule for are replaced
    (`op_rules.substitutes`), and TensorFlow's stateful draws run as
    their stateless twins on the counters in `random_state`
    (`stateful_draws.drawing`, for a step of `kind`)."""
    with deferred.conds_selected(variables), op_rules.substitutes(mesh), \
            stateful_draws.drawing(random_state, mesh, kind, unseeded_key):
        yield
