"""What DTensor runs of layers the capability table does not list.

`capabilities.TABLE` holds what was measured for Keras's layers. A layer
it does not list (a script's own class, a Keras layer not measured here)
is probed before the search proposes anything for it, so that nothing
fails half-way through a training step:

1. Its call is traced forward and backward in plain TensorFlow, on
   inputs shaped like the graph's (a batch of 4; strings empty). An op
   type that crashes DTensor (`capabilities.crashing_ops`: Python in
   the graph, hash-table lookups) decides at once, from the traced
   graph, before anything runs: the layer cannot run on DTensor.
2. It runs once in plain TensorFlow. If that fails the probe says
   nothing (the layer keeps the default batch split; it may only need
   real data).
3. It runs the same on a 2-device DTensor mesh, batch split, inside the
   runtime's op substitutes, RNN unrolling and replicated layer
   constants. An error naming an op that has no DTensor layout rule
   turns on DTensor's replicated switch for that op
   (`op_rules.enable`; never for a crashing op) and the probe runs
   again.
4. If it still fails, it runs once more with every input replicated.
5. What it needed is a `capabilities.Probed`: nothing (the layer splits
   its batch), replicated ops or replicated inputs (the layer declares
   no split and runs replicated), or an error (it cannot run on DTensor:
   the model trains as plain Keras, decided before the search).

A layer type the table lists as unable to run (`Capability.error`: the
lookup layers) is not probed: the model trains as plain Keras.

Why no child process runs the DTensor part (so that a crash would be
caught): a fresh `python -c` would have to rebuild the layer, which
`keras.saving` does for Keras's own layers but not for a class defined
in the user's `__main__` (the layers probes exist for), and would pay
TensorFlow's import and the virtual devices' setup per probe; a child
made by `os.fork` hangs in its first DTensor function (measured:
TensorFlow's thread pools do not survive the fork). The op types decide
before running instead; a crash of an op type not yet known is not
caught.

Results are cached on disk (`~/.cache/flexflow_keras/capabilities.json`)
by layer class and the digest of its code, config, input shapes and
dtypes, TensorFlow version and the probe's version: a layer type is
probed once per machine, and again once its code is edited.
"""

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from flexflow_keras import capabilities, code_digest, disk_cache
from flexflow_keras.capabilities import Probed
from flexflow_keras.graph import Op, OpGraph
from flexflow_keras.keras_graph import fill_arguments
from flexflow_keras.runtime import (
    dtensor_passes, op_rules, raw_variables, stateful_draws, step_rules,
)
from flexflow_keras.runtime.unroll import unrolled
from flexflow_keras.runtime.tracing import without_memory_rewrites
from flexflow_keras.runtime.layouts import replicated
from flexflow_keras.runtime.variables import (
    attributes_set, captures_on_mesh, layer_constants, replicate, to_layout,
)

DEFAULT_CACHE_PATH = os.path.join(disk_cache.CACHE_DIR, "capabilities.json")
PROBE_BATCH = 4
_MAX_SWITCHES = 4  # ops turned replicated before a probe gives up
# In the cache key: results of earlier probes (which ran layers without
# their replicated constants or string inputs, before slices with
# run-time bounds were rewritten: `op_rules.plain_slice`, or before
# captured constants were copied: `variables.captures_on_mesh`, or
# stateful draws were made stateless: `stateful_draws`, or before
# `keras.ops.cond` ran as the step runs it: `step_rules`, or before
# lookups of fixed tables came out whole: `op_rules._table_lookups_whole`,
# or before `tf.roll` ran as slices: `op_rules.roll_by_slices`, or
# before a graph tensor kept on a layer was left uncopied:
# `variables._needs_copy`, or before grouped convolutions ran as
# depthwise ones: `op_rules.ungrouped`) are not reused.
_PROBE_VERSION = "probe10"
_MISSING_RULE = re.compile(r"'tf\.(\w+)' op does not implement")


def probe_graph(
    graph: OpGraph,
    device_names: tuple[str, ...],
    cache_path: str | None = None,
) -> OpGraph:
    """`graph` with the splits of its unlisted layers probed.

    Raises:
        capabilities.Unsupported: a layer DTensor cannot run at all.
    """
    if capabilities.cannot_run(graph):  # listed so: nothing to probe
        return capabilities.apply_probes(graph, {})
    ops = [op for op in graph if needs_probe(op)]
    if not ops or len(device_names) < 2:
        return graph
    cache = _Cache(cache_path or DEFAULT_CACHE_PATH)
    dtensor_passes.make_device(graph)
    mesh = dtensor.create_mesh([("batch", 2)], devices=list(device_names[:2]))
    found: dict[str, Probed] = {}
    for op in ops:
        key = probe_key(op, graph)
        probed = cache.get(key)
        if probed is None:
            probed = probe_op(op, graph, mesh)
            if probed is not None:
                cache.put(key, probed)
        crashing = capabilities.crashing_ops(
            probed.replicated_ops if probed is not None else ()
        )
        if crashing:  # never switched on, whatever a cache says
            probed = Probed(error=capabilities.crash_reason(crashing))
        if probed is not None:
            op_rules.enable(probed.replicated_ops)
            found[op.name] = probed
    return capabilities.apply_probes(graph, found)


