"""`Model` and `Sequential`: Keras models whose compile() plans parallelism.

Only wires Keras to the stages (planner: graph -> search or import;
runtime: DTensor execution). The search needs the global batch size: it
runs in `compile()` when that is known (`compile(batch_size=...)` or a
fixed batch dim in `keras.Input`), else at the start of the first `fit()`
for the batch size that fit uses. A plan is kept per batch size.
"""

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
from keras.models import save_model  # noqa: F401
from keras.src import api_export
from keras.src.models.functional import Functional as KerasFunctional
from keras.src.models.model import Trainer as KerasTrainer
from keras.src.models.model import functional_init_arguments
from keras.src.saving import serialization_lib
from keras.src.trainers.data_adapters import is_torch_dataloader

from flexflow_keras import notices, own_loops, tf_distribute
from flexflow_keras import settings as settings_lib
from flexflow_keras import user_random
from flexflow_keras.keras_graph import (
    UnknownDimension, UntracedBatchSize, is_subclassed, needs_trace,
)
from flexflow_keras.model_state import state_of
from flexflow_keras.runtime import StrategyTrainer, step_prints

# compile() keywords that are ours, not Keras's.
_OUR_COMPILE_ARGS = settings_lib.FIELDS + ("batch_size",)
_KERAS_DEFAULT_BATCH_SIZE = 32


