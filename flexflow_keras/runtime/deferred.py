"""DVariables whose writes in a traced step take effect once, at its end.

Why: in a DTensor function that runs Keras's own training step, a read
of a variable after its assignment returned the value from before it
(measured on TensorFlow 2.21, 4 virtual CPUs: a loss tracker's `result()`
after `update_state` read the old total, and Keras's Adam read its old
moments, the "Adam drift"). The TensorFlow graph has the control edges;
DTensor's expansion loses them. Small functions happen to keep the
order, so no test of a toy function shows it.

So, while a step is traced (`deferring(variables)`), a `StepVariable`
does not emit its writes: `assign`, `assign_add`, `scatter_*` compute
the new value from the current one and keep it; reads in the same trace
return the kept value. `deferring` then emits one assignment per changed
variable at the end of the step. Every write's new value is computed
from reads that come before it in data-flow order, so the result is the
sequential one whatever order DTensor runs the ops in. This is Keras's
own `StatelessScope` contract, kept one level lower, on the variable, so
that gradient tapes, `handle` and optimizer bookkeeping see a variable.

`select_cond` is `keras.ops.cond` for such a trace: writes inside a
`tf.cond` branch cannot be kept (the branch is its own graph), so both
branches run and `tf.where` picks the outputs and the kept values; as in
JAX, where Keras's optimizers already work this way.
"""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf
from keras import tree
from keras.src.backend.tensorflow import core as tf_core
from tensorflow.experimental import dtensor
from tensorflow.python.eager import record
from tensorflow.python.ops.resource_variable_ops import variable_accessed


