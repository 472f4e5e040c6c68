"""The model's own train/test/predict step, run under a one-mesh strategy.

Keras's `fit` calls `model.train_step(data)`: the user's override if
there is one, else Keras's (forward pass, `compute_loss` with `add_loss`
and regularization losses, gradient tape, the optimizer's own `apply`,
`compute_metrics`). Here that very function is traced once per batch
shape into a DTensor `tf.function`, with the strategy underneath:

- every Keras variable the step touches (weights, optimizer slots and
  counters, metric and seed state) is backed by a `StepVariable` (a
  DVariable) while the step is traced; weights are laid out per op
  (`OpPlan.weight_layout`), optimizer slots like their weight, the rest
  replicated;
- each call of a layer that is an op of the graph has its tensor
  inputs relaid to the op's input layouts and its outputs to the op's
  output layouts (`OpPlan`), so each op runs split as the search chose;
- batches come in replicated on the mesh and are sliced by the first
  op's input relayout (a local slice, no communication).

Why one mesh: a user's step mixes tensors freely (labels with outputs,
the batch size with metric totals, the optimizer's step counter with
every weight); DTensor runs an op only on inputs of one mesh. Strategies
over several meshes run with `step.Executor` (layer by layer, Keras's
default step only).
"""

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import keras
import numpy as np
import optree
import tensorflow as tf
from keras import tree
from keras.src.backend import get_keras_mask, set_keras_mask
from keras.src.ops.operation import Operation
from keras.src.optimizers.base_optimizer import BaseOptimizer
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context, record

from flexflow_keras import capabilities
from flexflow_keras import user_random
from flexflow_keras.keras_graph import overrides_step
from flexflow_keras.model_state import state_of
from flexflow_keras.runtime import (
    deferred, fresh_state, op_rules, raw_variables, realized, rolled_rnn,
    stateful_draws, step_prints, step_rules, unfed_step, unknown_batch,
    unroll, untracked, varying_shapes,
)
from flexflow_keras.runtime.fallback import (
    collectives_aborted, fall_back, failed_while_running, op_to_replicate,
    to_data_parallel, to_plain_keras,
)
from flexflow_keras.runtime.host_prefix import CalledElsewhere, HostPrefix
from flexflow_keras.runtime.keras_functions import keras_function
from flexflow_keras.runtime.layouts import OpPlan, replicated
from flexflow_keras.runtime.tracing import step_function
from flexflow_keras.runtime.variables import (
    Transfers, argument_constants, attributes_set, captures_on_mesh,
    densified, gather, layer_constants, padded, replicate, to_layout,
    unpadded,
)


def one_mesh(plans: tuple[OpPlan, ...]) -> Any:
    """The mesh every op runs on, or None when they use several."""
    meshes = {plan.mesh for plan in plans}
    return meshes.pop() if len(meshes) == 1 else None


# -- layer calls relaid per op ------------------------------------------------

_ACTIVE: list["ModelStepExecutor"] = []  # executors tracing a step
_MAX_REPLICATED = 4  # ops a step may turn replicated before plain Keras
_KERAS_CALL = Operation.__call__


def _call_with_layouts(operation, *args, **kwargs):
    """`Operation.__call__`, with an op's layouts while a step is traced.

    Installed once on Keras's `Operation` (layers and `keras.ops` nodes
    of a functional model both come through it, inside `Layer.__call__`,
    so masks and autocasting work as in Keras).
    """
    if not _ACTIVE:
        return _KERAS_CALL(operation, *args, **kwargs)
    return _ACTIVE[-1].call_op(operation, args, kwargs)


Operation.__call__ = _call_with_layouts


class SecondOrderSplits(Exception):
    """A step takes second-order gradients under a strategy that splits
    more than the batch (`ModelStepExecutor.call_op`)."""


class _TapeDepth:
    """How many `tf.GradientTape`s are open (counted while a step is
    traced: `ModelStepExecutor._realized`)."""

    def __init__(self):
        self.depth = 0
        self._enter = tf.GradientTape.__enter__
        self._exit = tf.GradientTape.__exit__

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        counter = self

        def enter(tape):
            counter.depth += 1
            return counter._enter(tape)

        def exit_(tape, *exc):
            counter.depth -= 1
            return counter._exit(tape, *exc)

        tf.GradientTape.__enter__, tf.GradientTape.__exit__ = enter, exit_
        try:
            yield
        finally:
            tf.GradientTape.__enter__ = self._enter
            tf.GradientTape.__exit__ = self._exit
            self.depth = 0


_TAPES = _TapeDepth()


def _is_traced_tensor(value: Any) -> bool:
    return isinstance(value, tf.Tensor) and not isinstance(
        value, keras.KerasTensor
    )


