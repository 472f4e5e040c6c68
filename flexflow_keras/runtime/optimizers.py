"""Optimizer update rules on DVariables for the layer-by-layer step.

Only `step.Executor` (strategies over several meshes) uses these: its
backward functions, one per segment, each update their own weights, so
Keras's `apply` (one call over every weight) cannot run there. On one
mesh the model's own step runs Keras's optimizer itself
(`model_step.py`). The rules of SGD (momentum, nesterov), Adam (amsgrad),
AdamW, RMSprop (momentum, centered) and Adagrad are written with the same
operation order as `keras/src/optimizers/*.py`. Learning rate and step
come in each step from the Keras optimizer, so schedules and callbacks
that set `optimizer.learning_rate` take effect. A model with another
optimizer or option plans on one mesh (`support.own_step_reasons`);
attached by hand over several meshes, it raises `NotImplementedError` at
the first step.
"""

from typing import Any

import tensorflow as tf
from tensorflow.experimental import dtensor

from flexflow_keras import user_random
from flexflow_keras.optimizer_slots import SUPPORTED, slot_names
from flexflow_keras.runtime.variables import gather, to_layout


def check_supported(optimizer: Any) -> None:
    """Raises NotImplementedError for optimizers the runtime cannot run."""
    name = type(optimizer).__name__
    if name not in SUPPORTED:
        raise NotImplementedError(
            f"flexflow_keras runs the optimizers {', '.join(SUPPORTED)} "
            f"under a strategy. Received: optimizer={name}. Use one of "
            "those, or compile without a strategy."
        )
    unsupported = {
        "clipnorm": optimizer.clipnorm,
        "clipvalue": optimizer.clipvalue,
        "global_clipnorm": optimizer.global_clipnorm,
        "use_ema": optimizer.use_ema,
        "loss_scale_factor": optimizer.loss_scale_factor,
        "gradient_accumulation_steps": optimizer.gradient_accumulation_steps,
    }
    used = {k: v for k, v in unsupported.items() if v}
    if used:
        raise NotImplementedError(
            f"flexflow_keras does not run optimizer options {sorted(used)} "
            f"under a strategy yet. Received: {used}. Remove them."
        )


# Our slot name -> the Keras optimizer's list of that slot, per variable.
_KERAS_SLOT_LISTS = {
    "momentum": {"SGD": "momentums", "RMSprop": "_momentums"},
    "m": "_momentums",
    "v": "_velocities",
    "v_hat": "_velocity_hats",
    "velocity": "_velocities",
    "average_grad": "_average_gradients",
    "accumulator": "_accumulators",
}


