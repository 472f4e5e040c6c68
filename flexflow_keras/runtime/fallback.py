"""Plain Keras from the step where DTensor turns out to lack an op's rule.

Which TensorFlow ops a model's step uses is known only when the step is
first traced, so this is where a model with such an op (say
`keras.ops.flip`: `ReverseV2`) leaves its strategy.
"""

import re
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import error_interpolation

from flexflow_keras import settings
from flexflow_keras.search_space import one_mesh_data_parallel

# What TensorFlow 2.21's DTensor says when an op has no SPMD rule.
_NO_DTENSOR_RULE = re.compile(
    r"'(?:tf\.)?(\w+)' op does not implement layout propagation"
)
# ... and when an op's expansion contradicts its layout (ArgMax of a
# replicated input with a split output: "Expected shape: <128,3> got
# shape: <32,3>"); the op follows in the MLIR dump.
_INCONSISTENT = re.compile(
    r"op output inconsistent with the provided layout[\s\S]*?"
    r"see current operation: %\S+ = \"tf\.(\w+)\""
)


# What TensorFlow says once a step failed while the other devices waited
# in a collective: it aborts that device group's collectives for the life
# of the process ("Restart your program to reset"), and DTensor's next
# steps over those devices are cancelled before they start, then fail on
# the aborted collectives (measured on TF 2.21; calling again did not
# help).
_COLLECTIVES_ABORTED = re.compile(
    r"Collective ops is aborted by|group is cancelled"
    r"|Function was cancelled before it was started"
)


def collectives_aborted(error: Exception) -> bool:
    """Whether `error` says DTensor's steps can no longer run over these
    devices in this process (an earlier step failed while they
    waited)."""
    return (isinstance(error, tf.errors.CancelledError)
            and _COLLECTIVES_ABORTED.search(str(error)) is not None)


def failed_while_running(error: Exception) -> bool:
    """Whether a DTensor step's `error` came from a kernel as the step ran
    (TensorFlow names the node: "[[{{node ...}}]]"), not from DTensor's
    expansion of the step.

    Why it matters: such a step may have computed wrongly before it
    failed (rows selected by `tf.boolean_mask` over a split batch:
    "indices[3] = 8 is not in [0, 8)"), and traced another way it may
    run without failing and still compute wrongly (measured: a loss 5%
    off plain Keras's, unsaid). So it is not traced again; Keras runs the
    batch instead (`fall_back`), which also tells the user's own error
    (a label outside the classes) from DTensor's."""
    return (isinstance(error, tf.errors.OpError)
            and "[[{{node " in str(error))


def op_to_replicate(error: Exception) -> str | None:
    """The TensorFlow op a DTensor `error` blames, which DTensor's
    per-op replicated switch may let run (`op_rules.enable`): one with
    no layout rule, or whose expansion contradicted its layout; None
    when the error names no such op."""
    for pattern in (_NO_DTENSOR_RULE, _INCONSISTENT):
        found = pattern.search(str(error))
        if found is not None:
            return found.group(1)
    return None


def fall_back(
    model: Any, kind: str, error: Exception, data: Any, half_done: bool,
    first_run: bool = False,
) -> Any:
    """Plain Keras from now on, starting with `data`, if `error` is
    DTensor lacking a rule for some op, or the first run of a step
    failed in DTensor (`first_run`); else re-raises it.

    No value was changed by the failed step, and detaching copies out
    what earlier steps trained (weights and optimizer state), so Keras
    goes on from exactly there. Where Keras fails on the same batch, the
    error was not DTensor's: Keras raises it and the strategy stays.

    Args:
        model: The `StrategyTrainer` model.
        kind: `train`, `test` or `predict`.
        error: What the step raised.
        data: The batch (an iterator of batches) to redo in Keras.
        half_done: Whether part of this training step already updated
            weights (several meshes): then it cannot be redone.
        first_run: Whether this was the step function's first run (one
            function whose writes come at its end: all or nothing).
    """
    if isinstance(error, tf.errors.OpError):
        # Where DTensor's device is asynchronous (a script that used
        # DTensor before the import), a failed run's error stays pending.
        context.async_clear_error()
    # Over several DTensor clients an aborted group means a lost host:
    # the error goes on, for the fit to name it (`clients.lost_host`).
    if (collectives_aborted(error) and not half_done
            and settings.dtensor_clients() is None):
        return to_plain_keras(
            model, kind,
            "an earlier step failed while it ran (see its error), and "
            "TensorFlow cancels DTensor's later steps over these devices "
            "in this process. Restart the script to train under the "
            "strategy again", data,
        )
    found = _NO_DTENSOR_RULE.search(str(error))
    if found is None and not first_run:
        raise error
    if found is None:
        first_line = str(error).strip().splitlines()[0][:300]
        return _to_plain_keras_unless_it_fails_too(
            model, kind,
            "TensorFlow's DTensor could not run its first "
            f"{kind} step under the strategy ({type(error).__name__}: "
            f"{first_line})", data,
        )
    if kind == "train" and half_done:
        # Later segments already applied this step: redoing it in
        # Keras would apply it twice to them.
        raise RuntimeError(
            f"TensorFlow's DTensor has no layout rule for the "
            f"'{found.group(1)}' op of model '{model.name}', found "
            "half-way through a training step under a strategy with "
            "several device meshes, so the step cannot be redone in "
            "plain Keras. Train this model with plain `keras`, or with "
            "`compile(search_budget=0)` (one mesh)."
        ) from error
    return to_plain_keras(
        model, kind,
        f"TensorFlow's DTensor has no layout rule for its "
        f"'{found.group(1)}' op, so no parallel strategy can run it", data,
    )


