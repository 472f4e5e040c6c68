"""The layouts DTensor really gives each op inside a model's own step.

Why: the one-mesh runtime relays each layer call to its op's layouts
through a hook on Keras's `Operation.__call__` (`model_step.call_op`).
If the hook stopped firing (a Keras upgrade), every equivalence test
would still pass, since DTensor computes the same values for any
layout, while the model trained replicated. This module shows what
runs, measured rather than assumed.

`record(executor, batch)` traces the executor's train step once more,
through the executor's own `_trace` (the same code path as every
step), with each op's layer `call` wrapped: the wrapper sits under
Keras's `Operation.__call__` and under our hook, so it sees the tensors
the layer's own computation receives (after our input relayouts, if
they ran), the outputs that computation produces (before our output
relayouts) and its weights as the layer reads them in the step (the
`StepVariable`s). The traced function returns those tensors as extra
outputs; it is run once and each tensor's layout is read eagerly with
`dtensor.fetch_layout`, i.e. what DTensor's SPMD expansion produced,
not what was asked for. An input the hook never relaid, an op result
DTensor laid out otherwise, or a layer that reads a regular variable
shows up as a difference from the plan. (An output is weaker evidence
than an input: DTensor may give an op's result the layout our relayout
after it asks for; it is still the layout that op computed.)

The recording run does not change training: it is a dedicated extra
trace, not kept among the executor's step functions, and every
`StepVariable` of the step (weights, optimizer and metric state, seeds)
is read before the run and assigned its value back after it.

Calls inside a tape inside a tape (a gradient penalty) are not recorded:
they run on DTensor's propagated layouts by design (`call_op`).

`check(recorded, plans)` sets the plan's layouts (`OpPlan.input_layout`,
`output_layout`, `weight_layout`, for the same shapes) beside the
realized ones, `mismatches` keeps those that differ, `format_table`
prints them; `show_once` prints the table at an executor's first train
step when `FLEXFLOW_KERAS_SHOW_LAYOUTS=1` (docs/RUNTIME.md).
"""

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf
from keras import tree
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context

from flexflow_keras.runtime import step_prints


@dataclasses.dataclass(frozen=True)
class Realized:
    """One tensor of one op call, as DTensor laid it out in the step.

    Args:
        op: The op's name.
        call: 1 for the op's first call in the step, 2 for another...
        kind: `input`, `output` or `weight`.
        tensor: `input 0`, `output 0`, or the weight's Keras path.
        index: Input position or output index (weights: -1).
        shape: Inputs: the graph's input shape; others: the traced shape.
        shard_axis: A weight's `WeightInfo.shard_axis`.
        sharded: Whether the batch was the strategy's (split) batch.
        layout: The layout DTensor gave it; None if it held no DTensor.
    """

    op: str
    call: int
    kind: str
    tensor: str
    index: int
    shape: tuple
    shard_axis: int | None
    sharded: bool
    layout: Any = None


@dataclasses.dataclass(frozen=True)
class Row:
    """A line of the table: planned beside realized."""

    op: str
    tensor: str
    kind: str
    planned: Any  # a Layout, or text
    realized: Any  # a Layout, or text, or None
    ok: bool


