"""`StrategyTrainer`: Keras's own fit/evaluate/predict, our step functions.

Put it before `keras.Model` in the bases (`class Model(StrategyTrainer,
keras.Model)`). Keras's TensorFlow trainer keeps driving epochs, data
adapters, callbacks and History; only `make_{train,test,predict}_function`
change, to run the strategy's DTensor steps once one is attached: the
model's own step on one mesh (`model_step.py`), Keras's default step layer
by layer over several meshes (`step.py`), Keras's step pinned to a device
when the strategy uses one.

Weight sync (decided): the DVariables hold the truth while training. They
are copied into the Keras variables at every epoch end (before any other
callback's `on_epoch_end`, so ModelCheckpoint and custom callbacks see the
trained values), after `fit`, and before `get_weights`, `save` and
`save_weights`. Keras values are copied in at the start of each epoch, of
`evaluate` and `predict` (so `set_weights`, `load_weights` and
EarlyStopping's restore take effect). Between those, a Keras variable a
callback reads or writes is synced when it does (`fresh_state.py`): it
sees each step's values, and what it writes is what the next step
trains from.
"""

from typing import Any

import keras
import tensorflow as tf

from flexflow_keras import notices
from flexflow_keras.model_state import state_of
from flexflow_keras.runtime import (
    clients, dtensor_passes, fresh_state, input_pipelines, layouts, op_rules,
)
from flexflow_keras.runtime.model_step import ModelStepExecutor, one_mesh
from flexflow_keras.runtime.step import Executor, single_device


def attach_strategy(model: Any, graph: Any, strategy: Any) -> None:
    """Runs `model`'s fit/evaluate/predict under `strategy` from now on.

    Args:
        model: A compiled `StrategyTrainer` model.
        graph: `build_graph(model, batch_size)`.
        strategy: A `Strategy` for `graph`; device ids refer to
            `flexflow_keras.devices.device_names()`, so a strategy found
            for a preset machine runs on any attached machine with as many
            devices.
    """
    from flexflow_keras import devices

    if not isinstance(model, StrategyTrainer):
        raise ValueError(
            "attach_strategy needs a model whose class derives from "
            f"StrategyTrainer. Received: {type(model).__name__}."
        )
    detach_strategy(model)
    state_of(model).executor = make_executor(
        model, graph, strategy, devices.device_names()
    )
    _keras_functions_anew(model)


def make_executor(model: Any, graph: Any, strategy: Any,
                  device_names: tuple[str, ...]) -> Any:
    """The executor for `strategy`: the model's own step on one mesh
    (`ModelStepExecutor`), else Keras's default step layer by layer over
    the strategy's meshes (`Executor`), or Keras's own step pinned to one
    device when the strategy uses one."""
    from flexflow_keras import devices

    dtensor_passes.make_device(graph)
    op_rules.enable()  # before anything is traced on a mesh
    meshes = layouts.MeshCache(device_names, devices.local_device_names())
    plans = layouts.plan_ops(graph, strategy, meshes)
    mesh = one_mesh(plans)
    if single_device(strategy, device_names) is None and mesh is not None:
        return ModelStepExecutor(model, graph, plans)
    return Executor(model, graph, strategy, device_names, plans)


def detach_strategy(model: Any) -> None:
    """Back to plain Keras training (trained values kept). A model under
    no strategy is left as it is, Keras's functions included."""
    state = state_of(model)
    if state.executor is None:
        return
    state.executor.sync_out()
    state.executor = None
    _keras_functions_anew(model)


def _keras_functions_anew(model: Any) -> None:
    """Keras makes its train, test and predict functions again at their
    next use. Why: a function made under one executor (or none) keeps
    running it; whenever the executor changes, they must be made anew."""
    model.train_function = None
    model.test_function = None
    model.predict_function = None


def tf_executing_eagerly() -> bool:
    import tensorflow as tf

    return tf.executing_eagerly()


def _on_device(function: Any, device: str) -> Any:
    """Keras's step function, run (and traced) on `device`."""
    import tensorflow as tf

    def on_device(*args, **kwargs):
        with tf.device(device):
            return function(*args, **kwargs)

    return on_device