class ModelStepExecutor:
    """Runs a model's own steps under a strategy whose ops share a mesh.

    Same interface as `step.Executor` (`make_function`, `sync_in`,
    `sync_out`, `dirty`, `single_device`).

    Args:
        model: The compiled Keras model.
        graph: Its `OpGraph` at the strategy's global batch size.
        plans: The op plans (`layouts.plan_ops`), all on one mesh.
    """

    single_device = None

    def __init__(self, model: Any, graph: Any, plans: tuple[OpPlan, ...]):
        self.model = model
        self.graph = graph
        self.plans = plans
        self.mesh = one_mesh(plans)
        assert self.mesh is not None, "plans span several meshes"
        # Several processes drive the mesh (DTensor multi-client mode):
        # each feeds its own rows of a batch (`_on_mesh`).
        self._split_feed = (
            len(self.mesh.local_devices()) < self.mesh.size
            and graph.batch_size % self.mesh.dim_size(
                self.mesh.dim_names[0]) == 0
        )
        self.dirty = False  # StepVariables newer than the Keras variables
        # Step kinds that write Keras state besides metrics: train, and
        # test or predict steps that advance a seed or a layer's state.
        self._writing_kinds = {"train"}
        # Keras values and StepVariables last made equal (realized from
        # the Keras values, or copied)
        self._last_copy = fresh_state.LastCopy()
        self._plans_of: dict[int, list[OpPlan]] = {}
        for plan in plans:
            self._plans_of.setdefault(id(plan.op.layer), []).append(plan)
        self._sharded = True  # the batch being traced is split
        self._in_call = 0  # depth of op calls and `_call_outside`s
        self._pairs: list[tuple[Any, Any, Any]] = []  # keras, step, layout
        # Keras variables the step used that the model does not track
        # (`untracked`), found while it was traced.
        self._untracked: list = []
        self._key_map: dict[int, int] = {}  # StepVariable key -> Keras's
        self._constants: list = []  # layer tensors, copied onto the mesh
        # Counters of stateful tf.random draws (`stateful_draws`).
        self._random_state = None
        # Copies of the raw tf.Variables a step writes (`raw_variables`).
        self._raw_variables = raw_variables.RawVariables(self.mesh)
        self._splits_beyond_batch = any(
            dim != 0 for plan in plans for dim in plan.axes
        )
        self._functions: dict[tuple, Any] = {}  # `mesh_key` -> step
        self._ran: set[tuple] = set()  # `mesh_key`s of steps that ran
        # The key of each batch's step, for batches whose lengths change
        # (`varying_shapes`), and the key of the batch run last.
        self._signatures = varying_shapes.Signatures()
        self._last_key: tuple | None = None
        self._learning_rates: dict[int, float] = {}
        self._transfers = Transfers(self.mesh)
        # Ops a first run found DTensor could not lay out, now replicated.
        self.replicated_ops: list[str] = []
        # Steps traced with the batch dim known: from the start where
        # the model's call needs the batch as a number (`keras_graph.
        # trace_call`); its layers' outputs have an unknown rank else.
        self._static_batch = state_of(model).traced_batch is not None
        # The model's outputs whole on every device rather than split on
        # their batch, for the user's code after them (`_failed`).
        self._outputs_whole = False
        # Recurrent layers run rolled until a first run fails (`_failed`).
        self.loops = unroll.Loops(plans)
        # Lookup layers on raw features run on the host before each step
        # (`host_prefix`); while a step is traced, their calls return
        # the results the step was given.
        self._host = HostPrefix(model) if graph.hosted_inputs else None
        self._hosting = False  # a step with hosted results is traced
        # What one train step draws and applies (`unfed_step`).
        self._unfed = unfed_step.Recorder()

    @property
    def retries(self) -> list[str]:
        """What first runs that failed in DTensor were retried with: ops
        made replicated, "static batch" and "outputs whole" (`_failed`)."""
        return self.replicated_ops + (
            ["static batch"] if self._static_batch else []
        ) + (["outputs whole"] if self._outputs_whole else [])

    # -- variables ----------------------------------------------------------

    def _realize(self) -> bool:
        """One StepVariable per Keras variable the step can touch; True
        if any was added.

        Runs before each step's first trace (after `_build`), and again
        after it for the variables the trace itself created (a custom
        step's optimizer built on first use, say), or read that the model
        does not track (`untracked`: layers of the graph the model does not
        hold, and whatever the trace found), so that no variable of the
        step stays a regular, single-device one.
        """
        layouts: dict[int, Any] = {}
        for plan in self.plans:
            for var in getattr(plan.op.layer, "variables", ()):
                layouts.setdefault(id(var), plan.weight_layout(
                    tuple(var.shape), plan.shard_axis_of(var)))
        for optimizer in _optimizers(self.model):
            layouts.update(_slot_layouts(optimizer, layouts))
        seen = {id(k) for k, _, _ in self._pairs}
        added = False
        graph_layers = [v for plan in self.plans
                        for v in getattr(plan.op.layer, "variables", ())]
        for var in (_state_variables(self.model) + graph_layers
                    + self._untracked):
            if id(var) in seen:
                continue
            seen.add(id(var))
            layout = layouts.get(id(var)) or replicated(
                self.mesh, len(var.shape)
            )
            # Named as Keras's own variable (`dense/kernel`): Keras's
            # optimizers match `exclude_from_weight_decay(var_names=...)`
            # against the name of the variable they update, which is this
            # one in the step; unnamed, AdamW decayed the excluded
            # BatchNormalization gammas and biases.
            step_var = deferred.StepVariable(
                to_layout(var.value, layout), trainable=var.trainable,
                name=var.value.name.split(":")[0],
            )
            self._pairs.append((var, step_var, layout))
            self._key_map[step_var._unique_id] = var.value._unique_id
            fresh_state.watch(self, [var])
            added = True
        if not self._constants:
            # The graph's layers too: those the model does not hold
            # (`untracked`; an adapted Normalization's mean and variance).
            held = {id(layer) for layer in self.model._flatten_layers()}
            self._constants = layer_constants(self.model, self.mesh) + [
                constant for plan in self.plans
                if id(plan.op.layer) not in held
                for constant in layer_constants(plan.op.layer, self.mesh)
            ] + [
                change for plan in self.plans
                for change in argument_constants(plan.op.arguments,
                                                 self.mesh)
            ]
        if self._random_state is None:  # for `stateful_draws`
            with user_random.kept():  # seeded, not taken from the user
                self._unseeded_key = int(np.random.randint(2**31))
            self._random_state = deferred.StepVariable(
                to_layout(np.zeros(stateful_draws.SLOTS, np.int64),
                          replicated(self.mesh, 1)), trainable=False
            )
        return added

    def _build(self, data: Any, kind: str) -> None:
        """Builds what Keras would build in the first traced step (the
        compiled metrics and loss, the optimizer's slots, layers the
        model's own step builds on first use), from a batch."""
        model = self.model
        if getattr(self, "_built", False):
            return
        self._built = True
        # Keras builds the compiled metrics and loss on what the step
        # passes them: a step of the user's may pass other outputs than
        # the model's (keras.io's PatchConvNet: the logits of its two
        # outputs; built on both, its top-5 accuracy left the logs).
        if not overrides_step(model):
            try:
                model._symbolic_build(data_batch=data)
                return
            except Exception:  # noqa: BLE001 - e.g. a model without call()
                pass
        # Keras builds the rest in the first trace; the variables it
        # makes there are realized and the step traced again.
        # First: an optimizer built before them would not know them.
        _layers_built_by_a_plain_trace(model, kind, data)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)

    def sync_in(self) -> None:
        """Keras values -> StepVariables, unless those are newer, or equal
        (no Keras variable written since the last copy; the metric state
        goes in apart, `sync_metrics_in`)."""
        if self.dirty:
            return
        metric_ids = _metric_variable_ids(self.model)
        if self._last_copy.stale(
            var for var, _, _ in self._pairs if id(var) not in metric_ids
        ):
            self._transfers.copy_in(self._pairs)
            self._last_copy.mark()

    def sync_out(self) -> None:
        """StepVariables -> Keras values, if training changed them: those
        a step writes. The others are left alone: a variable the step
        only reads, or not at all, may be written elsewhere meanwhile
        (keras.io's CutMix draws without a seed in its `tf.data`
        pipeline, from Keras's global seed state; copied back at each
        epoch's end, that state went back and the pipeline drew the
        same numbers again)."""
        if self.dirty:
            self._transfers.copy_out(
                [pair for pair in self._pairs if pair[1].written])
            self.dirty = False
            self._last_copy.mark()

    def sync_metrics_in(self) -> None:
        """Metric state Keras reset eagerly -> StepVariables."""
        self._transfers.copy_in(self._metric_pairs())

    def sync_metrics_out(self) -> None:
        """StepVariables -> metric state, for Keras's eager reads."""
        self._transfers.copy_out(self._metric_pairs())

    def _metric_pairs(self) -> list[tuple[Any, Any, Any]]:
        metric_ids = _metric_variable_ids(self.model)
        return [pair for pair in self._pairs if id(pair[0]) in metric_ids]

    def _push_learning_rates(self) -> None:
        """Learning rates a callback set since the last step (Keras
        callbacks set them between steps, on the Keras variable)."""
        for optimizer in _optimizers(self.model):
            variable = vars(optimizer).get("_learning_rate")
            if not isinstance(variable, keras.Variable):
                continue
            value = float(variable.numpy())
            if value != self._learning_rates.get(id(variable)):
                self._transfers.copy_in(
                    [pair for pair in self._pairs if pair[0] is variable]
                )
                self._learning_rates[id(variable)] = value

    @contextlib.contextmanager
    def _realized(self, kind: str) -> Iterator[None]:
        """While tracing: Keras variables read and write StepVariables,
        layer calls take their op's layouts, `ops.cond` selects, ops
        DTensor cannot run are replaced (`op_rules`)."""
        step_vars = [s for _, s, _ in self._pairs] + [self._random_state]
        saved = [(k, k._value) for k, _, _ in self._pairs]
        keys = []
        for optimizer in _optimizers(self.model):
            keys.append((optimizer, optimizer.__dict__.get("_var_key")))
            optimizer._var_key = self._stable_key(optimizer._var_key)
        for var, step_var, _ in self._pairs:
            var._value = step_var
        _ACTIVE.append(self)
        try:
            with deferred.deferring(step_vars) as written, \
                    step_rules.traced_as_steps(
                        self.mesh, step_vars, self._random_state, kind,
                        self._unseeded_key), \
                    attributes_set(self._constants), _TAPES.counting(), \
                    untracked.recording({id(k) for k, _, _ in self._pairs},
                                        self._untracked):
                yield
            self._note_state_written(kind, written)
        finally:
            _ACTIVE.pop()
            for var, value in saved:
                var._value = value
            for optimizer, key in keys:
                if key is None:
                    del optimizer._var_key
                else:
                    optimizer._var_key = key

    def _note_state_written(self, kind: str, written: list) -> None:
        """Steps of `kind` write Keras state other than metrics, where
        `written` (the StepVariables a trace of one writes) has any.

        Why: the Keras variables are copied out only after a step that
        makes them `dirty`. Keras's recurrent layers draw their dropout
        masks at every call, inference included, so a predict or
        evaluate advances their seed generators; left unmarked, that
        state went back to the Keras values at the next copy in (a
        fit on a new plan), and the next fit's dropout masks were
        other than plain Keras's after a predict."""
        metric_ids = _metric_variable_ids(self.model)
        keras_of = {id(step_var): var for var, step_var, _ in self._pairs}
        if any(id(keras_of[id(v)]) not in metric_ids
               for v in written if id(v) in keras_of):
            self._writing_kinds.add(kind)

    def _stable_key(self, var_key: Any) -> Any:
        """The optimizer's `_var_key`, giving a StepVariable its Keras
        variable's key (slot indices were built from those)."""

        def stable(variable):
            key = var_key(variable)
            return self._key_map.get(key, key)

        return stable

    # -- op calls (trace time) ----------------------------------------------

    def call_op(self, operation: Any, args: tuple, kwargs: dict) -> Any:
        if self._hosting and id(operation) in self._host.layers:
            # Computed on the host before the step.
            return self._host.result(operation, args, kwargs)
        # Every Embedding's call, an op's or one inside a layer of the
        # user's (keras.io's positional embedding), or RMSprop's sparse
        # update of its table fails.
        args, kwargs = op_rules.int32_indices(operation, args, kwargs)
        plans = self._plans_of.get(id(operation))
        if _TAPES.depth > 1 and self._splits_beyond_batch:
            raise SecondOrderSplits(
                f"Model '{self.model.name}' takes gradients of gradients "
                "in its own step (a tape inside a tape), which TensorFlow's "
                "DTensor computes wrongly over weights or activations split "
                "beyond the batch (measured: losses 0.3% off what Keras "
                "computes), "
                "so it trains under data parallelism over the same "
                f"{self.mesh.size} devices instead of its searched strategy."
            )
        if not plans and not self._in_call and _TAPES.depth < 2 \
                and not self._holds_op(operation):
            return self._call_outside(operation, args, kwargs)
        if not plans or _TAPES.depth > 1:
            # Inside a tape inside a tape (a gradient penalty's second-
            # order gradient): DTensor's second-order gradient through
            # relayouts kills the process (measured, TF 2.21: a batch-
            # split input relaid, reshaped and relaid again), so those
            # calls run on the layouts DTensor propagates.
            return _KERAS_CALL(operation, *args, **kwargs)
        leaves = [x for x in tree.flatten((args, kwargs))
                  if _is_traced_tensor(x)]
        plan = _matching_plan(plans, leaves)
        layouts = {}  # by the graph's shapes: traced ones have batch None
        for pos, value in enumerate(leaves[: len(plan.op.inputs)]):
            layout = plan.layout_of_call_input(
                pos, tuple(value.shape), self._sharded)
            if layout is not None:
                layouts[pos] = layout
        # By position, not by tensor: self-attention passes one tensor as
        # query and value, whose layouts differ under a sequence split
        # (keyed by tensor, the query came in replicated: `realized.py`).
        positions = iter(range(len(leaves)))
        copies = []  # (the caller's tensor, the one the call gets)

        def relaid(value):
            if not _is_traced_tensor(value):
                return value
            pos = next(positions)
            layout = layouts.get(pos)
            if layout is None:
                return value
            step_input = (pos < len(plan.op.inputs)
                          and plan.op.inputs[pos] in self.graph.inputs)
            copies.append((value, relaid_like_keras(
                value, layout, gradient_whole=step_input)))
            return copies[-1][1]

        args, kwargs = tree.map_structure(relaid, (args, kwargs))
        inner = any(op_rules.splits_inner_dims(layout)
                    for layout in layouts.values())
        with self.loops.running(operation), self._inside(), \
                op_rules.inner_splits_kept(inner):
            outputs = _KERAS_CALL(operation, *args, **kwargs)
        _masks_as_the_call_left_them(copies)
        flat = tree.flatten(outputs)
        placed = []
        for index, value in enumerate(flat):
            if _is_traced_tensor(value) and index < len(plan.op.outputs):
                layout = plan.output_layout(
                    index, value.shape.rank, self._sharded
                )
                value = relaid_like_keras(value, layout)
                if plan.op.outputs[index] in self.graph.outputs:
                    value = relaid_like_keras(
                        value, replicated(self.mesh, value.shape.rank)
                        if self._outputs_whole else _batch_only(layout))
            placed.append(value)
        return tree.pack_sequence_as(outputs, placed)

    def _call_outside(self, operation: Any, args: tuple,
                      kwargs: dict) -> Any:
        """A call, outside any op's, of a layer that holds no op (a
        teacher used only in `compute_loss`): its batch tensors (batch
        dim unknown) in and out take the batch layout of the model's
        outputs, so that DTensor sees one layout from its inputs to its
        outputs.

        Why: DTensor's Conv2D expander keeps its input's layout, while
        layout propagation gives its output the one its consumers ask
        for. A conv fed the replicated batch whose result meets the
        batch-split outputs failed ("SPMD expansion resulted in op
        output inconsistent with the provided layout. Expected shape:
        <256,7,7,32> got shape: <64,7,7,32>").
        """
        layout_of = self._outside_layout
        copies = []  # (the caller's tensor, the one the call gets)

        def placed(value):
            if not _is_traced_tensor(value) or not value.shape.rank \
                    or value.shape[0] is not None:
                return value
            return relaid_like_keras(value, layout_of(value.shape.rank))

        def placed_input(value):
            relaid = placed(value)
            if relaid is not value:
                copies.append((value, relaid))
            return relaid

        args, kwargs = tree.map_structure(placed_input, (args, kwargs))
        with self._inside():
            outputs = _KERAS_CALL(operation, *args, **kwargs)
        _masks_as_the_call_left_them(copies)
        return tree.map_structure(placed, outputs)

    def _outside_layout(self, rank: int) -> Any:
        """The model's outputs' batch layout (`_batch_only`), at `rank`;
        replicated where they are whole (`_outputs_whole`)."""
        axis = None
        if self._sharded and not self._outputs_whole:
            for plan in self.plans:
                if any(o in self.graph.outputs for o in plan.op.outputs):
                    axis = plan.axes.get(0)
                    break
        if axis is None:
            return replicated(self.mesh, rank)
        return dtensor.Layout(
            [axis] + [dtensor.UNSHARDED] * (rank - 1), self.mesh
        )

    def _holds_op(self, operation: Any) -> bool:
        """Whether `operation` is, or holds as a sublayer, an op of the
        graph (a model around its ops, as `model(x)` in Keras's step)."""
        flatten = getattr(operation, "_flatten_layers", None)
        if flatten is None:
            return True  # not a layer: as before, untouched
        return any(id(layer) in self._plans_of for layer in flatten())

    @contextlib.contextmanager
    def _inside(self) -> Iterator[None]:
        """Inside an op's call or a `_call_outside`: sublayer calls run
        on the layouts DTensor propagates."""
        self._in_call += 1
        try:
            yield
        finally:
            self._in_call -= 1

    # -- steps ----------------------------------------------------------------

    def _trace(self, key: tuple, data: Any) -> Any:
        """The step of `key` (`mesh_key`, or a relaxed one) for `data`,
        traced with the batch dim unknown, as Keras traces its step on a
        dataset's element spec, unless rolled loops or DTensor need it
        static (then `unknown_batch` keeps the per-output loss trackers'
        weighting as on Keras's trace); other dims as `key` has them
        (unknown where batches' lengths differ: `varying_shapes`).

        One function per batch size: a batch of another size than the
        strategy's (the last partial batch, evaluate/predict batches)
        runs with the batch dim unsharded on the same mesh. And one per
        batch structure (`step_key`).
        """
        kind = key[0]
        batch = data.batch
        step = getattr(self.model, f"{kind}_step")

        def traced_once() -> Any:
            printed = step_prints.PrintedOnce()  # the trace's tf.print

            # No AutoGraph, as Keras traces its own steps (so a step runs
            # as it does in Keras), and no converted-call cache to go stale.
            @step_function
            def traced(values, shapes):
                data = _unpadded(values, shapes)
                self._sharded = batch == self.graph.batch_size
                if self._host is not None:  # (batch, hosted results)
                    data, hosted = data
                    self._host.begin(data, hosted, kind == "train")
                    self._hosting = True
                # `realized.record` traces the step once more, through
                # here, to read the layouts DTensor gives each op.
                record = (self._unfed.recording() if kind == "train"
                          else contextlib.nullcontext())
                # Traced with the batch size written in, Keras code that
                # reads it must act as on Keras's own trace.
                static = (unknown_batch.loss_trackers_unweighted(self.model)
                          if _batch_of(values) is not None
                          else contextlib.nullcontext())
                with self._realized(kind), realized.recording(
                        self, lambda: _TAPES.depth > 1) as returned, \
                        record, static, step_prints.kept(
                            tf.compat.v1.get_default_graph(), printed):
                    try:
                        outputs = step(data)
                    finally:
                        if self._hosting:
                            self._hosting = False
                            self._host.end()
                # Gathered here, in the step, rather than by an eager
                # relayout per output after it (a DTensor dispatch each).
                return returned(tree.map_structure(
                    lambda v: _replicated_output(v, self.mesh), outputs
                )), [_replicated_output(t, self.mesh)
                     for t in printed.tensors]

            concrete = traced.get_concrete_function(_specs(
                data.values, self._static_batch or self.loops.recurrent,
                varying_shapes.Signatures.dims(key),
            ), data.shapes)
            captures_on_mesh(concrete, self.mesh)
            return _StepFunction(traced, kind,
                                 self._raw_variables.swap_in(concrete),
                                 printed)

        # A first run DTensor refuses for a loop function's name is
        # traced again and redone (`rolled_rnn.name_clash`).
        function = rolled_rnn.RedoneOnNameClash(traced_once)
        if self._realize():  # the trace made variables: trace anew
            self._functions.clear()
            function = rolled_rnn.RedoneOnNameClash(traced_once)
        self._functions[key] = function
        return function

    @staticmethod
    def mesh_key(kind: str, batch: "_MeshBatch") -> tuple:
        """`mesh_key`, for `realized.record` (which this module imports)."""
        return mesh_key(kind, batch)

    def _on_mesh(self, data: Any, kind: str) -> "_MeshBatch":
        """Each tensor of a batch onto the mesh: replicated (one local
        copy per device) in one process; in DTensor's multi-client mode,
        a tensor of the strategy's batch is split on its batch dim over
        the mesh's first axis, each client packing only its own devices'
        rows (`_own_rows`). With layers run on the host (`host_prefix`),
        the batch comes with their results: `(data, results)`.

        A replicated tensor DTensor would take for a small constant (a
        batch of 16 labels) goes in padded (`variables.padded`): else
        the step is expanded again at the first batch whose values
        differ, which costs a second SPMD expansion and, for a step with
        `rolled_rnn` loops, fails (the loops' functions are named after
        their nodes: "a different function with the same name already
        exists")."""
        size = _batch_of(data)
        if self._host is not None:
            data = (data, self._host.compute(data, kind == "train"))
        shapes = []

        def copy(value):
            if isinstance(value, np.ndarray):
                value = tf.convert_to_tensor(value)
            value = densified(value)
            if not isinstance(value, tf.Tensor):
                shapes.append(None)
                return value
            # Strings stay regular tensors (the host's lookups read
            # them), but are padded too: 16 strings are as small a
            # constant.
            strings = value.dtype == tf.string
            if (not strings and self._split_feed
                    and _batch_of(value) == self.graph.batch_size):
                shapes.append(None)
                return _own_rows(value, self.mesh)
            small = padded(value) if value.shape.rank else value
            shapes.append(None if small is value else tuple(value.shape))
            return small if strings else replicate(small, self.mesh)

        values = tree.map_structure(copy, data)
        return _MeshBatch(values, tuple(shapes), size)

    def run(self, kind: str, data: Any) -> Any:
        """One step of `kind` on one batch; regular tensors out."""
        self._last_key = None
        if kind != "predict":
            self._build(data, kind)  # once
        batch = self._on_mesh(data, kind)  # once: copies, host calls
        key = self._last_key = self._signatures.key_for(
            mesh_key(kind, batch), self._functions,
            static=self._static_batch or self.loops.recurrent)
        function = self._functions.get(key)
        if function is None:
            self._realize()
            function = self._trace(key, batch)
        if kind == "train":
            self._push_learning_rates()
        outputs = function(batch)
        first = key not in self._ran
        if first:
            # DTensor runs functions asynchronously: a first run's error
            # would surface at some later op, past `_failed`'s reach.
            context.async_wait()
        self._ran.add(key)
        if kind in self._writing_kinds:
            self.dirty = True
        if kind == "train" and first:  # FLEXFLOW_KERAS_SHOW_LAYOUTS
            realized.show_once(self, data)
        return tree.map_structure(_regular, outputs)

    def make_function(self, kind: str) -> Any:
        """`model.{kind}_function` (`keras_functions.keras_function`)."""
        return keras_function(self.model, kind, self.run, self._failed,
                              self._unfed.replay if kind == "train" else None)

    def _traced_again(self, kind: str, batches: Any) -> Any:
        """`batches` redone by steps traced anew (after a first run or
        trace that changed nothing, with a mode of `_failed` changed)."""
        self._functions.clear()
        return self.make_function(kind)(batches)

    def _failed(self, kind: str, error: Exception, batches: Any,
                batch: Any) -> Any:
        """A DTensor failure of a step's first run, or an op without a
        DTensor rule, hands the model to plain Keras (`fall_back`): the
        step is one function whose writes come at its end, so it
        changed nothing."""
        if isinstance(error, SecondOrderSplits):  # found while tracing
            return to_data_parallel(self.model, self.graph, self.mesh.size,
                                    kind, str(error), batches)
        if isinstance(error, (CalledElsewhere,
                              varying_shapes.TooManyLengths)):
            return to_plain_keras(self.model, kind, str(error), batches)
        key = self._last_key  # None: failed before its step was known
        if (not isinstance(error, tf.errors.OpError)
                and key not in self._functions
                and not (self._static_batch or self.loops.recurrent)):
            # The step's own code failed as it was traced on an unknown
            # batch dim, where Keras traced it on a dataset's known one
            # (keras.io's NNCLR: `tf.shape(x, out_type=tf.float32)`, which
            # TensorFlow writes as a constant for a known shape and
            # refuses otherwise): traced again, the batch size written in.
            self._static_batch = True
            return self._traced_again(kind, batches)
        if not isinstance(error, tf.errors.OpError):
            raise error
        if collectives_aborted(error):  # no retrace can help
            return fall_back(self.model, kind, error, batches, False)
        first = key not in self._ran
        if first:
            context.async_clear_error()
        if first and failed_while_running(error):  # Keras decides
            return fall_back(self.model, kind, error, batches, False, True)
        if first and self.loops.unroll_instead():
            # Rolled loops DTensor refuses (before the last output came
            # from the loop's carries: "operand #0 does not dominate this
            # use" under a Dense on fewer devices after the RNN) run
            # unrolled; the step is traced again and redone.
            return self._traced_again(kind, batches)
        op = op_to_replicate(error) if first else None
        if (op is not None and op not in self.replicated_ops
                and len(self.replicated_ops) < _MAX_REPLICATED
                and not capabilities.crashing_ops([op])):
            # The op DTensor blamed runs replicated (its switch), the
            # rest keeps its layouts; the failed first run changed
            # nothing, so the step is traced again and redone.
            self.replicated_ops.append(op)
            op_rules.enable([op])
            return self._traced_again(kind, batches)
        if first and not (self._static_batch or self.loops.recurrent):
            # DTensor expands some ops only on static shapes ("failed to
            # extract constant value", "requires output type to have
            # statically known rank": a reshape or tile whose shape comes
            # from the unknown batch dim, as in a gradient penalty's
            # second-order gradient or a causal mask built with
            # `ops.tile`): the steps are traced again with their batch
            # size written in (each batch size has its own step anyway).
            self._static_batch = True
            return self._traced_again(kind, batches)
        if first and not self._outputs_whole:
            # DTensor fails on some code of the user's step outside the
            # layers, on the batch-split outputs ("EmitAllScatter was
            # passed a desired_layout ... not more sharded": a contrastive
            # loss subtracting each row's maximum from its columns,
            # keras.io's semantic image clustering): the step is traced
            # again with the model's outputs whole on every device, so
            # that code runs replicated; the layers keep their layouts.
            self._outputs_whole = True
            return self._traced_again(kind, batches)
        return fall_back(self.model, kind, error, batches, False, first)