def to_plain_keras(model: Any, kind: str, reason: str, data: Any) -> Any:
    """Plain Keras on one device from now on, starting with `data`,
    after a step that changed nothing; says `reason` once."""
    model._strategy_failed(_plain_keras_from_now_on(model, reason))
    getattr(model, f"make_{kind}_function")(force=True)
    _train_function_kept(model, kind)
    return getattr(model, f"{kind}_function")(data)


def _plain_keras_from_now_on(model: Any, reason: str) -> str:
    """The warning of a model handed to plain Keras for `reason`."""
    return (f"Model '{model.name}' trains as plain Keras on one device "
            f"from now on: {reason.rstrip('.')}. Results are those of "
            "plain Keras.")


def _to_plain_keras_unless_it_fails_too(
    model: Any, kind: str, reason: str, data: Any
) -> Any:
    """`to_plain_keras`, if Keras's own step runs `data`; if it fails too,
    the batch or the user's code is at fault, not DTensor (a label
    outside the classes, a shape the model refuses): the model keeps its
    strategy and Keras's error is raised, the one a plain Keras user
    would see. Once the user mends the data, the next fit trains under
    the strategy again; before, one bad batch sent the model to plain
    Keras for good."""

    def keras_step():
        getattr(model, f"make_{kind}_function")(force=True)
        return getattr(model, f"{kind}_function")(data)

    try:
        outputs = model._run_without_strategy(keras_step)
    except Exception as keras_error:  # noqa: BLE001 - Keras's, for the user
        raise keras_error from None
    # Detached already: Keras's functions made above stay.
    model._strategy_failed(_plain_keras_from_now_on(model, reason))
    _train_function_kept(model, kind)
    return outputs


def to_data_parallel(
    model: Any, graph: Any, parts: int, kind: str, reason: str, data: Any
) -> Any:
    """Data parallelism over `parts` devices from now on, starting with
    `data`, after a step found while tracing (nothing updated) that its
    strategy cannot compute it right; says `reason` once."""
    model._strategy_replaced(
        graph, one_mesh_data_parallel(graph, parts), reason
    )
    _train_function_kept(model, kind)
    return getattr(model, f"make_{kind}_function")(force=True)(data)


def _train_function_kept(model: Any, kind: str) -> None:
    """Makes the train function anew after a test or predict step
    handed the model over. Why: when that happens during a `fit`'s
    validation, the fit reads `model.train_function` at its next step
    without making it (`TypeError: 'NoneType' object is not
    callable`)."""
    if kind != "train" and model.train_function is None:
        model.make_train_function()


def _parse_message_linear(message: str) -> tuple[str, list, list]:
    """TensorFlow's `error_interpolation.parse_message`, in linear time.

    TensorFlow scans an error message with `(?P<sep>.*?)(?P<tag>...)`,
    which is quadratic in the message's length when it holds no tag.
    DTensor's errors carry a dump of the whole MLIR module (megabytes for
    a Transformer step): a step whose first run failed in DTensor spent
    over 10 minutes there before the fallback could act (measured, a
    miniature GPT). Same result: each tag found from where the last one
    ended, the text before it kept as TensorFlow keeps it.
    """
    pieces, func_tags, node_tags = [], [], []
    pos = 0
    for match in _TAG_PATTERN.finditer(message):
        tag = error_interpolation._ParseTag(
            match.group("type"), match.group("name")
        )
        before = message[pos:match.start()]
        if tag.type == "function_node":
            pieces.append(before)
            func_tags.append(tag)
        else:
            pieces.append(before + match.group())
            node_tags.append(tag)
        pos = match.end()
    pieces.append(message[pos:])
    return "".join(pieces), func_tags, node_tags


_TAG_PATTERN = re.compile(error_interpolation._TAG_REGEX, re.DOTALL)
error_interpolation.parse_message = _parse_message_linear