class Updater:
    """Applies one optimizer step to DVariables inside a tf.function.

    The slots (moments, accumulators) live as DVariables beside the
    weights; `pull` and `push` mirror them into the Keras optimizer's own
    variables, so a saved model carries them and a loaded or re-compiled
    one resumes from them, as with plain Keras.

    Args:
        optimizer: The compiled Keras optimizer (read for hyperparameters).
        store: The `VariableStore`.
        variables: Trainable Keras variables, in model order.
        model_variables: All the model's trainable variables, in the order
            Keras builds its optimizer with.
    """

    def __init__(
        self, optimizer: Any, store: Any, variables: list,
        model_variables: list,
    ):
        check_supported(optimizer)
        self.optimizer = optimizer
        self.kind = type(optimizer).__name__
        self._model_variables = model_variables
        self._slots: dict[int, dict[str, Any]] = {}
        self._decay: dict[int, bool] = {}
        self._keras_of: dict[int, Any] = {}  # id(dvar) -> Keras variable
        self._layout_of: dict[int, Any] = {}  # id(dvar) -> its layout
        wd = getattr(optimizer, "weight_decay", None)
        for var in variables:
            dvar = store.dvariable(var)
            layout = store.layout(var)
            slots = {}
            for name in slot_names(optimizer):
                init = 0.0
                if self.kind == "Adagrad":
                    init = optimizer.initial_accumulator_value
                slots[name] = dtensor.DVariable(
                    _filled(layout, tuple(var.shape), init, var.dtype)
                )
            self._slots[id(dvar)] = slots
            self._keras_of[id(dvar)] = var
            self._layout_of[id(dvar)] = layout
            # Asked of the TensorFlow variable, as Keras's optimizer asks
            # it: `exclude_from_weight_decay(var_names=...)` is matched
            # against its name, the variable's path (`dense/kernel`).
            self._decay[id(dvar)] = bool(wd) and optimizer._use_weight_decay(
                var.value
            )
        self.push()

    def _keras_slot(self, name: str, var: Any) -> Any:
        lists = _KERAS_SLOT_LISTS[name]
        if isinstance(lists, dict):
            lists = lists[self.kind]
        return getattr(self.optimizer, lists)[
            self.optimizer._get_variable_index(var)
        ]

    def push(self) -> None:
        """Keras optimizer slots -> ours, when Keras has built them (a
        loaded model, or one trained before); else ours keep their
        initial values, which are Keras's."""
        if not self.optimizer.built:
            return
        for key, slots in self._slots.items():
            var, layout = self._keras_of[key], self._layout_of[key]
            for name, slot in slots.items():
                slot.assign(to_layout(self._keras_slot(name, var).value,
                                      layout))

    def pull(self) -> None:
        """Our slots -> the Keras optimizer's (built here if need be)."""
        if not self.optimizer.built:
            self.optimizer.build(self._model_variables)
        with user_random.copying_in():
            for key, slots in self._slots.items():
                var = self._keras_of[key]
                for name, slot in slots.items():
                    self._keras_slot(name, var).assign(
                        gather(slot.read_value())
                    )

    def apply(self, grads: list, dvars: list, lr: Any, step: Any) -> None:
        """Updates `dvars` with `grads`; lr and step are scalar DTensors.

        Rules are written as pure functions of values read once, then
        assigned: a DVariable read after an assign in the same function
        was seen to return the old value on a multi-device mesh. A
        weight's `constraint` (`kernel_constraint=MaxNorm(...)`) is
        applied to its updated value, as Keras's `apply` does after each
        update of a weight that had a gradient.
        """
        wd = getattr(self.optimizer, "weight_decay", None)
        rule = getattr(self, "_" + self.kind.lower())
        for grad, dvar in zip(grads, dvars):
            if grad is None:
                continue
            value = tf.convert_to_tensor(dvar)
            lr_v = tf.cast(lr, value.dtype)
            if wd and self._decay[id(dvar)]:
                value = value - value * tf.cast(wd, value.dtype) * lr_v
            slots = self._slots[id(dvar)]
            state = {k: tf.convert_to_tensor(v) for k, v in slots.items()}
            grad = tf.cast(grad, value.dtype)
            self._square = _square_like_keras(grad)
            grad = tf.convert_to_tensor(grad)
            value, state = rule(grad, value, state, lr_v, step)
            constraint = self._keras_of[id(dvar)].constraint
            if constraint is not None:
                value = constraint(value)
            for name, new in state.items():
                slots[name].assign(new)
            dvar.assign(value)

    def _sgd(self, g, var, state, lr, step):
        # Cast as Keras casts it: `tf.cast` of a Python float goes
        # through float32, so a float64 model's 0.9 is 0.89999998 there.
        momentum = tf.cast(self.optimizer.momentum, var.dtype)
        if not state:
            return var - g * lr, state
        m = state["momentum"] * momentum - g * lr
        if self.optimizer.nesterov:
            var = var + (m * momentum - g * lr)
        else:
            var = var + m
        return var, {"momentum": m}

    def _adam(self, g, var, state, lr, step):
        opt = self.optimizer
        beta_1 = tf.cast(opt.beta_1, var.dtype)
        beta_2 = tf.cast(opt.beta_2, var.dtype)
        local_step = tf.cast(step, var.dtype)
        beta_1_power = tf.pow(beta_1, local_step)
        beta_2_power = tf.pow(beta_2, local_step)
        alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        m = state["m"] + (g - state["m"]) * (1 - opt.beta_1)
        v = state["v"] + (self._square - state["v"]) * (1 - opt.beta_2)
        new = {"m": m, "v": v}
        if opt.amsgrad:
            v = tf.maximum(state["v_hat"], v)
            new["v_hat"] = v
        var = var - (m * alpha) / (tf.sqrt(v) + opt.epsilon)
        return var, new

    _adamw = _adam

    def _rmsprop(self, g, var, state, lr, step):
        opt = self.optimizer
        rho = opt.rho
        velocity = rho * state["velocity"] + (1 - rho) * self._square
        new = {"velocity": velocity}
        if opt.centered:
            avg = rho * state["average_grad"] + (1 - rho) * g
            new["average_grad"] = avg
            denominator = velocity - tf.square(avg) + opt.epsilon
        else:
            denominator = velocity + opt.epsilon
        increment = (lr * g) / tf.sqrt(denominator)
        if opt.momentum > 0:
            momentum = opt.momentum * state["momentum"] + increment
            new["momentum"] = momentum
            return var - momentum, new
        return var - increment, new

    def _adagrad(self, g, var, state, lr, step):
        acc = state["accumulator"] + self._square
        var = var - (lr * g) / tf.sqrt(acc + self.optimizer.epsilon)
        return var, {"accumulator": acc}


def _square_like_keras(grad: Any) -> Any:
    """`ops.square(grad)` as Keras computes it, densified.

    Keras squares an `IndexedSlices` gradient (e.g. of an Embedding) per
    slice, before duplicate rows are summed: a row looked up twice gets
    g1**2 + g2**2, not (g1 + g2)**2. Matching Keras means doing the same.
    """
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(
            tf.IndexedSlices(
                tf.square(grad.values), grad.indices, grad.dense_shape
            )
        )
    return tf.square(grad)


def _filled(layout: Any, shape: tuple, value: float, dtype: Any) -> Any:
    return to_layout(tf.fill(shape, tf.constant(value, dtype)), layout)