def _layers_built_by_a_plain_trace(model: Any, kind: str, data: Any) -> None:
    """Builds the layers `model`'s own step builds on first use by
    tracing that step once in plain TensorFlow, as Keras's own first
    trace builds them (traced, never run).

    Why: a subclassed model holding an encoder `Sequential` without an
    `Input`, first called in its `train_step` (keras.io's semi-supervised
    SimCLR). Built inside the DTensor trace, the encoder's initial
    weights went through the step's layouts, which TensorFlow then ran
    on a regular device ("No OpKernel was registered to support Op
    'Relayout'"): the variables were left empty, and the model failed in
    plain Keras too. Where the step applies `self.optimizer`, the
    optimizer was built first, without them ("Unknown variable ... This
    optimizer can only be called for the variables it was originally
    built with"). Built here, they draw the values Keras's first trace
    draws, and the runtime lays them out as any other (`_realize`).
    """
    unbuilt = [layer for layer in model._flatten_layers(include_self=False)
               if not layer.built and layer.weights == []
               and type(layer).build is not keras.layers.Layer.build]
    # The optimizers a custom `compile` keeps (`model.optimizer` is built
    # by the caller): a first DTensor trace that failed after making
    # their slots (keras.io's NNCLR, traced again with a static batch)
    # left the slots empty ("Incompatible shapes: [128,128] vs. [0]").
    unbuilt += [optimizer for optimizer in _optimizers(model)
                if not optimizer.built
                and optimizer is not getattr(model, "optimizer", None)]
    if not unbuilt:
        return
    without_input = [layer for layer in unbuilt
                     if isinstance(layer, keras.Sequential) and layer.layers]
    step = getattr(model, f"{kind}_step")
    tf.function(step, autograph=False).get_concrete_function(data)
    # Inner ones first: an outer one calls them again.
    for sequential in reversed(without_input):
        _for_any_batch_size(sequential)


