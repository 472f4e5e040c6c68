"""A `tf.distribute.MirroredStrategy` scope, taken over by the search.

keras.io's "Multi-GPU distributed training with TensorFlow" builds,
compiles and fits its model inside `tf.distribute.MirroredStrategy()
.scope()`: plain Keras then runs each step through `strategy.run` on one
replica per device, with mirrored variables. The script asks for what
the package exists to give (its training spread over the devices), so
the package gives it its way: while one of the model's steps runs (fit,
evaluate, predict, the `*_on_batch` calls), the scope is stepped out of
(the thread's strategy and variable-creator stacks emptied, put back
after), the model's, its optimizers' and its metrics' mirrored variables
become plain ones holding the same values, and the model trains under
its searched strategy, computing what one-device Keras computes. Said
once per model.

Only `MirroredStrategy` is taken over: it is one process's data
parallelism over its local devices, which any searched strategy
replaces. Other strategies say more than "use these devices" (one device
only, parameter servers, TPUs, several workers): a model built under one
trains as plain Keras under it, with a warning (`plain_reason`).

What stays TensorFlow's: a loop of the user's own through
`strategy.run` (never entered here) runs as plain Keras under the
strategy, as any loop of the user's own does (`own_loops`); once a model
was taken over, its variables are no longer mirrored.
"""

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from tensorflow.python.distribute import values as distribute_values
from tensorflow.python.framework import ops

# Models whose strategy scope was taken over (and said so).
_TAKEN: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _scope_strategy(model: Any) -> Any:
    """The `tf.distribute` strategy `model` was built under (Keras keeps
    it and runs every step through it), else the one whose scope the
    thread is in, else None."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    return strategy


def _taken_over(strategy: Any) -> bool:
    return type(strategy) is tf.distribute.MirroredStrategy


def plain_reason(model: Any) -> str | None:
    """Why `model` trains as plain Keras under a `tf.distribute` strategy
    it was built under, one the package does not take over; else None."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None or _taken_over(strategy):
        return None
    return (
        f"Model '{model.name}' trains as plain Keras under the script's "
        f"tf.distribute.{type(strategy).__name__}: it was built inside "
        "that strategy's scope, which hands the devices to TensorFlow's "
        "own replicas (a device of its choosing, parameter servers or "
        "workers). Build, compile and fit the model outside "
        "`strategy.scope()` to train under a searched strategy: "
        "flexflow_keras places it on the devices itself "
        "(a `tf.distribute.MirroredStrategy` scope is taken over so).")


@contextlib.contextmanager
def taken_over(model: Any, stacklevel: int = 4) -> Iterator[None]:
    """Runs the body outside the `MirroredStrategy` scope that `model`
    was built (or is run) in, the model's variables made plain first;
    elsewhere, as it is. A model taken over once is made plain again at
    each entry (metrics Keras builds at the first step, a recompile's
    optimizer made inside the scope). `stacklevel`: the notice's,
    counted from this generator to the script's line (through contextlib
    and the entry point)."""
    strategy = _scope_strategy(model)
    if not (_taken_over(strategy) or model in _TAKEN):
        yield
        return
    graph = ops.get_default_graph()
    modes = graph._distribution_strategy_stack
    creators = graph._variable_creator_stack
    graph._distribution_strategy_stack = []
    graph._variable_creator_stack = []
    try:
        _made_plain(model)
        if model not in _TAKEN:
            _TAKEN.add(model)
            warnings.warn(
                f"Model '{model.name}' runs inside the scope of the "
                f"script's tf.distribute.{type(strategy).__name__}: "
                "flexflow_keras trains it under its searched strategy "
                "instead of TensorFlow's replicas (its variables are no "
                "longer mirrored). Results are those of one-device "
                "Keras.", UserWarning, stacklevel=stacklevel)
        yield
    finally:
        graph._distribution_strategy_stack = modes
        graph._variable_creator_stack = creators


def _made_plain(model: Any) -> None:
    """`model`'s, its optimizers' and its metrics' mirrored variables
    replaced by plain ones holding their values; the strategy forgotten
    by the model and its optimizers (Keras's TensorFlow optimizer
    applies gradients through the strategy it was made under)."""
    optimizers = _optimizers(model)
    variables = list(model.variables) + list(model.metrics_variables)
    for each in optimizers + _compiled_metrics(model):
        variables += list(each.variables)
    renamed = {}  # an optimizer's key of a variable: old -> new
    for variable in {id(each): each for each in variables}.values():
        held = getattr(variable, "_value", None)
        if not isinstance(held, distribute_values.DistributedVariable):
            continue
        old = held._unique_id
        with tf.init_scope():
            variable._value = tf.Variable(
                held.read_value(), dtype=held.dtype,
                trainable=held.trainable, name=variable.name,
                aggregation=variable._map_aggregation(variable.aggregation),
                synchronization=variable._map_synchronization(
                    variable.synchronization))
        renamed[old] = variable._value._unique_id
    model._distribute_strategy = None
    for optimizer in optimizers:
        if _taken_over(getattr(optimizer, "_distribution_strategy", None)):
            optimizer._distribution_strategy = tf.distribute.get_strategy()
        if renamed:
            _rekeyed(optimizer, renamed)


def _rekeyed(optimizer: Any, renamed: dict) -> None:
    """`optimizer`'s tables keyed by its variables' keys (Keras's
    TensorFlow optimizer keys a variable by its `tf.Variable`'s unique
    id) moved to the new variables' keys: an optimizer built before the
    variables were made plain (a loaded model's) finds them still."""
    for name in ("_trainable_variables_indices", "_var_to_optimizer_idx"):
        table = getattr(optimizer, name, None)
        if isinstance(table, dict):
            setattr(optimizer, name, {renamed.get(key, key): value
                                      for key, value in table.items()})
    excluded = getattr(optimizer, "_exclude_from_weight_decay", None)
    if isinstance(excluded, set):
        optimizer._exclude_from_weight_decay = {
            renamed.get(key, key) for key in excluded}
    if hasattr(optimizer, "_exclude_from_weight_decay_cache"):
        optimizer._exclude_from_weight_decay_cache = {}


def _compiled_metrics(model: Any) -> list[Any]:
    """The metric objects given to `compile()`: Keras builds its
    compiled metrics at the first step, and until then they are none of
    the model's `metrics_variables`, while the script made them (and
    their variables, mirrored) inside the scope."""
    import keras

    compiled = getattr(model, "_compile_metrics", None)
    given = [getattr(compiled, "_user_metrics", None),
             getattr(compiled, "_user_weighted_metrics", None)]
    return [each for each in keras.tree.flatten(given)
            if isinstance(each, keras.metrics.Metric)]


def _optimizers(model: Any) -> list[Any]:
    """The Keras optimizers `model` holds: its `optimizer`, those kept as
    attributes (a GAN's two), and the optimizers they wrap (a
    `LossScaleOptimizer`'s inner one)."""
    import keras

    found = []
    pending = [getattr(model, "optimizer", None)] + list(vars(model).values())
    while pending:
        each = pending.pop()
        if (isinstance(each, keras.optimizers.Optimizer)
                and all(each is not known for known in found)):
            found.append(each)
            pending.append(getattr(each, "inner_optimizer", None))
    return found
