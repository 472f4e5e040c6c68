"""Keras 3 optimizer update rules on DVariables, formula for formula.

Keras's TensorFlow optimizer cannot update DVariables (`stateless_apply`
is not supported on TF; swapping backing variables drifted for Adam), so
the update rules of SGD (momentum, nesterov), Adam (amsgrad), AdamW,
RMSprop (momentum, centered) and Adagrad are written here with the same
operation order as `keras/src/optimizers/*.py`. Learning rate and step
come in each step from the Keras optimizer, so schedules and callbacks
that set `optimizer.learning_rate` take effect. Other optimizers or
options raise `NotImplementedError` at attach time.
"""

from typing import Any

import tensorflow as tf
from tensorflow.experimental import dtensor

SUPPORTED = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad")


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


def _slot_names(optimizer: Any) -> tuple[str, ...]:
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


class Updater:
    """Applies one optimizer step to DVariables inside a tf.function.

    Args:
        optimizer: The compiled Keras optimizer (read for hyperparameters).
        store: The `VariableStore`.
        variables: Trainable Keras variables, in model order.
    """

    def __init__(self, optimizer: Any, store: Any, variables: list):
        check_supported(optimizer)
        self.optimizer = optimizer
        self.kind = type(optimizer).__name__
        self._slots: dict[int, dict[str, Any]] = {}
        self._decay: dict[int, bool] = {}
        wd = getattr(optimizer, "weight_decay", None)
        for var in variables:
            dvar = store.dvariable(var)
            layout = store.layout(var)
            slots = {}
            for name in _slot_names(optimizer):
                init = 0.0
                if self.kind == "Adagrad":
                    init = optimizer.initial_accumulator_value
                slots[name] = dtensor.DVariable(
                    _filled(layout, tuple(var.shape), init, var.dtype)
                )
            self._slots[id(dvar)] = slots
            self._decay[id(dvar)] = bool(wd) and optimizer._use_weight_decay(
                var
            )

    def apply(self, grads: list, dvars: list, lr: Any, step: Any) -> None:
        """Updates `dvars` with `grads`; lr and step are scalar DTensors."""
        wd = getattr(self.optimizer, "weight_decay", None)
        if wd:
            for dvar in dvars:
                if self._decay[id(dvar)]:
                    dvar.assign(dvar - dvar * tf.cast(wd, dvar.dtype) * lr)
        for grad, dvar in zip(grads, dvars):
            if grad is None:
                continue
            grad = tf.cast(grad, dvar.dtype)
            getattr(self, "_" + self.kind.lower())(
                grad, dvar, self._slots[id(dvar)], lr, step
            )

    def _sgd(self, g, var, slots, lr, step):
        momentum = self.optimizer.momentum
        if not slots:
            var.assign_sub(g * lr)
            return
        m = slots["momentum"]
        m.assign(m * momentum - g * lr)
        if self.optimizer.nesterov:
            var.assign_add(m * momentum - g * lr)
        else:
            var.assign_add(m)

    def _adam(self, g, var, slots, lr, step):
        opt = self.optimizer
        beta_1 = tf.cast(opt.beta_1, var.dtype)
        beta_2 = tf.cast(opt.beta_2, var.dtype)
        beta_1_power = tf.pow(beta_1, step)
        beta_2_power = tf.pow(beta_2, step)
        m, v = slots["m"], slots["v"]
        alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        m.assign_add((g - m) * (1 - opt.beta_1))
        v.assign_add((tf.square(g) - v) * (1 - opt.beta_2))
        v_value = v
        if opt.amsgrad:
            v_hat = slots["v_hat"]
            v_hat.assign(tf.maximum(v_hat, v))
            v_value = v_hat
        var.assign_sub((m * alpha) / (tf.sqrt(v_value) + opt.epsilon))

    _adamw = _adam

    def _rmsprop(self, g, var, slots, lr, step):
        opt = self.optimizer
        rho = opt.rho
        velocity = slots["velocity"]
        velocity.assign(rho * velocity + (1 - rho) * tf.square(g))
        if opt.centered:
            avg = slots["average_grad"]
            avg.assign(rho * avg + (1 - rho) * g)
            denominator = velocity - tf.square(avg) + opt.epsilon
        else:
            denominator = velocity + opt.epsilon
        increment = (lr * g) / tf.sqrt(denominator)
        if opt.momentum > 0:
            momentum = slots["momentum"]
            momentum.assign(opt.momentum * momentum + increment)
            var.assign_sub(momentum)
        else:
            var.assign_sub(increment)

    def _adagrad(self, g, var, slots, lr, step):
        acc = slots["accumulator"]
        acc.assign_add(tf.square(g))
        var.assign_sub((lr * g) / tf.sqrt(acc + self.optimizer.epsilon))


def _filled(layout: Any, shape: tuple, value: float, dtype: Any) -> Any:
    from flexflow_keras.runtime.variables import to_layout

    return to_layout(tf.fill(shape, tf.constant(value, dtype)), layout)