def _for_any_batch_size(sequential: Any) -> None:
    """Builds again, for batches of any size, a `Sequential` without an
    `Input` that the plain trace built on the batch's own size.

    Why: Keras traces a step on a dataset's batch of unknown size, and
    builds such a model for any size. Built for its pretraining batch
    alone, keras.io's SimCLR encoder, reused in a finetuning
    `Sequential` fed other batches, made that model fail in DTensor
    ("Expected shape: <40,11,11,16> got shape: <20,11,11,16>"; plain
    Keras from then on), and a Dense encoder made fit() raise (a fixed
    batch size at the model's input). The trace itself stays on the
    batch's shape: a step whose code needs the size as a number (NNCLR)
    would fail on an unknown one, leaving the variables it made empty.
    """
    from keras.src.layers import InputLayer

    first = sequential._layers[0]
    if (not isinstance(first, InputLayer) or not first.batch_shape
            or first.batch_shape[0] is None):
        return
    # `build` put that InputLayer first; built again, it puts another.
    sequential._layers = sequential._layers[1:]
    sequential.built, sequential._functional = False, None
    sequential.build((None,) + tuple(first.batch_shape[1:]))


class _StepFunction(NamedTuple):
    """A traced step (`ModelStepExecutor._trace`), called on a
    `_MeshBatch`."""

    function: Any  # the tf.function, on (values, padded shapes)
    kind: str  # train, test or predict
    raw: tuple = ()  # `raw_variables.RawVariables.swap_in`'s pairs
    printed: "step_prints.PrintedOnce | None" = None  # its trace's prints

    def __call__(self, batch: "_MeshBatch") -> Any:
        raw_variables.copy_in(self.raw)
        outputs = self.function(batch.values, batch.shapes)
        raw_variables.copy_out(self.raw)
        return step_prints.split(outputs, self.printed, _regular)


