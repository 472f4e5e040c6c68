"""Train / test / predict steps of a strategy over several device meshes.

(A strategy on one mesh runs the model's own step: `model_step.py`.)
Keras's default step, layer by layer: one forward and one backward
function per segment (consecutive ops on one mesh; the backward
recomputes its forward), chained eagerly by region moves (`moves.py`:
each device receives what it reads), with the loss between them; see
`layouts.py` for why.
Metrics and the loss tracker are updated by Keras's own code in a plain
`tf.function` on the gathered outputs, so `compile(metrics=...)` behaves
as in Keras.

Weight regularizers (`kernel_regularizer=...`: Keras keeps them on the
variables) are counted as Keras's `compute_loss` counts them: each
segment's forward returns the penalty of its trainable weights, taken
before the step's updates, which the loss adds to the compiled loss (in
training and in evaluation, as Keras's `test_step` does); each backward
adds the penalty's gradient to its weights' own (`_penalty`). A
penalty depends on one weight only, so it is computed where the weight
lives.
"""

from typing import Any

import numpy as np
import tensorflow as tf
from keras import tree
from keras.src.backend import StatelessScope
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context

from flexflow_keras.keras_graph import fill_arguments, function_of
from flexflow_keras.runtime import (
    fresh_state, moves, op_rules, rolled_rnn, unfed_step, unroll,
)
from flexflow_keras.runtime.fallback import (
    collectives_aborted, fall_back, failed_while_running,
)
from flexflow_keras.runtime.keras_functions import keras_function
from flexflow_keras.runtime.model_step import keras_logits
from flexflow_keras.runtime.tracing import step_function
from flexflow_keras.runtime.layouts import replicated, segments
from flexflow_keras.runtime.optimizers import Updater
from flexflow_keras.runtime.variables import (
    SMALL_INPUT_ELEMENTS, VariableStore, argument_constants, attributes_set,
    densified, layer_constants, layer_variables, replicate,
)


def _to_mesh(value: Any, mesh: Any) -> Any:
    """A regular tensor copied, replicated, onto `mesh` (eager)."""
    if value is None:
        return None
    return replicate(value, mesh)


def _local(value: Any) -> Any:
    """First component of a replicated DTensor: a regular tensor."""
    return dtensor.unpack(value)[0]


def _is_float(value: Any) -> bool:
    return value is not None and value.dtype.is_floating


def _batch_relaxed(python_function):
    """A tf.function traced with the batch dim unknown, as Keras's step is.

    Keras traces its step on a dataset's element spec (batch dim None), so
    its per-output loss trackers get `sample_weight=None`: a plain mean
    over batches. Tracing with a None batch keeps that quirk identical.
    """
    function = step_function(python_function)
    traced = set()

    def spec(value):
        if isinstance(value, (tf.Tensor, np.ndarray)):
            value = tf.convert_to_tensor(value)
            if not value.shape.rank:  # a scalar (the weights' penalty)
                return tf.TensorSpec([], value.dtype)
            return tf.TensorSpec([None] + value.shape[1:], value.dtype)
        return value

    def call(*args):
        args = tree.map_structure(
            lambda v: tf.convert_to_tensor(v)
            if isinstance(v, np.ndarray) else v,
            args,
        )
        specs = tree.map_structure(spec, args)
        key = str(specs)
        if key not in traced:
            function.get_concrete_function(*specs)
            traced.add(key)
        return function(*args)

    return call


def single_device(strategy: Any, device_names: tuple) -> str | None:
    """The device name when every op runs unsplit on that one device."""
    ids = {c.device_ids for c in strategy.values()}
    if len(ids) == 1:
        (only,) = ids
        if len(only) == 1 and only[0] < len(device_names):
            return device_names[only[0]]
    return None


class OwnStepNeeded(Exception):
    """Raised while a step is traced: a layer adds a loss (`add_loss`),
    which only the model's own step (`model_step.py`) counts."""