def needs_probe(op: Op) -> bool:
    """Unlisted, splittable, and its layer's first call (shared layers'
    later calls run the same code)."""
    return (
        op.layer is not None
        and capabilities.listed(op.layer) is None
        and bool(op.partitionable)
        and op.shares_weights_with is None
    )


def probe_key(op: Op, graph: OpGraph) -> str:
    """Cache key: layer class and the digest of its code
    (`code_digest`: an edited class is probed again), config, non-batch
    input shapes and dtypes, TensorFlow version, the probe's version."""
    cls = type(op.layer)
    try:
        config = json.dumps(op.layer.get_config(), sort_keys=True,
                            default=repr)
    except Exception:  # a custom layer without a usable get_config
        config = ""
    parts = [
        f"{cls.__module__}.{cls.__qualname__}",
        str(code_digest.class_digest(cls)),
        hashlib.sha1(config.encode()).hexdigest()[:16],
        ";".join(
            f"{graph.tensors[t].shape[1:]}{graph.tensors[t].dtype}"
            for t in op.inputs
        ),
        f"tf{tf.__version__}",
        _PROBE_VERSION,
    ]
    return "|".join(parts)


def probe_op(op: Op, graph: OpGraph, mesh: Any) -> Probed | None:
    """What running `op` on `mesh` needs; None when even plain TensorFlow
    cannot run it on probe inputs (nothing learned)."""
    try:  # decided from the traced op types, before anything runs
        inputs = _probe_inputs(op, graph)
        op_types = _forward_backward(op, inputs, None, run=False)
    except Exception:  # a call that cannot be traced on probe inputs
        return None
    crashing = capabilities.crashing_ops(op_types)
    if crashing:
        return Probed(error=capabilities.crash_reason(crashing))
    try:  # a call that needs real data: the probe learns nothing
        _forward_backward(op, inputs, None)
    except Exception:
        return None
    needed: list[str] = []
    while True:
        try:
            ran = _forward_backward(op, inputs, mesh)
            return Probed(_switched(ran, needed))
        except Exception as error:  # DTensor raises several kinds
            failure = _first_line(error)
            missing = _MISSING_RULE.search(str(error))
            name = missing.group(1) if missing else None
            if (name is None or name in needed
                    or len(needed) >= _MAX_SWITCHES):
                break
            if capabilities.crashing_ops([name]):  # never switched on
                return Probed(tuple(needed),
                              capabilities.crash_reason([name]))
            needed.append(name)
            op_rules.enable([name])
    try:  # not with a split batch: whole on every device?
        ran = _forward_backward(op, inputs, mesh, split=False)
        return Probed(_switched(ran, needed), splits_batch=False)
    except Exception:
        return Probed(tuple(needed), failure)


def _switched(ran: frozenset[str], needed: list[str]) -> tuple[str, ...]:
    """The ops the probe switched, and the ops it ran whose switch was on
    already: DTensor reads a switch once per process and keeps it
    (measured), so an op found missing by an earlier probe, or listed in
    the table, runs replicated here without failing first."""
    already = {t for t in ran if op_rules.switch(t) in os.environ}
    return tuple(sorted(set(needed) | already))


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    message = next((line for line in text if "error:" in line), None)
    message = message or (text[0] if text else "")
    return f"{type(error).__name__}: {message.strip()[:300]}"


def _probe_inputs(op: Op, graph: OpGraph) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    values = []
    for name in op.inputs:
        info = graph.tensors[name]
        shape = (PROBE_BATCH,) + tuple(info.shape[1:])
        if info.dtype == "string":
            values.append(np.full(shape, b"", dtype=object))
            continue
        dtype = np.dtype(info.dtype)
        if np.issubdtype(dtype, np.floating):
            values.append(rng.normal(size=shape).astype(dtype))
        else:  # indices, masks: zeros are valid for any table
            values.append(np.zeros(shape, dtype))
    return values