class _Recorder:
    """Wraps the ops' layer calls while the step is traced."""

    def __init__(self, executor: Any):
        self.executor = executor
        self.entries: list[Realized] = []
        self.tensors: list[Any] = []  # one per entry; None: no tensor
        self.calls: dict[str, int] = {}

    @contextlib.contextmanager
    def wrapping(self, skip: Callable[[], bool]) -> Iterator[None]:
        # Each trace records afresh (`_trace` traces again when the
        # first trace made variables).
        self.entries, self.tensors, self.calls = [], [], {}
        by_layer: dict[int, list] = {}
        for plan in self.executor.plans:
            by_layer.setdefault(id(plan.op.layer), []).append(plan)
        wrapped = []
        for plans in by_layer.values():
            layer = plans[0].op.layer
            own = vars(layer).get("call", _ABSENT)
            original = layer.call

            @functools.wraps(original)
            def call(*args, _plans=plans, _original=original, **kwargs):
                if skip():
                    return _original(*args, **kwargs)
                leaves = [x for x in tree.flatten((args, kwargs))
                          if _is_traced(x)]
                plan = self._plan(_plans, leaves)
                weights = self._weights(plan)
                outputs = _original(*args, **kwargs)
                self._add(plan, leaves, weights, tree.flatten(outputs))
                return outputs

            object.__setattr__(layer, "call", call)
            wrapped.append((layer, own))
        try:
            yield
        finally:
            for layer, own in wrapped:
                if own is _ABSENT:
                    object.__delattr__(layer, "call")
                else:
                    object.__setattr__(layer, "call", own)

    def _plan(self, plans: list, leaves: list) -> Any:
        """The op of this call: of those whose input shapes match, the
        first not yet called in this step (a shared layer's calls in
        order), else the first."""
        matching = [p for p in plans if len(leaves) >= len(p.op.inputs)
                    and all(p.op.takes(pos, tuple(v.shape))
                            for pos, v in enumerate(
                                leaves[:len(p.op.inputs)]))]
        fresh = [p for p in matching if p.op.name not in self.calls]
        return (fresh or matching or plans)[0]

    def _weights(self, plan: Any) -> list:
        """The layer's variables, read as the layer reads them here."""
        found = []
        for var in getattr(plan.op.layer, "variables", ()):
            stored = getattr(var, "_value", None)
            value = (tf.identity(var.value)
                     if isinstance(stored, dtensor.DVariable) else None)
            found.append((var, plan.shard_axis_of(var), value))
        return found

    def _add(self, plan: Any, leaves: list, weights: list,
             outputs: list) -> None:
        op = plan.op
        call = self.calls[op.name] = self.calls.get(op.name, 0) + 1
        sharded = self.executor._sharded

        def add(kind, tensor, index, shape, shard_axis, value):
            self.entries.append(Realized(
                op.name, call, kind, tensor, index, tuple(shape),
                shard_axis, sharded,
            ))
            self.tensors.append(value)

        for pos, value in enumerate(leaves[: len(op.inputs)]):
            if op.takes(pos, tuple(value.shape)):
                add("input", f"input {pos}", pos, op.input_shapes[pos],
                    None, value)
        for var, shard_axis, value in weights:
            add("weight", getattr(var, "path", var.name), -1,
                tuple(var.shape), shard_axis, value)
        for index, value in enumerate(outputs[: len(op.outputs)]):
            if _is_traced(value):
                add("output", f"output {index}", index,
                    tuple(value.shape), None, value)


_ABSENT = object()
_REQUESTED: list[_Recorder] = []  # recorders waiting for their trace


@contextlib.contextmanager
def recording(executor: Any, skip: Callable[[], bool]) -> Iterator[Any]:
    """Around the step's body while it is traced (`model_step._trace`).

    Yields `returned(outputs)`: the step's outputs unchanged, or, in a
    trace `record` asked for, `(outputs, recorded tensors)`. `skip()`
    says a call is not to be recorded (inside a tape inside a tape).
    """
    recorder = next((r for r in _REQUESTED if r.executor is executor),
                    None)
    if recorder is None:
        yield lambda outputs: outputs
        return
    with recorder.wrapping(skip):
        yield lambda outputs: (outputs, [
            tf.zeros(()) if t is None else t for t in recorder.tensors
        ])


def record(executor: Any, data: Any) -> list[Realized]:
    """The layouts of every op's tensors in `executor`'s train step on
    the batch `data` (as `fit` gives it); training state unchanged."""
    # The host's calls draw as a train step's would (an augmentation's
    # seed state advances): put back, as the step's writes are.
    host = executor._host
    drawn = host.variables if host is not None else []
    saved = [v.numpy() for v in drawn]
    batch = executor._on_mesh(data, "train")
    for variable, value in zip(drawn, saved):
        variable.assign(value)
    recorder = _Recorder(executor)
    functions = dict(executor._functions)
    # Requested until the step has run: a first run DTensor refuses for a
    # loop function's name is traced again and redone
    # (`rolled_rnn.RedoneOnNameClash`), and each trace records afresh.
    _REQUESTED.append(recorder)
    try:
        function = executor._trace(executor.mesh_key("train", batch),
                                   batch)
        layouts = _run_unchanged(executor, function, batch, recorder)
    finally:
        _REQUESTED.remove(recorder)
        executor._functions.clear()
        executor._functions.update(functions)
    return [dataclasses.replace(e, layout=layout)
            for e, layout in zip(recorder.entries, layouts)]


def _run_unchanged(executor: Any, function: Any, batch: Any,
                   recorder: "_Recorder") -> list:
    """Runs the recording step once, its writes undone after; the
    layouts of the recorded tensors."""
    variables = [s for _, s, _ in executor._pairs]
    if executor._random_state is not None:
        variables.append(executor._random_state)
    saved = [v.read_value() for v in variables]
    try:
        with step_prints.silenced():  # not a step of the user's
            _, tensors = function(batch)
        context.async_wait()
        return [None if t is None else _layout(v)
                for t, v in zip(recorder.tensors, tensors)]
    finally:
        for variable, value in zip(variables, saved):
            variable.assign(value)
        context.async_wait()