# `values` key of the weights' regularization penalty (`_forward_all`).
_PENALTY = "#penalty"


def _with_penalty(loss: Any, penalty: Any) -> Any:
    """The compiled loss plus the weights' penalty, as Keras's
    `compute_loss` sums them."""
    if penalty is None or loss is None:
        return loss
    return loss + tf.cast(penalty, loss.dtype)


def _logits_name(output: str) -> str:
    """The name under which a probability output's logits travel between
    a segment and the loss (see `Executor._run_segment`)."""
    return output + "#logits"


class Executor:
    """Runs a model's steps under a strategy.

    Args:
        model: The compiled Keras model.
        graph: Its `OpGraph` at the strategy's global batch size.
        strategy: Op name -> `ParallelConfig`.
        device_names: Devices the strategy's ids refer to.
    """

    def __init__(self, model, graph, strategy, device_names, plans):
        self.model = model
        self.graph = graph
        self.plans = plans
        self.segments = segments(graph, self.plans)
        self.single_device = single_device(strategy, device_names)
        self.updater = None
        self.dirty = False  # DVariables newer than the Keras variables
        # Whether a test or predict forward writes state (seeds).
        self._inference_writes = False
        # Keras values and DVariables last made equal (made from the
        # Keras values, or copied)
        self._last_copy = fresh_state.LastCopy()
        self._watched: list = []
        self.updated = False  # some weights took the running train step
        # (kind, `_variant`) of the running step and of every step that
        # ran to its end: a step's first run is all-or-nothing (`_failed`),
        # with the metrics' values before it (`_first_run_redone`).
        self._running: tuple | None = None
        self._ran: set[tuple] = set()
        self._metrics_before: list | None = None
        self._fns: dict[tuple, Any] = {}
        self._arrivals: dict[tuple, Any] = {}  # `_arrival`
        # Recurrent layers run rolled (`rolled_rnn`) until a first run
        # fails before any weight took the step (`_failed`).
        self.loops = unroll.Loops(plans)
        # segment index -> its logits outputs (`_segment_outputs`)
        self._logits_outputs: dict[int, list[str]] = {}
        # Each segment's seed draws in a train step (`unfed_step`).
        self._unfed = unfed_step.Recorder()
        if self.single_device is not None:
            # Every op on one device: Keras's own step, placed there, is
            # already the best executor; no DVariables are made.
            self.store = None
            self.trainable = []
            return
        self.store = VariableStore(self.plans)
        self._constants = {
            id(plan): layer_constants(plan.op.layer, plan.mesh)
            + argument_constants(plan.op.arguments, plan.mesh)
            for plan in self.plans
        }
        self._check_shared_weights()
        known = {id(v) for v in self.store.keras_variables()}
        self.trainable = [
            v for v in model.trainable_variables if id(v) in known
        ]
        self._watch()

    def _watch(self) -> None:
        """Weights and optimizer slots live here while training (the
        step counter and learning rate stay Keras's eager variables):
        reads and writes between steps sync (`fresh_state`)."""
        optimizer = getattr(self.model, "optimizer", None)
        eager = {id(getattr(optimizer, name, None))
                 for name in ("iterations", "_learning_rate")}
        self._watched = self.store.keras_variables() + [
            v for v in getattr(optimizer, "variables", ())
            if id(v) not in eager
        ]
        fresh_state.watch(self, self._watched)

    def _check_shared_weights(self) -> None:
        """A shared layer's calls must run in one segment: each segment's
        backward updates its own weights, so weights read by two segments
        would take two updates a step (measured: a shared tower split by
        ops on other devices trained 0.3% off Keras)."""
        segment_of: dict[int, int] = {}
        for index, segment in enumerate(self.segments):
            for plan in segment.ops:
                trainable, non_trainable = layer_variables(plan.op.layer)
                for var in trainable + non_trainable:
                    if self.store.mesh_of[id(var)] != plan.mesh or (
                        segment_of.setdefault(id(var), index) != index
                    ):
                        raise NotImplementedError(
                            f"Op '{plan.op.name}' reads weights that "
                            "another op reads on another device mesh or "
                            "in another run of ops on one mesh (a shared "
                            "layer whose calls are apart). Put the whole "
                            "model on one mesh (same device_ids for every "
                            "op), as compile() does for shared layers."
                        )

    # -- sync -------------------------------------------------------------

    def sync_in(self) -> None:
        """Keras values -> DVariables, unless the DVariables are newer, or
        equal (no Keras variable written since the last copy); weights
        and optimizer slots."""
        if self.dirty or self.store is None:
            return
        if self._last_copy.stale(self._watched):
            self.store.push()
            if self.updater is not None:
                self.updater.push()
            self._last_copy.mark()

    def sync_out(self) -> None:
        """DVariables -> Keras values, if training changed them."""
        if self.dirty:
            self.store.pull()
            if self.updater is not None:  # None before a train step
                self.updater.pull()  # may build the Keras optimizer's slots
            self.dirty = False
            self._last_copy.mark()
            self._watch()

    # -- graph pieces (trace time) ------------------------------------------

    def _variant(self, batch: int) -> tuple[bool, int]:
        """(batch dim sharded?, batch): one traced function per batch size.

        A batch of another size than the graph's (the last partial batch,
        evaluate/predict batches) runs with the batch dim unsharded on the
        same meshes. Measured: a Conv2D traced for batch 8 then for a
        sharded batch 4 fails DTensor's SPMD expansion (global/local shape
        mix-up), while unsharded it runs. Each batch size gets its own
        function so no retrace relaxes the batch dim to None.
        """
        variant = (batch == self.graph.batch_size, batch)
        if self._running is not None:
            self._running = (self._running[0], variant)
            self._metrics_before = None
            if self._running not in self._ran:
                self._metrics_before = [
                    (v, v.numpy()) for v in self.model.metrics_variables]
        return variant

    def _run_segment(self, seg, values, training, sharded):
        """Runs `seg`'s ops on `values` (name -> DTensor), in place.

        Returns (DVariable, new value) for non-trainable state to assign.
        """
        updates = []
        for plan in seg.ops:
            op = plan.op
            # By position: one tensor may be several inputs laid out
            # apart (`mha(x, x)`: query split on the sequence, value
            # whole); one relayout per tensor and layout.
            relaid, local, inner = {}, [], False
            for pos, name in enumerate(op.inputs):
                value = values[name]
                layout = plan.input_layout(pos, tuple(value.shape), sharded)
                inner = inner or op_rules.splits_inner_dims(layout)
                key = (name, layout.to_string())
                if key not in relaid:
                    relaid[key] = dtensor.relayout(value, layout)
                local.append(relaid[key])
            with attributes_set(self._constants[id(plan)]):
                # A call's own tensors (`x + tf_constant`), on the mesh.
                args, kwargs = fill_arguments(op, local)
            layer = op.layer
            trainable, non_trainable = layer_variables(layer)
            mapping = [
                (v, self.store.dvariable(v)) for v in trainable + non_trainable
            ]
            if getattr(layer, "_call_has_training_arg", False):
                # As Keras's Functional.call does: the step's mode wins
                # over the value recorded when the model was built (a
                # layer's default: Dropout's False, RandomFlip's True).
                kwargs = dict(kwargs, training=training)
            with StatelessScope(
                state_mapping=mapping, collect_losses=True
            ) as scope:
                with self.loops.running(layer), \
                        op_rules.substitutes(plan.mesh), \
                        op_rules.inner_splits_kept(inner), \
                        attributes_set(self._constants[id(plan)]):
                    out = layer(*args, **kwargs)
            if scope.losses:
                raise OwnStepNeeded(f"layer '{layer.name}' calls add_loss()")
            for v in non_trainable:
                new = scope.get_current_value(v)
                if new is not None:
                    updates.append((v, new))
            for i, (name, value) in enumerate(
                zip(op.outputs, tree.flatten(out))
            ):
                layout = plan.output_layout(i, value.shape.rank, sharded)
                values[name] = dtensor.relayout(value, layout)
                logits = keras_logits(value)
                if name in self.graph.outputs and logits is not None:
                    # Keras's crossentropy computes a softmax or sigmoid
                    # output's loss from its logits, not from the clipped
                    # probabilities; they cross to the loss beside it.
                    values[_logits_name(name)] = dtensor.relayout(
                        logits, layout
                    )
        return updates

    def _segment_outputs(self, index: int, values: dict) -> list[str]:
        """Segment `index`'s outputs, then the logits of its probability
        outputs (known once its forward is traced)."""
        seg = self.segments[index]
        extra = [_logits_name(t) for t in seg.outputs
                 if _logits_name(t) in values]
        self._logits_outputs[index] = extra
        return list(seg.outputs) + extra

    def _returned(self, index: int) -> list[str]:
        """What segment `index`'s functions return (after its forward was
        traced): its outputs, then its logits outputs."""
        return (list(self.segments[index].outputs)
                + self._logits_outputs.get(index, []))

    def _assign(self, updates) -> None:
        for var, value in updates:
            dvar = self.store.dvariable(var)
            value = tf.cast(value, dvar.dtype)
            dvar.assign(dtensor.relayout(value, self.store.layout(var)))

    def _seg_variables(self, seg) -> list:
        """`seg`'s trainable Keras variables, in the model's order."""
        seen = {}
        for plan in seg.ops:
            for v in layer_variables(plan.op.layer)[0]:
                if v.trainable:
                    seen[id(v)] = v
        return [v for v in self.trainable if id(v) in seen]

    def _seg_dvars(self, seg):
        return [self.store.dvariable(v) for v in self._seg_variables(seg)]

    def _fn(self, kind, *key):
        full = (kind,) + key
        if full not in self._fns:
            make = getattr(self, "_make_" + kind)
            self._fns[full] = rolled_rnn.RedoneOnNameClash(
                lambda: make(*key)
            )
        return self._fns[full]

    def _penalty(self, seg) -> Any:
        """The regularizers' penalty of `seg`'s trainable weights (a
        replicated scalar on its mesh), each term as Keras's
        `compute_loss` adds it (the model's own
        `_aggregate_additional_loss`); None when no weight of `seg` has
        a regularizer."""
        terms = [
            self.model._aggregate_additional_loss(
                v.regularizer(self.store.dvariable(v)))
            for v in self._seg_variables(seg)
            if getattr(v, "regularizer", None) is not None
        ]
        if not terms:
            return None
        return dtensor.relayout(tf.add_n(terms), replicated(seg.mesh, 0))

    def _make_forward(self, index, training, sharded, batch):
        seg = self.segments[index]

        @step_function
        def forward(inputs):
            values = dict(zip(seg.inputs, inputs))
            updates = self._run_segment(seg, values, training, sharded)
            if not training and updates:
                # Inference writes state as in Keras's own test and
                # predict steps: Keras's recurrent layers draw their
                # dropout masks at every call, advancing their seeds
                # (training's writes come with its backward).
                self._assign(updates)
                self._inference_writes = True
            # As laid out: a later segment takes its regions of them
            # (`moves.move_all`).
            outputs = [values[t] for t in self._segment_outputs(index, values)]
            penalty = self._penalty(seg)
            return outputs if penalty is None else outputs + [penalty]

        return forward

    def _make_backward(self, index, sharded, batch):
        seg = self.segments[index]
        dvars = self._seg_dvars(seg)

        @step_function
        def backward(inputs, out_grads, hyper):
            # The gradients the model's step would take: none of a model
            # input or of a frozen base's output (`OpGraph.needs_gradient`).
            graded = [_is_float(x) and self.graph.needs_gradient(t)
                      for t, x in zip(seg.inputs, inputs)]
            floats = [x for x, g in zip(inputs, graded) if g]
            with tf.GradientTape() as tape, self._unfed.recording(index):
                tape.watch(floats)
                values = dict(zip(seg.inputs, inputs))
                updates = self._run_segment(seg, values, True, sharded)
                outs = [values[t]
                        for t in self._segment_outputs(index, values)]
                penalty = self._penalty(seg)
            out_grads = list(out_grads)
            if penalty is not None:  # d(loss)/d(penalty) = 1
                outs.append(penalty)
                out_grads.append(tf.ones_like(penalty))
            grads = tape.gradient(
                outs, floats + dvars, output_gradients=out_grads
            )
            self.updater.apply(grads[len(floats):], dvars, hyper[0], hyper[1])
            self._assign(updates)
            result, it = [], iter(grads[: len(floats)])
            for wanted in graded:
                g = next(it) if wanted else None
                if isinstance(g, tf.IndexedSlices):
                    g = tf.convert_to_tensor(g)
                result.append(g)
            return result

        return backward

    def _make_loss(self):
        model = self.model

        @_batch_relaxed
        def loss_and_grads(x, y, y_pred_flat, logits, sample_weight,
                           penalty):
            present = [v for v in logits if v is not None]
            with tf.GradientTape() as tape:
                tape.watch(y_pred_flat + present)
                y_pred = self._pack_outputs(y_pred_flat, logits)
                loss = model._compile_loss(y, y_pred, sample_weight)
            grads = tape.gradient(loss, y_pred_flat + present)
            logs = self._update_metrics(x, y, y_pred, sample_weight,
                                        _with_penalty(loss, penalty))
            return logs, grads

        return loss_and_grads

    def _make_metrics(self):
        model = self.model

        @_batch_relaxed
        def metrics(x, y, y_pred_flat, logits, sample_weight, penalty):
            y_pred = self._pack_outputs(y_pred_flat, logits)
            loss = model._compile_loss(y, y_pred, sample_weight)
            return self._update_metrics(x, y, y_pred, sample_weight,
                                        _with_penalty(loss, penalty))

        return metrics

    def _update_metrics(self, x, y, y_pred, sample_weight, loss):
        model = self.model
        first = next(i for i in tree.flatten(x) if i is not None)
        if loss is not None:
            model._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss),
                sample_weight=tf.shape(first)[0],
            )
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _pack_outputs(self, flat, logits=None):
        """The model's outputs as Keras structures them; each probability
        output carries its logits as Keras's activations leave them
        (`_keras_logits`), for the crossentropies to read."""
        flat = list(flat)
        for value, its_logits in zip(flat, logits or ()):
            if its_logits is not None:
                value._keras_logits = its_logits
        struct = function_of(self.model)._outputs_struct
        return tree.pack_sequence_as(struct, flat)

    def _gathered_outputs(self, values: dict) -> tuple[list, list]:
        """The model's outputs, and per output its logits or None, each
        gathered whole (`moves.gathered`) for the loss and metrics."""
        outputs = list(self.graph.outputs)
        logits = [_logits_name(t) for t in outputs
                  if _logits_name(t) in values]
        whole = dict(zip(outputs + logits, moves.gathered(
            [values[t] for t in outputs + logits])))
        return ([whole[t] for t in outputs],
                [whole.get(_logits_name(t)) for t in outputs])

    # -- eager steps ----------------------------------------------------------

    def _flat_inputs(self, x) -> list:
        function = function_of(self.model)
        flat = function._standardize_inputs(x)
        return [tf.convert_to_tensor(densified(v)) for v in flat]

    def _forward_all(self, flat_x, training, variant):
        """Runs every segment forward; returns boundary values and inputs.

        The segments' weight penalties, summed, are `values[_PENALTY]`
        (absent when no weight has a regularizer)."""
        values = dict(zip(self.graph.inputs, flat_x))
        seg_inputs = []
        for i, seg in enumerate(self.segments):
            ins = tuple(moves.move_all(
                [values[t] for t in seg.inputs],
                [self._arrival(i, t, values[t], variant[0])
                 for t in seg.inputs],
            ))
            seg_inputs.append(ins)
            outs = self._fn("forward", i, training, *variant)(ins)
            returned = self._returned(i)
            for t, v in zip(returned, outs[:len(returned)], strict=True):
                values[t] = v
            if len(outs) > len(returned):  # the segment's penalty
                penalty = _local(outs[-1])
                values[_PENALTY] = (values[_PENALTY] + penalty
                                    if _PENALTY in values else penalty)
        return values, seg_inputs

    def _arrival(self, index: int, name: str, value: Any, sharded: bool):
        """The layout tensor `name` enters segment `index` in: that of
        its first reader there (`OpPlan.input_layout`), so each device
        receives the region it reads, as the simulator prices a move
        between meshes; a reader that wants another layout relays it
        out on the mesh."""
        key = (index, name, tuple(value.shape), sharded)
        if key not in self._arrivals:
            seg = self.segments[index]
            self._arrivals[key] = next(
                plan.input_layout(pos, tuple(value.shape), sharded)
                for plan in seg.ops
                for pos, read in enumerate(plan.op.inputs) if read == name
            )
        return self._arrivals[key]

    def _hyper(self, mesh):
        """[learning rate, step (1-based)] as a replicated DTensor.

        Read from the Keras optimizer every step, so schedules and
        callbacks that set `learning_rate` take effect. Built on the host
        in NumPy: one copy instead of several small eager ops. Padded with
        zeros to `SMALL_INPUT_ELEMENTS`: DTensor folds a smaller input
        into the function as a constant and expands it again when the
        value changes (measured: every backward function expanded twice,
        at the first and the second step). In float64: the update casts
        both to each variable's dtype, as Keras's optimizers do, so a
        float64 model gets a float64 learning rate (float32's 0.001 is off
        by 5e-8) and a float32 one the float32 value it always had.
        """
        opt = self.model.optimizer
        hyper = np.zeros(SMALL_INPUT_ELEMENTS, np.float64)
        hyper[0] = float(opt._get_current_learning_rate())
        hyper[1] = float(opt.iterations.numpy()) + 1.0
        return _to_mesh(hyper, mesh)

    def train_batch(self, data) -> dict:
        if self.updater is None:
            self.updater = Updater(
                self.model.optimizer, self.store, self.trainable,
                self.model.trainable_variables,
            )
        self.updated = False
        x, y, sw = data_adapter_utils.unpack_x_y_sample_weight(data)
        flat_x = self._flat_inputs(x)
        variant = self._variant(int(flat_x[0].shape[0]))
        logs = self._train_segments(flat_x, x, y, sw, variant)
        self.model.optimizer.iterations.assign_add(1)
        self.dirty = True
        return logs

    def _train_segments(self, flat_x, x, y, sw, variant):
        values, seg_inputs = self._forward_all(flat_x, True, variant)
        y_pred, logits = self._gathered_outputs(values)
        logs, dys = self._fn("loss")(x, y, y_pred, logits, sw,
                                     values.get(_PENALTY))
        grads: dict[str, Any] = {}
        graded = list(self.graph.outputs) + [
            _logits_name(t) for t, v in zip(self.graph.outputs, logits)
            if v is not None
        ]

        def add(names, gradients):
            # Every gradient of a tensor in the layout it was made in.
            kept = [(t, g) for t, g in zip(names, gradients, strict=True)
                    if g is not None and t not in self.graph.inputs]
            moved = moves.move_all(
                [g for _, g in kept],
                [dtensor.fetch_layout(values[t]) for t, _ in kept])
            for (t, _), g in zip(kept, moved):
                grads[t] = moves.added(grads[t], g) if t in grads else g

        add(graded, dys)
        for i in reversed(range(len(self.segments))):
            seg = self.segments[i]
            out_grads = [
                grads[t] if t in grads else moves.zeros_like(values[t])
                for t in self._returned(i)
            ]
            in_grads = self._fn("backward", i, *variant)(
                seg_inputs[i], out_grads, self._hyper(seg.mesh)
            )
            self.updated = True  # this segment's weights took the step
            add(seg.inputs, in_grads)
        return logs

    def test_batch(self, data) -> dict:
        x, y, sw = data_adapter_utils.unpack_x_y_sample_weight(data)
        values = self._predict_values(x)
        y_pred, logits = self._gathered_outputs(values)
        return self._fn("metrics")(x, y, y_pred, logits, sw,
                                   values.get(_PENALTY))

    def _predict_values(self, x) -> dict:
        flat_x = self._flat_inputs(x)
        variant = self._variant(int(flat_x[0].shape[0]))
        values, _ = self._forward_all(flat_x, False, variant)
        if self._inference_writes:
            self.dirty = True  # copied out at the next read, as training
        return values

    def predict_batch(self, x) -> Any:
        values = self._predict_values(x)
        return self._pack_outputs(self._gathered_outputs(values)[0])

    # -- Keras-facing functions ---------------------------------------------

    def make_function(self, kind: str):
        """`model.{kind}_function` (`keras_functions.keras_function`)."""
        return keras_function(
            self.model, kind, self._run, self._failed,
            (lambda: self._unfed.replay((self.model.optimizer,)))
            if kind == "train" else None,
        )

    def _run(self, kind: str, batch: Any) -> Any:
        self._running = (kind, None)  # its variant set by `_variant`
        self._metrics_before = None
        if kind == "predict":
            x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(batch)
            outputs = self.predict_batch(x)
        elif kind == "train":
            outputs = self.train_batch(batch)
        else:
            outputs = self.test_batch(batch)
        self._ran.add(self._running)
        return outputs

    def _failed(self, kind: str, error: Exception, batches: Any,
                batch: Any) -> Any:
        """What only the model's own step counts, or an op without a
        DTensor rule, found when a step is first traced or run: the
        model goes on without this strategy (see `fallback.fall_back`)."""
        if isinstance(error, OwnStepNeeded):
            return self._to_own_step(kind, str(error), batches)
        if isinstance(error, tf.errors.OpError):
            first = self._first_run_redone()
            if (not self.updated and not collectives_aborted(error)
                    and not failed_while_running(error)
                    and self.loops.unroll_instead()):
                # Rolled loops DTensor refuses run unrolled; nothing took
                # the step: it is redone.
                context.async_clear_error()
                self._fns.clear()
                return self.make_function(kind)(batches)
            # A first run that failed before any weight took the step
            # changed nothing: Keras redoes it (before, ConvNeXt's grouped
            # convolution raised TensorFlow's error from here, where the
            # model's own step handed over).
            return fall_back(self.model, kind, error, batches, self.updated,
                             first)
        raise error

    def _first_run_redone(self) -> bool:
        """Whether the failed step can be redone: its first run, before
        any weight took it. The metrics it updated (its loss function
        runs before the backward segments) get their values back, so the
        batch counts once in the epoch's logs."""
        if self.updated or self._metrics_before is None:
            return False
        for variable, value in self._metrics_before:
            variable.assign(value)
        known = {id(v) for v, _ in self._metrics_before}
        for metric in self.model.metrics:
            # Built by this run (compiled metrics are built on first use):
            # its state came from this run only.
            if any(id(v) not in known for v in metric.variables):
                metric.reset_state()
        return True

    def _to_own_step(self, kind: str, reason: str, data: Any) -> Any:
        """What only the model's own step counts was found at the first
        trace, before anything was updated: the model says so and runs
        `data` as it runs from now on."""
        model = self.model
        model._strategy_needs_own_step(reason)
        getattr(model, f"make_{kind}_function")(force=True)
        return getattr(model, f"{kind}_function")(data)