class _SyncCallback(keras.callbacks.Callback):
    """Copies values between Keras and the executor the model has now
    (it may change mid-fit: see `StrategyTrainer._strategy_failed`)."""

    def __init__(self, model: "StrategyTrainer"):
        super().__init__()
        self._trainer = model

    def on_epoch_begin(self, epoch, logs=None):
        self._trainer._sync_in()

    def on_epoch_end(self, epoch, logs=None):
        self._trainer._sync_out()

    def on_train_end(self, logs=None):
        self._trainer._sync_out()


class StrategyTrainer:
    """Mixin: runs Keras training loops with a strategy's DTensor steps."""

    def _strategy_failed(self, reason: str) -> None:
        """The strategy cannot run on TensorFlow: says `reason` and trains
        as plain Keras from here on, with the values trained so far."""
        notices.must_tell(reason, stacklevel=2)
        detach_strategy(self)

    def _run_without_strategy(self, run: Any) -> Any:
        """`run()` as plain Keras, the values trained so far copied out
        first; if it raises, the model is back under its strategy (as it
        was: `run` changed nothing it keeps) and the error goes on."""
        state = state_of(self)
        executor = state.executor
        detach_strategy(self)
        try:
            return run()
        except BaseException:
            state.executor = executor
            _keras_functions_anew(self)
            raise

    def _strategy_replaced(self, graph: Any, strategy: Any,
                           reason: str) -> None:
        """The strategy cannot compute this model's step right: says
        `reason` and trains under `strategy` (over the same devices)
        from here on, with the values trained so far."""
        notices.must_tell(reason, stacklevel=2)
        attach_strategy(self, graph, strategy)  # detaches the old one

    def _strategy_needs_own_step(self, reason: str) -> None:
        """The strategy's layer-by-layer step would drop what `reason`
        names (compile() plans such models on one mesh; a strategy
        attached by hand may still meet it): plain Keras from here."""
        self._strategy_failed(
            f"Model '{self.name}' trains as plain Keras on one device: "
            f"{reason}, which only its own step counts, and its strategy "
            "spans several device meshes. Give every op the same "
            "device_ids to run its own step under the strategy."
        )

    @property
    def strategy_executor(self) -> Executor | None:
        """The executor fit() runs now; None: plain Keras."""
        return state_of(self).executor

    def _strategy_function(self, kind: str, keras_make: Any, force: bool):
        """The `kind` (train/test/predict) function under the strategy.

        Without a strategy: Keras's own. A one-device strategy: Keras's
        own step pinned to that device. Otherwise the DTensor executor's.
        """
        attr = f"{kind}_function"
        executor = self.strategy_executor
        if executor is None:
            return keras_make(force=force)
        if getattr(self, attr) is None or force:
            if executor.single_device is not None:
                keras_make(force=True)
                function = _on_device(
                    getattr(self, attr), executor.single_device
                )
            else:
                function = executor.make_function(kind)
            setattr(self, attr, function)
        return getattr(self, attr)

    def make_train_function(self, force=False):
        return self._strategy_function(
            "train", super().make_train_function, force
        )

    def make_test_function(self, force=False):
        return self._strategy_function(
            "test", super().make_test_function, force
        )

    def make_predict_function(self, force=False):
        return self._strategy_function(
            "predict", super().make_predict_function, force
        )

    def fit(self, x=None, y=None, batch_size=None, epochs=1,
            verbose="auto", callbacks=None, **kwargs):
        with input_pipelines.untuned():
            return self._fit(x, y, batch_size, epochs, verbose, callbacks,
                             **kwargs)

    def _fit(self, x, y, batch_size, epochs, verbose, callbacks, **kwargs):
        executor = self.strategy_executor
        if executor is None:
            return super().fit(x, y, batch_size, epochs, verbose, callbacks,
                               **kwargs)
        settings = state_of(self).settings
        verbose, callbacks = clients.host_fit_arguments(
            verbose, callbacks,
            settings is not None and settings.all_hosts_output,
        )
        sync = _SyncCallback(self)
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.callbacks.insert(0, sync)
            sync.set_model(self)
        else:
            callbacks = [sync] + list(callbacks or [])
        try:  # `sync` copies Keras values in at each epoch's start
            try:
                history = super().fit(x, y, batch_size, epochs, verbose,
                                      callbacks, **kwargs)
            except BaseException:  # Ctrl-C too: what was trained
                self._sync_out_after_failure()
                raise
            self._sync_out()
            return history
        except Exception as error:
            lost = clients.lost_host(error)
            if lost is None:
                raise
            raise lost from error

    def _sync_in(self) -> None:
        """Keras variables -> DVariables (no-op without a strategy)."""
        executor = self.strategy_executor
        if executor is not None:
            executor.sync_in()

    def _sync_out(self) -> None:
        """DVariables -> Keras variables (no-op without a strategy)."""
        executor = self.strategy_executor
        if executor is not None:
            executor.sync_out()

    def _sync_out_after_failure(self) -> None:
        """`_sync_out` after a fit that raised: what the fit trained comes
        back where DTensor can still read it, and the fit's own error is
        the one the script sees. Where TensorFlow cancels DTensor's calls
        after the failure (a lost host, aborted collectives), the copy
        fails too, and its `CancelledError` would hide the cause."""
        try:
            self._sync_out()
        except tf.errors.OpError:
            pass

    def train_on_batch(self, *args, **kwargs):
        self._sync_in()
        try:
            logs = super().train_on_batch(*args, **kwargs)
        except BaseException:  # Ctrl-C too: what was trained
            self._sync_out_after_failure()
            raise
        self._sync_out()
        return logs

    def reset_metrics(self):
        sync = getattr(self.strategy_executor, "sync_metrics_in", None)
        if sync is None:
            return super().reset_metrics()
        with fresh_state.quiet():  # the metric state goes in right here
            super().reset_metrics()
            sync()

    def get_metrics_result(self):
        sync = getattr(self.strategy_executor, "sync_metrics_out", None)
        if sync is not None and tf_executing_eagerly():
            with fresh_state.quiet():  # only the metric state comes out
                sync()
                return self._results_of_built_metrics()
        return self._results_of_built_metrics()

    def _results_of_built_metrics(self):
        """Keras's `get_metrics_result`, without compiled metrics that no
        step has built yet.

        Why: Keras builds them when it traces its train function, which
        it does even on data of no batches (its iterator's spec); the
        runtime builds them at a step's first run. On no batches (a
        keras_tuner guide's split of a small data set, `x[:-10000]`)
        Keras's fit logs the validation alone, and ours raised "Cannot
        get result() since the metric has not yet been built"."""
        compiled = getattr(self, "_compile_metrics", None)
        if compiled is None or compiled.built:
            return super().get_metrics_result()
        results = {}
        for metric in self.metrics:
            if metric is compiled:
                continue
            result = metric.result()
            if isinstance(result, dict):
                results.update(result)
            else:
                results[metric.name] = result
        return results


def _after_sync(name: str, sync: str) -> Any:
    """Keras's method `name`, run after the trainer's `sync`."""

    def method(self, *args, **kwargs):
        getattr(self, sync)()
        with input_pipelines.untuned():
            return getattr(super(StrategyTrainer, self), name)(*args,
                                                               **kwargs)

    method.__name__ = name
    method.__qualname__ = f"StrategyTrainer.{name}"
    method.__doc__ = f"`keras.Model.{name}`, after `{sync}`."
    return method


# Keras's entry points that must run on the values the user set (Keras
# values in first) or that read the trained ones (DVariables out first):
# the module docstring's weight-sync rule, in one table.
for _name, _sync in (
    ("evaluate", "_sync_in"), ("predict", "_sync_in"),
    ("test_on_batch", "_sync_in"), ("predict_on_batch", "_sync_in"),
    ("get_weights", "_sync_out"), ("save", "_sync_out"),
    ("save_weights", "_sync_out"),
):
    setattr(StrategyTrainer, _name, _after_sync(_name, _sync))