class _MeshBatch(NamedTuple):
    """A batch on the mesh (`ModelStepExecutor._on_mesh`): its `values`,
    the shapes the padded ones had (None for the others, in
    `tree.flatten` order) and its batch size."""

    values: Any
    shapes: tuple
    batch: int | None


def _unpadded(values: Any, shapes: tuple) -> Any:
    """A `_MeshBatch`'s values as the batch was, inside the step, their
    batch dim as unknown as the step was traced with
    (`variables.unpadded`)."""
    leaves = [value if shape is None
              else unpadded(value, shape, batch_unknown=True)
              for value, shape in zip(tree.flatten(values), shapes)]
    return tree.pack_sequence_as(values, leaves)


def _own_rows(value: Any, mesh: Any) -> Any:
    """`value` split on its batch dim over `mesh`'s first axis, from this
    process's rows only: each local device gets the rows of its
    coordinate on that axis (mesh ids are row-major)."""
    axis = mesh.dim_names[0]
    parts = mesh.dim_size(axis)
    per_part = value.shape[0] // parts
    inner = mesh.size // parts
    layout = dtensor.Layout(
        [axis] + [dtensor.UNSHARDED] * (value.shape.rank - 1), mesh
    )
    rows = []
    for device in mesh.local_device_ids():
        start = (device // inner) * per_part
        rows.append(value[start:start + per_part])
    return dtensor.pack(rows, layout)


def relaid_like_keras(value: Any, layout: Any,
                      gradient_whole: bool = False) -> Any:
    """`dtensor.relayout(value, layout)`, still known to Keras as what
    `value` was: the softmax or sigmoid of its logits, masked by its mask.
    `gradient_whole`: see `_relaid_gradient_whole`.

    Keras's crossentropies read the logits of a probability output (the
    `_keras_logits` its activations set, or a `Softmax`/`Sigmoid` op's
    input) and compute from them, not from the clipped probabilities; a
    relayout is a new tensor without either (measured: keras.io's
    subclassing_conv_layers, whose saturated softmax gave a first-batch
    loss of 11.21 against Keras's 16.01). Layers read their inputs' masks
    from the tensors too (`_masks_as_the_call_left_them`).
    """
    relaid = (_relaid_gradient_whole(value, layout) if gradient_whole
              else dtensor.relayout(value, layout))
    logits = keras_logits(value)
    if logits is not None:
        # The logits in the same layout: the model's outputs reach the
        # step's own code with their class dim whole (`_batch_only`),
        # and so must the logits its crossentropy reads instead. Split
        # on that dim, DTensor's SparseSoftmaxCrossEntropyWithLogits
        # gives wrong values in float64 and bfloat16, with no error
        # (measured: a loss of 0 or NaN where Keras's was 2.37).
        relaid._keras_logits = (
            dtensor.relayout(logits, layout)
            if _is_traced_tensor(logits) and logits.shape.rank
            == layout.rank else logits)
    mask = get_keras_mask(value)
    if mask is not None:
        set_keras_mask(relaid, mask)
    return relaid


def _relaid_gradient_whole(value: Any, layout: Any) -> Any:
    """`dtensor.relayout(value, layout)` whose gradient comes back whole
    (replicated), where a tape watches `value`; a plain relayout where
    none does.

    For a model input of the step's (the batch the user's code calls the
    model on). A step that moves its inputs along their own gradient and
    calls the model again (adversarial training: `x + eps * dL/dx`) made
    DTensor refuse the step ("output layout of Relayout op after layout
    propagation does not match layout specified by Relayout op", TF
    2.21): the gradient of a relayout is DTensor's `RelayoutLike`, whose
    layout it could not settle once that gradient met the input again.
    A whole gradient settles it; only an input gradient a user asked for
    pays its gather."""
    if not record.should_record_backprop([value]):
        return dtensor.relayout(value, layout)
    whole = replicated(layout.mesh, layout.rank)

    @tf.custom_gradient
    def relaid(value):
        def gradient(upstream):
            return dtensor.relayout(upstream, whole)
        return dtensor.relayout(value, layout), gradient

    return relaid(value)


def _masks_as_the_call_left_them(copies: list) -> None:
    """The Keras masks of a call's relaid inputs (`copies`: pairs of the
    caller's tensor and the relaid one the call got), back on the
    caller's tensors.

    Why: a layer may read its inputs' masks inside its call, and change
    them. `MultiHeadAttention` reads the query's mask from the query
    itself and then removes the masks of query, value and key; in Keras,
    a later consumer of those tensors sees them unmasked. Relaid, its
    query had no mask (`relaid_like_keras` now keeps it): attention over
    padded sequences used the value's mask alone, and the model trained
    to other weights than in Keras (a masked Embedding, self-attention
    and a residual `attention + embedded`: first loss 1.09786 against
    Keras's 1.09620).
    """
    for original, relaid in copies:
        mask = get_keras_mask(relaid)
        if mask is not get_keras_mask(original):
            set_keras_mask(original, mask)


def keras_logits(value: Any) -> Any:
    """The logits Keras's crossentropy would compute `value`'s loss from
    (`keras/src/backend/tensorflow/nn.py` `_get_logits`), or None."""
    logits = getattr(value, "_keras_logits", None)
    op = getattr(value, "op", None)
    if logits is None and op is not None and op.type in (
        "Softmax", "Sigmoid"
    ) and len(op.inputs) == 1:
        logits = op.inputs[0]
    return logits


def _batch_only(layout: Any) -> Any:
    """`layout` with only its batch dim (if any) split.

    For the model's outputs as the step's own code sees them (loss,
    metrics, a user's penalty): DTensor sums the gradients of a tensor
    used twice (AddN) without relaying them out, and fails when two
    uses gave them different layouts (measured: a distillation loss
    using logits split on their class dim in two losses).
    """
    if layout.rank == 0:
        return layout
    specs = [layout.sharding_specs[0]] + [dtensor.UNSHARDED] * (
        layout.rank - 1
    )
    return dtensor.Layout(specs, layout.mesh)


def _replicated_output(value: Any, mesh: Any) -> Any:
    """A traced DTensor output of a step, made whole on every device."""
    if not _is_traced_tensor(value) or value.dtype == tf.string:
        return value
    return dtensor.relayout(value, replicated(mesh, value.shape.rank))


def _regular(value: Any) -> Any:
    """A DTensor as the regular tensor it holds (eager); else unchanged."""
    if isinstance(value, tf.Tensor) and dtensor.is_dtensor(value):
        return gather(value)
    return value


def _specs(data: Any, static_batch: bool = False,
           dims: tuple | None = None) -> Any:
    """Tensor specs of `data`, the batch dim unknown unless
    `static_batch`; the others as `dims` has them per leaf
    (`varying_shapes.Signatures.dims`), else as the tensors'."""
    leaves = tree.flatten(data)
    dims = dims or (None,) * len(leaves)

    def spec(value, other_dims):
        if isinstance(value, tf.Tensor) and value.shape.rank:
            batch = value.shape[0] if static_batch else None
            if other_dims is None:
                other_dims = value.shape[1:]
            return tf.TensorSpec([batch] + list(other_dims), value.dtype)
        return value

    return tree.pack_sequence_as(
        data, [spec(v, d) for v, d in zip(leaves, dims)])


def mesh_key(kind: str, batch: "_MeshBatch") -> tuple:
    """What a step function is kept and known to have run under, for a
    batch on the mesh: `step_key` of its values (the hosted results
    included: their lengths are the batch's too), its true batch size
    (a padded first leaf has another) and its padded inputs' shapes,
    which its trace takes as Python values."""
    _, _, structure, signature = step_key(kind, batch.values)
    return kind, batch.batch, structure, signature, batch.shapes


def step_key(kind: str, data: Any) -> tuple:
    """What a step function is kept and known to have run under (the
    first four parts of `mesh_key`): its kind, the batch size, and what
    else a trace depends on (the batch's structure, each tensor's dtype
    and other dims).

    Why the structure: fit's validation batches carried sample weights
    (`validation_split` with `sample_weight`) and evaluate's did not.
    Keyed by kind and size alone, the validation step's function was
    called on evaluate's batches and TensorFlow traced it again, outside
    `_trace`: without the captures laid on the mesh, the raw variables'
    copies, or the redo of a refused first call, so a model with a
    recurrent layer failed ("Cannot add function '.../rnn_loop_..._body'
    because a different function with the same name already exists").

    It runs once per step, so it flattens with optree, the library
    Keras's `tree` runs on and requires (None a leaf and Keras's
    containers known, as `tree` flattens), and keys by the treedef:
    half the cost of mapping the structure and taking its repr (18
    against 37 us for one tensor, 96 against 205 us for a batch of
    twenty features, on this project's 2-core machine).
    """
    leaves, structure = optree.tree_flatten(
        data, none_is_leaf=True, namespace="keras")
    signature = tuple(
        type(leaf).__name__ if getattr(leaf, "shape", None) is None
        else (tuple(leaf.shape)[1:], str(getattr(leaf, "dtype", "")))
        for leaf in leaves)
    return kind, _batch_of(leaves), structure, signature


def _batch_of(data: Any) -> int | None:
    for leaf in tree.flatten(data):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape):
            return shape[0]
    return None