@own_loops.mark_entry_points
class _PlanningModel(StrategyTrainer):
    """compile()/fit() glue shared by `Model` and `Sequential`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A call under a gradient tape outside fit() and the like: a
        # training loop of the user's own, said once (`own_loops`).
        own_loops.note_call(self)
        return super().__call__(*args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """`keras.Model.compile`, plus the parallelization settings.

        Args:
            search_budget: MCMC iterations (0: data parallelism).
            search_alpha: FlexFlow's per-ms MCMC acceptance factor;
                default None: the relative rule (`docs/SEARCH.md`).
            search_seed: Seed for a reproducible search.
            export_strategy: Path (`.pb` or `.txt`) to write the strategy.
            import_strategy: Strategy file to use instead of searching.
            machine: Preset name or JSON spec to plan for (default: the
                attached devices).
            batch_size: Global batch size to plan for now; by default the
                plan is made at the first `fit()`.
            *args, **kwargs: As for `keras.Model.compile`.
        """
        ours = {k: kwargs.pop(k) for k in _OUR_COMPILE_ARGS if k in kwargs}
        batch_size = ours.pop("batch_size", None)
        with own_loops.entered():
            super().compile(*args, **kwargs)
            state = state_of(self)
            state.settings = settings_lib.resolve(ours)
            state.plans, state.plan = {}, None
            if batch_size is None:
                batch_size = self._static_batch_size()
            if batch_size is not None:
                with user_random.kept(), tf_distribute.taken_over(self):
                    self._ensure_plan(int(batch_size))

    def quantize(self, mode: Any = None, *args: Any, **kwargs: Any) -> None:
        """`keras.Model.quantize`, then the model planned again.

        Why: quantizing swaps layers' variables (an int8 kernel and its
        scale for the float kernel) and the calls that read them, while
        the plan, its graph and the step's DTensor variables were made
        for the old ones: the next predict failed on them. The trained
        values go back into Keras's variables first (quantizing reads
        them); then the model is planned again for the batch size it
        ran under, so that predict, evaluate and fit (QLoRA's) keep
        running under a strategy, one that prices the quantized layers.
        """
        from flexflow_keras import runtime

        state = state_of(self)
        running = (None if state.plan is None
                   else state.plan.graph.batch_size)
        with own_loops.entered():
            runtime.detach_strategy(self)
            state.plan = None
            try:
                super().quantize(mode, *args, **kwargs)
            finally:
                state.plans = {}
                if running is not None and state.settings is not None:
                    with user_random.kept():
                        self._ensure_plan(running)

    def compile_from_config(self, config: dict) -> None:
        """Recompiles a loaded model (Keras skips overridden compile())."""
        config = serialization_lib.deserialize_keras_object(config)
        self.compile(**config)
        if hasattr(self, "optimizer") and self.built:
            self.optimizer.build(self.trainable_variables)

    @property
    def strategy(self) -> Any:
        """The `Strategy` fit() runs under, or None before planning."""
        plan = state_of(self).plan
        return None if plan is None else plan.strategy

    @property
    def plan(self) -> Any:
        """The last `planner.Plan` (graph, strategy, search result)."""
        return state_of(self).plan

    def fit(
        self, x: Any = None, y: Any = None, batch_size: Any = None,
        *args: Any, **kwargs: Any,
    ) -> Any:
        with own_loops.entered(), tf_distribute.taken_over(self):
            state = state_of(self)
            if state.settings is not None:
                found, x = _peek_batch(x, batch_size,
                                       lengths=needs_trace(self))
                if found is not None:
                    found, args, kwargs = _with_validation_lengths(
                        found, args, kwargs, read=needs_trace(self))
                    self._planned_again_for_lengths(found.inputs)
                    self._plan_for(found)
                elif state.plan is None:
                    self._tell_plain_once(
                        f"Model '{self.name}' trains as plain Keras on one "
                        f"device: {_unread_dataset_reason(x)}",
                        stacklevel=4)
            return super().fit(x, y, batch_size, *args, **kwargs)

    def evaluate(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        """`keras.Model.evaluate`, planned again first where `x` comes
        in another length (`_planned_again_for_data`); not inside a
        fit, whose validation runs under the fit's plan."""
        with own_loops.entered(), tf_distribute.taken_over(self):
            if not kwargs.get("_use_cached_eval_dataset"):
                x = self._planned_again_for_data(x)
            return super().evaluate(x, *args, **kwargs)

    def predict(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """`keras.Model.predict`, planned again first where `x` comes in
        another length (`_planned_again_for_data`)."""
        with own_loops.entered(), tf_distribute.taken_over(self):
            x = self._planned_again_for_data(x)
            return super().predict(x, *args, **kwargs)

    def train_on_batch(self, x: Any = None, *args: Any,
                       **kwargs: Any) -> Any:
        """`keras.Model.train_on_batch`, under the plan fit() would make.

        Why: scripts that train batch by batch (a GAN's discriminator and
        combined model, replay buffers in RL) never call fit(); without
        this they trained as plain Keras on one device, unsaid. The first
        call plans for its batch's size; later calls of another size run
        under that plan, as fit()'s last partial batch does.
        """
        state = state_of(self)
        with own_loops.entered(), tf_distribute.taken_over(self):
            self._planned_again_for_lengths(x)
            if (state.settings is not None and state.plan is None
                    and not state.warned_plain and x is not None):
                self._plan_for(_Peeked(_leading_dim(x), x))
            return super().train_on_batch(x, *args, **kwargs)

    def test_on_batch(self, x: Any = None, *args: Any,
                      **kwargs: Any) -> Any:
        """`keras.Model.test_on_batch`, planned again first where `x`
        comes in another length (`_planned_again_for_lengths`)."""
        with own_loops.entered(), tf_distribute.taken_over(self):
            self._planned_again_for_lengths(x)
            return super().test_on_batch(x, *args, **kwargs)

    def predict_on_batch(self, x: Any) -> Any:
        """`keras.Model.predict_on_batch`, planned again first where `x`
        comes in another length (`_planned_again_for_lengths`)."""
        with own_loops.entered(), tf_distribute.taken_over(self):
            self._planned_again_for_lengths(x)
            return super().predict_on_batch(x)

    def _plan_for(self, found: "_Peeked") -> None:
        """Builds, traces and plans the model for the data `found` reads
        (fit's and train_on_batch's one way to a plan)."""
        state = state_of(self)
        if (not self.built and found.input_shape is not None
                and not is_subclassed(self)):
            self.build(found.input_shape)  # as Keras's fit would
        elif is_subclassed(self) and found.inputs is not None:
            _built_as_keras_fit_builds(self, found)
        with user_random.kept():
            if needs_trace(self) and state.trace_failure is None:
                self._trace(found)
            # A notice points at the script's line, above the entry
            # point (fit, train_on_batch) that called this.
            self._ensure_plan(found.batch_size, stacklevel=4)

    def summary(self, *args: Any, **kwargs: Any) -> None:
        """Keras's summary, then each op's config and simulated time."""
        super().summary(*args, **kwargs)
        plan = self.plan
        if plan is None:
            return
        from flexflow_keras.report import strategy_table

        print_fn = kwargs.get("print_fn") or print
        print_fn(strategy_table(plan.graph, plan.strategy, plan.per_op_ms))

    def _static_batch_size(self) -> int | None:
        try:
            shapes = [tuple(t.shape) for t in self.inputs]
        except (AttributeError, ValueError):
            return None
        batches = {s[0] for s in shapes if s}
        if len(batches) == 1 and None not in batches:
            return int(batches.pop())
        return None

    def _strategy_replaced(self, graph, strategy, reason: str) -> None:
        # `model.strategy` and summary() report what runs.
        state = state_of(self)
        if state.plan is not None:
            plan = dataclasses.replace(
                state.plan, strategy=strategy, source="data_parallel",
                search_result=None, step_ms=None, per_op_ms=None,
            )
            state.plans = {
                batch: plan if old is state.plan else old
                for batch, old in state.plans.items()
            }
            state.plan = plan
        super()._strategy_replaced(graph, strategy, reason)

    def _strategy_failed(self, reason: str) -> None:
        # For good: later fits must not attach a strategy again.
        state = state_of(self)
        state.runtime_failure, state.warned_plain = reason, True
        state.plan = None
        super()._strategy_failed(reason)

    def _tell_plain_once(self, reason: str, stacklevel: int) -> None:
        """Says once per model why it trains as plain Keras (`stacklevel`
        counted from here to the script's line)."""
        state = state_of(self)
        if not state.warned_plain:
            notices.must_tell(reason, stacklevel=stacklevel)
            state.warned_plain = True

    def _trace(self, found: "_Peeked") -> None:
        """The model's graph: its call traced on inputs shaped like fit's
        (once; a failure is kept for the warning)."""
        from flexflow_keras.keras_graph import trace_call

        if found.inputs is not None:
            failure = trace_call(
                self, found.symbolic_inputs(), found.batch_size)
            if failure is not None:
                state_of(self).trace_failure = failure
            else:
                state_of(self).traced_lengths = [
                    tuple(np.shape(leaf))[1:]
                    for leaf in keras.tree.flatten(found.inputs)]

    def _planned_for_lengths(self) -> bool:
        """Whether the model runs under a plan made for the lengths of
        the data it was traced on (its `keras.Input` leaves them
        unknown)."""
        state = state_of(self)
        return not (state.traced_lengths is None or state.plan is None
                    or state.settings is None or state.traced_whole)

    def _planned_again_for_data(self, x: Any) -> Any:
        """`_planned_again_for_lengths` for the `x` that evaluate or
        predict was given, which it returns as it will be read
        (`_inputs_read_ahead`: a generator or `PyDataset` by its first
        two batches, as fit() reads its data).

        Why those two: a plan that split the traced length or ran over
        several meshes raised DTensor's "requires dimension 1 to be
        divisible by sharding" when predict was fed a `PyDataset` of
        another length (7 under a length split over 2 devices).
        """
        if not self._planned_for_lengths():
            return x
        inputs, x = _inputs_read_ahead(x)
        if inputs is not None:
            self._planned_again_for_lengths(inputs)
        return x

    def _planned_again_for_lengths(self, inputs: Any) -> None:
        """Plans the model again, with the lengths in which `inputs`
        (arrays or tensors fed to fit, evaluate or predict, or a batch's
        specs) differ from those it was traced on left unknown
        (`varying`: never split); nothing where none differ.

        Why: a model whose `keras.Input` leaves a length unknown is
        planned for the length of the data fit() feeds first, and its
        plan may split that length or run over several meshes, whose
        functions keep the graph's shapes. Predicting on another length
        (text generation; a test set padded otherwise) then raised
        DTensor's error from the script ("requires dimension 1 to be
        divisible by sharding"). Planned again as varying, every later
        length runs under the new plan.
        """
        import tensorflow as tf

        from flexflow_keras import runtime

        state = state_of(self)
        if not self._planned_for_lengths():
            return
        try:
            leaves = keras.tree.flatten(inputs)
        except (TypeError, ValueError):
            return
        if len(leaves) != len(state.traced_lengths):
            return
        specs, changed = [], []
        for leaf, were in zip(leaves, state.traced_lengths):
            if not (isinstance(leaf, (np.ndarray, tf.TensorSpec))
                    or tf.is_tensor(leaf)):
                return  # a dataset or generator: read where fit peeks
            shape = tuple(np.shape(leaf))[1:]
            if len(shape) != len(were):
                return
            dims = tuple(w if w == d else None for w, d in zip(were, shape))
            if dims != were:
                changed.append((tuple(np.shape(leaf)), were))
            specs.append(_spec_like(leaf, (None,) + dims))
        if not changed or None in specs:
            return
        received, planned = changed[0]
        planned = ", ".join(map(str, (None,) + planned))
        imported = state.settings.import_strategy
        warnings.warn(
            f"Model '{self.name}' is planned again: its inputs came in "
            f"another length than it was planned for (received shape "
            f"{received}, planned for ({planned})). Lengths that change "
            "are never split" + (
                f"; the strategy imported from {imported} is used where "
                "it splits none of them, else a search replaces it."
                if imported else "."), stacklevel=3)
        batch = state.plan.graph.batch_size
        runtime.detach_strategy(self)
        state.plan, state.plans = None, {}
        state.traced_function, state.traced_at = None, {}
        state.traced_batch = state.trace_inputs = None
        found = _Peeked(batch, keras.tree.pack_sequence_as(inputs, specs))
        try:
            self._plan_for(found)
        except ValueError:
            if not imported:
                raise
            # The file splits a length that now changes: searched.
            state.settings = dataclasses.replace(
                state.settings, import_strategy=None)
            self._plan_for(found)

    def _ensure_plan(self, batch_size: int, stacklevel: int = 3) -> None:
        """Plans for `batch_size` once, then attaches it to the runtime
        (`stacklevel`: a notice's, counted from here to the script)."""
        from flexflow_keras import capabilities, planner, runtime

        state = state_of(self)
        reason = _why_plain_keras(self)
        if reason is not None:
            self._tell_plain_once(reason, stacklevel=stacklevel + 1)
            if state.executor is not None:  # planned before: detach
                runtime.detach_strategy(self)
                state.plan = None
            return
        plan = state.plans.get(batch_size)
        if plan is None:
            own_step = "; ".join(runtime.own_step_reasons(self))
            clients = settings_lib.dtensor_clients()
            if clients is not None:
                # Meshes of several clients hold every device.
                own_step = "; ".join(filter(None, [
                    own_step, f"it trains over {clients.num_clients} "
                    "DTensor clients",
                ]))

            def make():
                return planner.make_plan(
                    self, batch_size, state.settings,
                    optimizer=getattr(self, "optimizer", None),
                    one_mesh_reason=own_step or None,
                    probe=runtime.probe_graph,
                )

            try:
                # Planning runs layers (cost measurement, probes): the
                # model's seeds and statistics are put back after it.
                with user_random.kept(self), step_prints.silenced():
                    if clients is None:
                        plan = make()
                    else:
                        plan = runtime.agreed_plan(self, batch_size, make)
            except (capabilities.Unsupported, UnknownDimension,
                    UntracedBatchSize) as error:
                why = str(error).rstrip(".")
                # Plain Keras runs such a model: so does the script.
                self._strategy_failed(
                    f"Model '{self.name}' trains as plain Keras on one "
                    f"device: {why}."
                )
                return
            state.plans[batch_size] = plan
        if plan is not state.plan:
            runtime.attach_strategy(self, plan.graph, plan.strategy)
            state.plan = plan


def _why_plain_keras(model: Any) -> str | None:
    """Why `model` must train as plain Keras (one device), or None."""
    from flexflow_keras.keras_graph import has_graph

    state = state_of(model)
    if state.runtime_failure is not None:
        return state.runtime_failure
    scoped = tf_distribute.plain_reason(model)
    if scoped is not None:
        return scoped
    if getattr(model, "run_eagerly", False):
        return (
            f"Model '{model.name}' trains as plain Keras on one device: it "
            "was compiled with run_eagerly=True, which runs its step "
            "eagerly, line by line, for debugging (a strategy's step is "
            "one compiled DTensor function). Compile without it to train "
            "under a searched strategy."
        )
    if not has_graph(model):
        failure = state.trace_failure
        if type(model).call is keras.Model.call:
            # Its step calls the models it holds (a GAN, a VAE).
            return (
                f"Model '{model.name}' trains as plain Keras on one "
                "device: it has no call(), and no graph could be made of "
                f"the models its step calls ({failure}). Build them with "
                "`keras.Input(...)` (functional or Sequential) and keep "
                "them as attributes of the model, to get a searched "
                "strategy."
            )
        why = (
            f"its call() could not be traced on symbolic inputs "
            f"({failure})" if failure else
            "it has no graph of layers to parallelize"
        )
        return (
            f"Model '{model.name}' trains as plain Keras on one device: "
            f"{why}. Keep Python control flow on tensor values out of "
            "call() (use keras.ops.cond / keras.ops.where), or build the "
            "model with `keras.Input(...)`, to get a searched strategy."
        )
    return None


class Model(_PlanningModel, keras.Model):
    """A `keras.Model` that searches a parallel strategy at `compile()`.

    Same constructor and methods as `keras.Model`; `compile()` takes the
    search settings (see `_PlanningModel.compile`), `fit()`, `evaluate()`
    and `predict()` run under the chosen strategy, `model.strategy` holds
    it and `summary()` lists it.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "Model":
        # As `keras.Model` does for itself: functional arguments give a
        # functional model. Keras would instead rewrite this class's bases
        # in place (inject_functional_model_class), turning every later
        # subclassed `Model` into a broken functional one.
        if cls is Model and functional_init_arguments(args, kwargs):
            return Functional.__new__(Functional, *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any):
        if functional_init_arguments(args, kwargs):
            if not isinstance(self, KerasFunctional):
                _inject_functional(type(self))
            KerasTrainer.__init__(self)
            KerasFunctional.__init__(self, *args, **kwargs)
        else:
            super().__init__(*args, **kwargs)


class Functional(Model, KerasFunctional):
    """What `Model(inputs, outputs)` builds: ours, and a Keras Functional.

    Named like Keras's class so default model names stay `functional`.
    """


def _inject_functional(cls: type) -> type:
    """Puts `Functional` under a user subclass of `Model`.

    Like Keras's inject_functional_model_class, but never rewrites our
    own `Model`, which later subclassed models share.
    """
    if cls is Model:
        return Functional
    if cls is object or not issubclass(cls, Model):
        return cls
    cls.__bases__ = tuple(_inject_functional(b) for b in cls.__bases__)
    return cls


class Sequential(_PlanningModel, keras.Sequential):
    """A `keras.Sequential` that searches a parallel strategy at `compile()`."""


class _Peeked:
    """Batch size, input shape and inputs read from fit()'s data."""

    def __init__(self, batch_size: int, inputs: Any = None):
        self.batch_size = batch_size
        self.input_shape = _shape_of(inputs)
        self.inputs = inputs

    def symbolic_inputs(self) -> Any:
        """`keras.Input`s shaped and typed like the inputs (any batch)."""

        def symbolic(value, name=None):
            value = np.asarray(value) if not hasattr(value, "dtype") else (
                value
            )
            dtype = keras.backend.standardize_dtype(value.dtype)
            with user_random.names_kept():  # the package's, not the script's
                return keras.Input(tuple(np.shape(value))[1:], dtype=dtype,
                                   name=name)

        def named(key, value):
            if keras.tree.is_nested(value):
                return keras.tree.map_structure(symbolic, value)
            return symbolic(value, str(key))

        if isinstance(self.inputs, dict):
            # Named as fit's keys: a message about an input names it as
            # the script does (keras.io's captcha OCR: 'label').
            return {key: named(key, value)
                    for key, value in self.inputs.items()}
        return keras.tree.map_structure(symbolic, self.inputs)


def _built_as_keras_fit_builds(model: Any, found: "_Peeked") -> None:
    """Builds the layers of a subclassed `model` not yet built as Keras's
    fit() does at its start (`Trainer._symbolic_build`: the model called
    on symbolic tensors shaped like `found`'s first batch, here of any
    batch size, as the trace calls it), outside the package's
    `user_random.kept()` blocks.

    Why: a layer that makes its initializer as it builds (a custom
    layer's `add_weight(initializer="random_normal")`, keras.io's
    `MyDense`) draws that initializer's seed from Python's `random`
    then. Built inside planning's block, which puts the script's
    streams back, the draw was undone: the weights were plain Keras's,
    but every later draw of the script repeated it (keras.io's
    "Introduction to Keras for engineers": the next model built
    started from other weights, a first loss of 2.3504 against
    2.3092). A call that fails here fails in Keras's own build too,
    which says why.
    """
    if type(model).call is keras.Model.call or all(
            layer.built for layer in model._flatten_layers()):
        return  # no call() of its own (a GAN's): Keras leaves it unbuilt
    from keras.src import backend

    try:
        # Inputs of any batch size, as the trace then calls it: a layer
        # that keeps the batch size it was built on would keep the
        # first batch's.
        backend.compute_output_spec(model, found.symbolic_inputs(),
                                    training=False)
    except Exception:  # Keras's fit builds it again, and says why
        return


def _peek_batch(
    x: Any, batch_size: int | None, lengths: bool = False
) -> tuple[_Peeked | None, Any]:
    """The global batch fit() will use, without losing any data.

    Returns the batch size, the model input shape (for unbuilt Sequential
    models) and `x`, rebuilt when peeking consumed a generator's element;
    None for the first when a dataset's batch size can be had only by
    reading it and reading it would change what it yields later (see
    `_dataset_batch`). `lengths`: the model is traced on these shapes,
    so a generator's or `PyDataset`'s second batch is read as well, for
    the dims that vary (`_lengths_that_vary`).
    """
    import tensorflow as tf

    first = second = None
    if isinstance(x, tf.data.Dataset):
        read = _dataset_batch(x)
        if read is not None:
            # Dims its element spec leaves unknown change from batch to
            # batch: never split (`keras_graph.VARYING_DIM_SIZE`).
            return read, x
        if not _replayable(x):
            return None, x
        first = next(iter(x.take(1)))
        # The same rule for the dims its element spec leaves unknown.
        second = x.element_spec
    elif isinstance(x, keras.utils.PyDataset):
        # A batch made from the script's random streams (keras.io's
        # metric learning draws its pairs from Python's `random`): read
        # with them put back, fit's own reads draw what plain Keras's do.
        with user_random.kept():
            first = x[0]
            if lengths and _batches_of(x) != 1:
                second = x[1]
    elif hasattr(x, "__next__"):
        first = next(x)
        second = next(x, None) if lengths else None
        x = _prepend([first] if second is None else [first, second], x)
    elif is_torch_dataloader(x):
        read = _torch_batches(x, 2 if lengths else 1)
        first, second = read[0], (read[1] if len(read) > 1 else None)
    if first is not None:
        inputs = first[0] if isinstance(first, tuple) else first
        if second is not None:
            inputs = _lengths_that_vary(
                inputs, second[0] if isinstance(second, tuple) else second)
        return _Peeked(_leading_dim(inputs), inputs), x
    size = _KERAS_DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    return _Peeked(int(size), x), x


def _torch_batches(loader: Any, count: int) -> list[tuple]:
    """The first `count` batches of a PyTorch `DataLoader` (at least
    one), as Keras's adapter reads them: a tuple of NumPy arrays.

    Why: Keras 3 fits on a `DataLoader` on every backend (keras.io's
    "Introduction to Keras for engineers" and "Training & evaluation
    with the built-in methods" do). Read as an opaque object it gave no
    batch size, so the model was planned for Keras's default 32 (the
    loader's batches being 128) and a `DataLoader` as validation data
    crashed fit() ("tuple index out of range"). The batches are read
    from an iterator of their own with the script's random streams put
    back (`user_random.kept`, torch's among them): a loader that
    shuffles draws its order from torch's generator when iterated, and
    fit's own epochs must draw what plain Keras's draw.
    """
    import itertools

    with user_random.kept():
        batches = list(itertools.islice(iter(loader), count))
    if not batches:
        raise ValueError(
            f"Expected a `DataLoader` that yields batches; received "
            f"{loader!r}, which yields none (its dataset is empty).")
    return [tuple(keras.tree.map_structure(
        lambda t: np.asarray(t.cpu()) if hasattr(t, "cpu") else t, batch,
        none_is_leaf=False)) for batch in batches]


def _leading_dim(x: Any) -> int:
    """The batch dim of one batch of inputs (arrays, tensors, a list or
    dict of them)."""
    return int(np.shape(keras.tree.flatten(x)[0])[0])


def _dataset_batch(dataset: Any) -> _Peeked | None:
    """The batch a `tf.data.Dataset` yields, read from its structure
    without iterating it; None when it cannot be read.

    Why: each iterator of a dataset that shuffles (`reshuffle_each_
    iteration`) or draws random values takes the next seed, so a peek
    gave Keras's first epoch the order plain Keras's second would see
    (keras.io's mixup: other batches than plain Keras from the same
    seed). The batch size is the element spec's, else the `batch` of the
    dataset chain (through map, prefetch, zip, ...).
    """
    import tensorflow as tf

    spec = dataset.element_spec
    inputs = spec[0] if isinstance(spec, tuple) else spec
    leaves = keras.tree.flatten(inputs)
    if not leaves or not all(isinstance(s, tf.TensorSpec)
                             and s.shape.rank is not None for s in leaves):
        return None  # a `tf.numpy_function`'s output: no shape at all
    batch = leaves[0].shape[0] if leaves[0].shape.rank else None
    if batch is None:
        batch = _chain_batch_size(
            dataset, part=0 if isinstance(spec, tuple) else None)
    if batch is None:
        return None
    return _Peeked(int(batch), keras.tree.map_structure(
        lambda s: tf.TensorSpec((batch,) + tuple(s.shape[1:]), s.dtype),
        inputs,
    ))


def _unread_dataset_reason(dataset: Any) -> str:
    """Why `_peek_batch` found no batch in `dataset`, and the fix."""
    import tensorflow as tf

    specs = keras.tree.flatten(dataset.element_spec)
    if any(isinstance(s, tf.TensorSpec) and s.shape.rank is None
           for s in specs):
        return (
            "its dataset's elements have no shape (shape=<unknown>: the "
            "output of a `tf.numpy_function` or `tf.py_function`), so "
            "nothing can be planned for them. Received: element_spec="
            f"{dataset.element_spec}. Give them their shapes in the map "
            "function (`tf.ensure_shape(x, shape)` or `x.set_shape(...)`)."
        )
    return (
        "its dataset's batch size cannot be read from its structure, and "
        "reading a batch would change the order it shuffles or the values "
        f"it draws. Received: element_spec={dataset.element_spec}. Batch "
        "the inputs with one `batch(n)`, or call fit() with a dataset "
        "whose batch dim is known (`drop_remainder=True`)."
    )


# Op types whose run changes a state a later iterator sees (a shuffle's
# seed, a stateful draw, a variable, a Python generator's position).
_STATEFUL_OP_WORDS = ("Random", "Shuffle", "Seed", "PyFunc", "Generator",
                      "Assign", "Stateful", "Variable")


def _replayable(dataset: Any) -> bool:
    """Whether iterating `dataset` once leaves every later iteration as
    it would have been: no op in its graph (map functions included)
    keeps state between iterators.

    Why: a dataset whose batch size neither its element spec nor its
    chain of `batch` calls tells is read once for it; one that shuffles
    or draws must not be peeked (see `_dataset_batch`)."""
    import tensorflow as tf

    try:
        graph = tf.compat.v1.GraphDef.FromString(
            dataset._as_serialized_graph().numpy())
    except Exception:  # noqa: BLE001 - a graph we cannot read: not sure
        return False
    types = {node.op for node in graph.node}
    for function in graph.library.function:
        types.update(node.op for node in function.node_def)
    return not any(word in op for op in types for word in _STATEFUL_OP_WORDS)


def _chain_batch_size(dataset: Any, depth: int = 32,
                      part: int | None = None) -> int | None:
    """The constant `batch_size` of the last batching in `dataset`'s
    chain (every input of a zip agreeing), or None.

    `part`: only element `part` of `dataset`'s tuple elements counts
    (Keras's inputs, not its labels). It is followed through the ops that
    keep the element's structure (prefetch, repeat, shuffle, ...) to a
    zip, whose input `part` it is. Why: keras.io's semi-supervised
    SimCLR zips unlabelled images batched by 95 with labelled ones
    batched by 9; its inputs' batch is 95.
    """
    import tensorflow as tf

    size = getattr(dataset, "_batch_size", None)
    if size is not None:
        value = tf.get_static_value(size)
        return None if value is None or value < 1 else int(value)
    if depth == 0:
        return None
    inputs = getattr(dataset, "_datasets", None)
    if part is not None:
        if inputs is not None and part < len(inputs):
            return _chain_batch_size(inputs[part], depth - 1)
        source = getattr(dataset, "_input_dataset", None)
        if source is not None and source.element_spec == (
                dataset.element_spec):
            return _chain_batch_size(source, depth - 1, part)
    if inputs is None:
        inputs = [getattr(dataset, "_input_dataset", None)]
    sizes = {_chain_batch_size(d, depth - 1) for d in inputs
             if d is not None}
    return sizes.pop() if len(sizes) == 1 else None


def _prepend(read: list, rest: Iterator) -> Iterator:
    """A generator (what Keras's data adapters accept) of the elements
    already `read` + rest."""
    yield from read
    yield from rest


def _batches_of(dataset: Any) -> int | None:
    """A `PyDataset`'s number of batches; None where it does not say."""
    try:
        return dataset.num_batches
    except NotImplementedError:
        return None


def _lengths_that_vary(first: Any, other: Any) -> Any:
    """`first`'s inputs, with each dim beyond the batch that `other`
    (a second batch, or a dataset's element spec) has otherwise or
    leaves unknown made unknown (a `tf.TensorSpec` for that input).

    Why: a model whose `keras.Input` leaves its length unknown is traced
    on the data's shapes (`keras_graph.needs_trace`). Traced on the
    first batch alone, a generator of batches padded each to its longest
    got a graph of the first batch's length; its later lengths ran
    without their layouts and DTensor refused the step ("TransposeOp SPMD
    needs communication", a GRU): the model trained as plain Keras. Dims
    unknown here are `varying` and never split, as for a dataset whose
    element spec leaves them unknown. Keras itself reads two batches of
    a generator or `PyDataset` for their spec
    (`NUM_BATCHES_FOR_TENSOR_SPEC`).
    """

    def widened(value, like):
        shape = tuple(np.shape(value))
        like_shape = tuple(np.shape(like))
        if len(shape) != len(like_shape):
            return value
        dims = (shape[0],) + tuple(
            d if d == e else None for d, e in zip(shape[1:], like_shape[1:]))
        if dims == shape:
            return value
        spec = _spec_like(value, dims)
        return value if spec is None else spec

    try:
        return keras.tree.map_structure(widened, first, other)
    except (TypeError, ValueError):  # other structures: the first's
        return first


def _inputs_read_ahead(data: Any) -> tuple[Any, Any]:
    """The inputs of `data` (what evaluate or predict takes as `x`) as
    far as their lengths go, and `data` as it will be read: arrays and
    tensors as they are, a dataset's element spec, a generator's or
    `PyDataset`'s first two batches read as fit() reads its own
    (`_peek_batch`: a generator's put back in front, so nothing is
    lost); None for the first when there are none to read."""
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):
        spec = data.element_spec
        return (spec[0] if isinstance(spec, tuple) else spec), data
    if (isinstance(data, keras.utils.PyDataset) or hasattr(data, "__next__")
            or is_torch_dataloader(data)):
        try:
            found, data = _peek_batch(data, None, lengths=True)
        except StopIteration:  # an empty generator: Keras's to judge
            return None, data
        return found.inputs, data
    return data, data


def _with_validation_lengths(found: _Peeked, args: tuple, kwargs: dict,
                             read: bool = False
                             ) -> tuple[_Peeked, tuple, dict]:
    """`found`, with the dims in which fit()'s `validation_data` inputs
    differ from it made unknown (`_lengths_that_vary`), and fit()'s
    `args` and `kwargs` with that validation data as it will be read.

    Arrays and tensors are compared as they are, a dataset by its element
    spec, and where `read` (the model is traced on its data's shapes) a
    generator or `PyDataset` by its first two batches
    (`_inputs_read_ahead`). Why: the validation inside a fit runs under
    the fit's plan. Planned for the training length alone, a plan that
    split that length or spanned several meshes raised DTensor's error
    at the first validation step of another length ("requires dimension
    1 to be divisible by sharding").
    """
    import tensorflow as tf

    at = 4  # fit(x, y, batch_size, epochs, verbose, callbacks, split, VAL)
    positional = len(args) > at
    data = args[at] if positional else kwargs.get("validation_data")
    if data is None or found.inputs is None:
        return found, args, kwargs
    if isinstance(data, (tuple, list)) and data:
        inputs = data[0]
    elif isinstance(data, tf.data.Dataset) or read:
        inputs, data = _inputs_read_ahead(data)
        if positional:
            args = args[:at] + (data,) + args[at + 1:]
        else:
            kwargs = dict(kwargs, validation_data=data)
    else:
        return found, args, kwargs
    if inputs is None:
        return found, args, kwargs
    return (_Peeked(found.batch_size, _lengths_that_vary(found.inputs,
                                                          inputs)),
            args, kwargs)


def _spec_like(value: Any, dims: tuple) -> Any:
    """A `tf.TensorSpec` of `dims` and `value`'s dtype (NumPy strings
    as `tf.string`); None for Python objects, which Keras reads as they
    are."""
    import tensorflow as tf

    dtype = value.dtype if hasattr(value, "dtype") else (
        np.asarray(value).dtype)
    if isinstance(dtype, np.dtype) and dtype.kind in "US":
        dtype = tf.string
    try:
        return tf.TensorSpec(dims, tf.as_dtype(dtype))
    except TypeError:
        return None


def _shape_of(inputs: Any) -> Any:
    if inputs is None:
        return None
    shapes = [(None,) + tuple(np.shape(t))[1:] for t in keras.tree.flatten(
        inputs)]
    return shapes[0] if len(shapes) == 1 else shapes


# Saved files name the Keras classes, so plain `keras.models.load_model`
# reads what flexflow_keras saves; `load_model` below maps them back.
api_export.REGISTERED_OBJS_TO_NAMES[Model] = "keras.Model"
api_export.REGISTERED_OBJS_TO_NAMES[Functional] = "keras.Model"
api_export.REGISTERED_OBJS_TO_NAMES[Sequential] = "keras.Sequential"
_OWN_CLASSES = {
    "keras.Model": Model,
    "keras.Functional": Model,
    "keras.Sequential": Sequential,
}


@contextlib.contextmanager
def _loading_as_ours(custom_objects: dict | None) -> Iterator[dict]:
    """While loading, Keras's model class names resolve to our classes;
    yields the `custom_objects` to load with.

    Why: saved configs name `keras.Model`/`keras.Sequential` with no
    registered name, so `custom_objects` is never consulted for them;
    plain Keras saves functional models as registered name `Functional`,
    which `custom_objects` maps (Model(...) dispatches to Functional).
    """
    objects = {"Functional": Model}
    objects.update(custom_objects or {})
    table = api_export.REGISTERED_NAMES_TO_OBJS
    saved = {name: table.get(name) for name in _OWN_CLASSES}
    table.update(_OWN_CLASSES)
    try:
        yield objects
    finally:
        for name, obj in saved.items():
            if obj is None:
                table.pop(name, None)
            else:
                table[name] = obj


def as_flexflow_model(model: Any) -> Any:
    """`model` as our Model: the same layers and weights in a Functional
    of our class (a plain Keras functional model, e.g. from
    `keras.applications`); anything else unchanged."""
    if isinstance(model, _PlanningModel) or not isinstance(
        model, KerasFunctional
    ):
        return model
    return Model(model._inputs_struct, model._outputs_struct,
                 name=model.name, trainable=model.trainable)


def clone_model(model: Any, *args: Any, **kwargs: Any) -> Any:
    """`keras.models.clone_model`, returning flexflow_keras models."""
    clone = keras.models.clone_model(model, *args, **kwargs)
    if isinstance(clone, keras.Sequential) and not isinstance(
        clone, Sequential
    ):
        ours = Sequential(name=clone.name, trainable=clone.trainable)
        for layer in clone._layers:  # the InputLayer first, if any
            ours.add(layer)
        return ours
    return as_flexflow_model(clone)


def model_from_json(json_string: str, custom_objects: dict | None = None):
    """`keras.models.model_from_json`, returning flexflow_keras models."""
    with _loading_as_ours(custom_objects) as objects:
        return keras.models.model_from_json(json_string, objects)


def deserialize_keras_object(config: Any, custom_objects: dict | None = None,
                             **kwargs: Any) -> Any:
    """`keras.saving.deserialize_keras_object`, returning flexflow_keras
    models (a model's config, as `serialize_keras_object` wrote it, came
    back a plain Keras model, which trained on one device)."""
    with _loading_as_ours(custom_objects) as objects:
        return keras.saving.deserialize_keras_object(
            config, custom_objects=objects, **kwargs)


def deserialize_layer(config: dict, custom_objects: dict | None = None
                      ) -> Any:
    """`keras.layers.deserialize`, returning flexflow_keras models (a
    model's config, as `keras.layers.serialize` wrote it, came back a
    plain Keras model, which trained on one device)."""
    with _loading_as_ours(custom_objects) as objects:
        return keras.layers.deserialize(config, custom_objects=objects)


def load_model(
    filepath: Any,
    custom_objects: dict | None = None,
    compile: bool = True,
    safe_mode: bool = True,
) -> keras.Model:
    """`keras.models.load_model`, returning flexflow_keras models.

    Reads files saved by plain Keras too.
    """
    with _loading_as_ours(custom_objects) as objects:
        return keras.models.load_model(
            filepath,
            custom_objects=objects,
            compile=compile,
            safe_mode=safe_mode,
        )