def _forward_backward(
    op: Op, inputs: list, mesh: Any, split: bool = True, run: bool = True
) -> frozenset[str]:
    """One forward and backward pass of `op` (on `mesh`, batch split or
    replicated, or in plain TensorFlow when `mesh` is None); the types of
    the TensorFlow ops it ran (traced only, not run, unless `run`)."""
    layer = op.layer
    trainable = list(getattr(layer, "trainable_variables", ()))
    others = list(getattr(layer, "non_trainable_variables", ()))

    def put(value):
        value = tf.convert_to_tensor(value)
        return value if mesh is None else replicate(value, mesh)

    def batch_split(x):
        if mesh is None or not split or not x.shape.rank:
            return x
        specs = ["batch"] + [dtensor.UNSHARDED] * (x.shape.rank - 1)
        return dtensor.relayout(x, dtensor.Layout(specs, mesh))

    # As the runtime does: the batch comes in replicated, is split inside
    # the function, and the function is traced with the batch dim unknown
    # (some gradients, AvgPoolGrad's, fail only then).
    xs = [put(x) for x in inputs]
    specs = [tf.TensorSpec((None,) + tuple(x.shape[1:]), x.dtype)
             for x in xs]
    weights = [put(v.value) for v in trainable]
    states = [put(v.value) for v in others]

    def step(xs, weights, states):
        xs = [batch_split(x) for x in xs]
        floats = [x for x in xs if x.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(floats + list(weights))

            args, kwargs = fill_arguments(op, dict(zip(op.inputs, xs)))
            if getattr(layer, "_call_has_training_arg", False):
                kwargs = dict(kwargs, training=True)
            if hasattr(layer, "stateless_call"):
                outputs, _ = layer.stateless_call(
                    weights, states, *args, **kwargs
                )
            else:  # a keras.ops operation: no variables
                outputs = layer(*args, **kwargs)
            flat = [
                o for o in tf.nest.flatten(outputs)
                if getattr(o, "dtype", tf.int32).is_floating
            ]
            # Squared: a constant upstream gradient (that of a plain sum)
            # lets DTensor skip the layout propagation some gradient
            # ops lack (measured: AvgPoolGrad).
            loss = tf.add_n([tf.reduce_sum(o * o) for o in flat]) if flat \
                else None
        if loss is None:
            return outputs, []
        grads = tape.gradient(loss, floats + list(weights))
        # Returned: a gradient left unused is pruned and never runs.
        return outputs, [tf.convert_to_tensor(g) for g in grads
                         if g is not None]

    function = tf.function(step, autograph=False)
    # As the runtime does: tensors a layer keeps as plain attributes
    # (Normalization's mean) replicated, as DTensor refuses a captured
    # regular tensor larger than a scalar.
    constants = layer_constants(layer, mesh) if mesh is not None else []
    # Under the rules the runtime traces its steps under (`step_rules`),
    # with stateful draws on counters of the probe's own: nothing is kept.
    rules = step_rules.traced_as_steps(mesh, [], dtensor.DVariable(to_layout(
        np.zeros(stateful_draws.SLOTS, np.int64), replicated(mesh, 1)
    )), "train", 0) if mesh is not None else contextlib.nullcontext()
    with unrolled(layer), attributes_set(constants), rules:
        concrete = function.get_concrete_function(specs, weights, states)
        if mesh is not None:
            captures_on_mesh(concrete, mesh)
        if run:  # as the runtime calls its steps (`tracing.py`)
            with without_memory_rewrites(), \
                    raw_variables.left_as_they_were(concrete):
                _finished(concrete(xs, weights, states))
    return _op_types(concrete.graph.as_graph_def())


def _finished(outputs: Any) -> None:
    """Waits until a call that returned `outputs` has run to its end.

    Why: a DTensor call returns before its devices have run it, and
    writes the call makes to a raw variable of the user's land after
    the probe gives the variable its value back
    (`raw_variables.left_as_they_were`): a layer counting its calls
    started training at 1 to 3 instead of 0, in more than half of
    repeated probes (measured). A function's outputs are ready only once
    the whole function has run, its writes included."""
    for value in tf.nest.flatten(outputs):
        if not isinstance(value, tf.Tensor):
            continue
        parts = dtensor.unpack(value) if dtensor.is_dtensor(value) \
            else [value]
        for part in parts:
            part.numpy()


def _op_types(graph_def: Any) -> frozenset[str]:
    """Every op type in a GraphDef, its function library included."""
    types = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        types.update(node.op for node in function.node_def)
    return frozenset(types)


class _Cache:
    """`Probed` results on disk (`disk_cache`)."""

    def __init__(self, path: str):
        self.path = path
        self._entries: dict[str, Mapping] | None = None

    def _load(self) -> dict:
        if self._entries is None:
            self._entries = disk_cache.read(self.path)
        return self._entries

    def get(self, key: str) -> Probed | None:
        entry = self._load().get(key)
        return None if entry is None else Probed.from_json(entry)

    def put(self, key: str, probed: Probed) -> None:
        self._load()[key] = probed.to_json()
        try:
            disk_cache.write(self.path, self._entries)
        except OSError:
            pass  # a read-only home: probe again next time