def _matching_plan(plans: list[OpPlan], leaves: list) -> OpPlan:
    """The call of a shared layer whose input shapes these are."""
    for plan in plans:
        shapes = plan.op.input_shapes
        if len(leaves) >= len(shapes) and all(
            plan.op.takes(pos, tuple(v.shape))
            for pos, v in enumerate(leaves[:len(shapes)])
        ):
            return plan
    return plans[0]


def _optimizers(model: Any) -> list:
    """The model's optimizers: `model.optimizer`, any other a custom
    `compile` keeps as an attribute (a GAN's `d_optimizer`), and those
    they wrap (a LossScaleOptimizer's inner one, a MultiOptimizer's)."""
    found, todo = [], [getattr(model, "optimizer", None)]
    todo += [v for v in vars(model).values() if isinstance(v, BaseOptimizer)]
    while todo:
        optimizer = todo.pop()
        if optimizer is None or any(optimizer is f for f in found):
            continue
        found.append(optimizer)
        todo.append(getattr(optimizer, "inner_optimizer", None))
        todo.extend(getattr(optimizer, "optimizers", None) or ())
    return found


def _slot_layouts(optimizer: Any, layouts: dict[int, Any]) -> dict:
    """Optimizer variable id -> its weight's layout, for per-weight
    slots (moments, accumulators, EMA copies): any list the optimizer
    holds with one variable of its weight's shape per trainable weight."""
    weights = list(getattr(optimizer, "_trainable_variables", ()))
    found = {}
    for value in vars(optimizer).values():
        if not isinstance(value, list) or len(value) != len(weights):
            continue
        for slot, weight in zip(value, weights):
            if (
                isinstance(slot, keras.Variable)
                and slot is not weight
                and tuple(slot.shape) == tuple(weight.shape)
                and id(weight) in layouts
            ):
                found[id(slot)] = layouts[id(weight)]
    return found


def _state_variables(model: Any) -> list:
    """Every Keras variable a step of `model` may read or write.

    Keras's global seed state too, once a draw without a seed made it
    (the first trace, as in plain Keras; `_realize` then traces anew): a
    step variable like the rest, written once per step. Left a regular
    variable, each device's program advanced it in turn, racing: a
    Switch Transformer router's noise (keras.io) took 22 to 28 draws
    over 8 steps, other values on each run."""
    found = list(model.variables)
    for metric in model.metrics:
        found.extend(metric.variables)
    for optimizer in _optimizers(model):
        found.extend(optimizer.variables)
    seed_state = user_random.global_seed_state()
    if seed_state is not None:
        found.append(seed_state)
    return found


def _metric_variable_ids(model: Any) -> set[int]:
    return {id(v) for metric in model.metrics for v in metric.variables}