def _layout(value: Any) -> Any:
    if not dtensor.is_dtensor(value):
        return None
    return dtensor.fetch_layout(value)


def check(recorded: list[Realized], plans: Any) -> list[Row]:
    """Each recorded tensor beside its op's planned layout for the same
    shape; an op of `plans` never called in the step is a failed row."""
    by_name = {plan.op.name: plan for plan in plans}
    rows = []
    for entry in recorded:
        plan = by_name[entry.op]
        if entry.kind == "input":
            planned = plan.input_layout(entry.index, entry.shape,
                                        entry.sharded)
        elif entry.kind == "output":
            planned = plan.output_layout(entry.index, len(entry.shape),
                                         entry.sharded)
        else:
            planned = plan.weight_layout(entry.shape, entry.shard_axis)
        name = entry.op if entry.call == 1 else f"{entry.op} (call " \
            f"{entry.call})"
        rows.append(Row(name, entry.tensor, entry.kind, planned,
                        entry.layout, entry.layout == planned))
    called = {entry.op for entry in recorded}
    for plan in plans:
        if plan.op.name not in called:
            rows.append(Row(plan.op.name, "-", "call", "called",
                            "not called", False))
    return rows


def mismatches(recorded: list[Realized], plans: Any) -> list[Row]:
    """The rows of `check` whose realized layout is not the plan's."""
    return [row for row in check(recorded, plans) if not row.ok]


def format_layout(layout: Any, mesh: Any = None) -> str:
    """`[a0, -]`: the mesh axis of each dim, `-` unsharded; the mesh is
    named when it is not `mesh`."""
    if layout is None:
        return "(no DTensor)"
    if not isinstance(layout, dtensor.Layout):
        return str(layout)
    specs = ", ".join("-" if s == dtensor.UNSHARDED else s
                      for s in layout.sharding_specs)
    text = f"[{specs}]"
    if mesh is not None and layout.mesh != mesh:
        text += f" on {_mesh_text(layout.mesh)}"
    return text


def _mesh_text(mesh: Any) -> str:
    """`mesh a0=4 (CPU:0, CPU:1, CPU:2, CPU:3)`."""
    axes = " x ".join(f"{n}={mesh.dim_size(n)}" for n in mesh.dim_names)
    names = [d.rsplit("device:", 1)[-1] for d in mesh.global_devices()
             or mesh.local_devices()]
    return f"mesh {axes} ({', '.join(names)})"


def format_table(rows: list[Row], mesh: Any = None) -> str:
    """The rows as text: op, tensor, kind, planned, realized, ok."""
    header = ("op", "tensor", "kind", "planned", "realized", "ok")
    lines = [header] + [
        (r.op, r.tensor, r.kind, format_layout(r.planned, mesh),
         format_layout(r.realized, mesh) if r.realized is not None
         or r.kind != "call" else "not called",
         "ok" if r.ok else "DIFFERS")
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(6)]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
            for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


_SHOWN: "weakref.WeakSet[Any]" = weakref.WeakSet()  # executors shown


def show_once(executor: Any, data: Any) -> None:
    """With `FLEXFLOW_KERAS_SHOW_LAYOUTS` on, prints the table of
    `executor`'s train step (once per executor: per model and strategy);
    every DTensor client records (a collective step), client 0 prints."""
    from flexflow_keras import devices, settings

    if not settings.show_layouts() or executor in _SHOWN:
        return
    _SHOWN.add(executor)
    model, mesh = executor.model, executor.mesh
    try:
        rows = check(record(executor, data), executor.plans)
    except Exception as error:  # noqa: BLE001 - a diagnostic only
        context.async_clear_error()
        text = (f"flexflow_keras: could not record the layouts of model "
                f"'{model.name}': {type(error).__name__}: {error}")
    else:
        bad = sum(not row.ok for row in rows)
        text = (
            "flexflow_keras: layouts in the train step of model "
            f"'{model.name}' on {_mesh_text(mesh)}, batch "
            f"{executor.graph.batch_size} "
            "(realized: read from DTensor; - unsharded)\n"
            + format_table(rows, mesh)
            + ("\nevery op ran as planned" if not bad
               else f"\n{bad} of {len(rows)} differ from the plan")
        )
    if devices.client_id() == 0:
        print(text, flush=True)


def _is_traced(value: Any) -> bool:
    return isinstance(value, tf.Tensor) and not isinstance(
        value, keras.KerasTensor
    )