class StepVariable(dtensor.DVariable):
    """A `DVariable` that can defer its writes (see module docstring)."""

    _deferring = False
    _kept = None  # the value written during the current trace
    # Whether any traced step writes it: only those are copied back to
    # their Keras variables (`ModelStepExecutor.sync_out`).
    written = False

    # -- reads ------------------------------------------------------------

    def _read_variable_op(self, *args, **kwargs):
        if self._kept is None:
            return super()._read_variable_op(*args, **kwargs)
        # A read of the kept value is still a read of this variable for
        # gradient tapes, as `ResourceVariable._read_variable_op` makes
        # it: the tape watches the variable (`variable_accessed`) and
        # the value's gradient is the variable's. Without both, a tape
        # opened after a write in the same step (a GAN's second
        # discriminator update) got no gradient for the variable.
        variable_accessed(self)
        # No gradient through the write: as a read after an assignment in
        # TensorFlow, whose value comes from the variable, not from what
        # was assigned. Without it, a tape around a BatchNormalization
        # called in training and then in inference mode (keras.io's
        # AdaMatch) took the gradient of the moving statistics the first
        # call wrote, back into the batch's, and the weights went apart
        # from plain Keras's after one step.
        result = tf.identity(tf.stop_gradient(self._kept))
        record.record_operation(
            "ReadVariableOp", [result], [self.handle],
            backward_function=lambda x: [x],
            forward_function=lambda x: [x],
        )
        return result

    def sparse_read(self, indices, name=None):
        if self._kept is not None:  # through the read, for tapes
            return tf.gather(self._read_variable_op(), indices, name=name)
        return super().sparse_read(indices, name=name)

    def gather_nd(self, indices, name=None):
        if self._kept is not None:
            return tf.gather_nd(self._read_variable_op(), indices, name=name)
        return super().gather_nd(indices, name=name)

    # -- writes -----------------------------------------------------------

    def _current(self) -> tf.Tensor:
        if self._kept is not None:
            return self._kept
        return self._stored()

    def _stored(self) -> tf.Tensor:
        """The value the step started from (a real read)."""
        return super()._read_variable_op()

    def _keep(self, value: Any, read_value: bool) -> Any:
        if not _in_trace_graph(self):
            raise NotImplementedError(
                f"Variable '{self.name}' is assigned inside a control-flow "
                "branch (tf.cond / tf.while_loop) of a step that runs "
                "under a parallel strategy. Use `keras.ops.cond` (it runs "
                "here as a select) or compute the value and assign it "
                "outside the branch."
            )
        self._kept = tf.cast(tf.convert_to_tensor(value), self.dtype)
        self.written = True
        return tf.identity(self._kept) if read_value else self._kept

    def assign(self, value, use_locking=None, name=None, read_value=True):
        if not self._deferring:
            return super().assign(value, use_locking, name, read_value)
        return self._keep(value, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        if not self._deferring:
            return super().assign_add(delta, use_locking, name, read_value)
        return self._keep(self._current() + _dense(delta), read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        if not self._deferring:
            return super().assign_sub(delta, use_locking, name, read_value)
        return self._keep(self._current() - _dense(delta), read_value)

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        if not self._deferring:
            return super().scatter_add(sparse_delta, use_locking, name)
        return self._keep(self._current() + _dense(sparse_delta), True)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        if not self._deferring:
            return super().scatter_sub(sparse_delta, use_locking, name)
        return self._keep(self._current() - _dense(sparse_delta), True)

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        if not self._deferring:
            return super().scatter_update(sparse_delta, use_locking, name)
        indices = tf.expand_dims(sparse_delta.indices, -1)
        return self._keep(
            tf.tensor_scatter_nd_update(
                self._current(), indices, sparse_delta.values
            ),
            True,
        )


def _dense(value: Any) -> tf.Tensor:
    """An IndexedSlices delta as the dense tensor it adds (duplicates
    summed, as scatter_add applies them one after the other)."""
    return tf.convert_to_tensor(value)


_TRACE_GRAPH: list = []  # the graph `deferring` keeps values for


def _in_trace_graph(variable: StepVariable) -> bool:
    return bool(_TRACE_GRAPH) and tf.compat.v1.get_default_graph() is (
        _TRACE_GRAPH[-1]
    )


@contextlib.contextmanager
def deferring(variables: Sequence[StepVariable]) -> Iterator[None]:
    """Within a tf.function trace: keep writes, emit them at exit.

    Args:
        variables: The `StepVariable`s the traced step may write.

    Yields:
        A list that holds, once the block is done, the variables the
        step writes.
    """
    _TRACE_GRAPH.append(tf.compat.v1.get_default_graph())
    for var in variables:
        var._deferring, var._kept = True, None
    written: list = []
    try:
        yield written
        writes = [(v, v._kept) for v in variables if v._kept is not None]
    finally:
        for var in variables:
            var._deferring, var._kept = False, None
        _TRACE_GRAPH.pop()
    for var, value in writes:
        var.assign(value, read_value=False)
    written.extend(var for var, _ in writes)


def _snapshot(variables: Sequence[StepVariable]) -> list:
    return [v._kept for v in variables]


def select_cond(variables: Sequence[StepVariable]) -> Any:
    """A `cond(pred, true_fn, false_fn)` that runs both branches and
    selects, for traces under `deferring(variables)`."""

    def cond(pred, true_fn, false_fn):
        static = tf.get_static_value(pred)
        if static is not None:
            return true_fn() if static else false_fn()
        before = _snapshot(variables)
        true_out = true_fn()
        after_true = _snapshot(variables)
        for var, kept in zip(variables, before):
            var._kept = kept
        false_out = false_fn()
        after_false = _snapshot(variables)
        for var, old, t, f in zip(variables, before, after_true, after_false):
            if t is old and f is old:
                continue
            base = var._stored() if old is None else old
            t = base if t is None else t
            f = base if f is None else f
            var._kept = _select(pred, t, f)
        if true_out is None and false_out is None:
            return None
        return tree.map_structure(
            lambda a, b: _select(pred, a, b), true_out, false_out
        )

    return cond


@contextlib.contextmanager
def conds_selected(variables: Sequence[StepVariable]) -> Iterator[None]:
    """While a step (or the probe of a layer) is traced, `keras.ops.cond`
    is `select_cond(variables)`.

    The probe runs a layer as the step will: a layer whose `call` assigns
    a weight the output of an `ops.cond` branch that returns that weight
    (Keras's `SpectralNormalization`) crashed the process in the probe
    (a segmentation fault, TF 2.21) under TensorFlow's own cond, and
    runs under this one."""
    keras_cond = tf_core.cond
    tf_core.cond = select_cond(variables)
    try:
        yield
    finally:
        tf_core.cond = keras_cond


def _select(pred: tf.Tensor, a: Any, b: Any) -> tf.Tensor:
    """`tf.where` on a scalar `pred`, broadcast first: DTensor's SelectV2
    with a scalar condition crashes the process (measured, TF 2.21)."""
    a = tf.convert_to_tensor(a)
    return tf.where(tf.broadcast_to(pred, tf.shape(a)), a, b)
