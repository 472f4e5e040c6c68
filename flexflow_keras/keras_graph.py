"""The bridge from Keras models to `OpGraph`s (`graph.py`, pure data).

Walks a functional, Sequential or nested Keras model (or the trace of a
subclassed one's `call`) into ops, and replays an op's call with other
values (`fill_arguments`). The only module of the planning stages that
reads Keras objects.
"""

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from flexflow_keras import notices, op_specs
from flexflow_keras.graph import Op, OpGraph, TensorInfo, WeightInfo
from flexflow_keras.model_state import state_of


class UnknownDimension(ValueError):
    """An op's output whose shape is unknown beyond the batch even on
    static input shapes (a layer of the user's whose output length is
    drawn at run time): the search cannot price it. (Inputs of the step
    with unknown dims are `varying`, priced at `VARYING_DIM_SIZE`.)"""


# The size the search prices a dim at whose length changes from batch to
# batch: a model input or a host layer's output left unknown beyond the
# batch by the model and by fit's data (text padded to each batch's
# longest: `padded_batch`, a `TextVectorization` without
# `output_sequence_length`). Such dims are never split (`varying_dims`),
# so any length runs under the plan; this size only weighs their ops
# against the others, as a typical sentence's token count.
VARYING_DIM_SIZE = 64


class UntracedBatchSize(ValueError):
    """A model whose call needs the batch size as a number, traced on
    one batch size, fails to trace on another (`trace_call`)."""


def build_graph(model: Any, batch_size: int) -> OpGraph:
    """The `OpGraph` of a built Keras model for a global batch size.

    Args:
        model: A functional or Sequential Keras model (nested models are
            flattened). Subclassed models have no graph to walk.
        batch_size: Global batch size; fills the batch dim of every shape.

    Returns:
        The `OpGraph`.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            "`batch_size` must be a positive integer. "
            f"Received: batch_size={batch_size!r}"
        )
    function = _as_function(model, batch_size)
    if function is None:
        raise ValueError(
            f"Model '{model.name}' has no graph of layers to parallelize: "
            "only functional and Sequential models (built, with a known "
            "input shape) can be turned into an OpGraph. Received: a "
            f"{type(model).__name__}. Build it with `keras.Input(...)` or "
            "give the Sequential model an `Input` layer."
        )
    builder = _GraphBuilder(batch_size)
    if isinstance(function, SideBySide):
        # The parts run inside the model's own step, on its tensors,
        # not on fit's data: nothing of theirs runs on the host first.
        outputs = ()
        for prefix, part in function.parts:
            builder.add_inputs(part, prefix)
            outputs += builder.walk(part, prefix=prefix, bindings={})
    else:
        builder.add_inputs(function)
        builder.hosted = {id(node) for node in hosted_nodes(function)}
        outputs = builder.walk(function, prefix="", bindings={})
    consumed = {t for op in builder.ops for t in op.inputs}
    # The step's inputs: the model's (but those only the host reads),
    # then what the host computes before the step.
    inputs = tuple(
        t for t in builder.inputs
        if t in consumed or t not in builder.host_reads
    )
    return OpGraph(
        builder.ops, builder.tensors, inputs, outputs, batch_size
    )


def hosted_nodes(function: Any) -> list:
    """The calls of `function` (a model's Keras `Function`, its top
    level) that run on the host before each step, in call order.

    Why: a lookup layer's hash table crashes TensorFlow's DTensor even
    replicated (`capabilities.crash_reason`), and scripts put it right
    on a raw feature (`StringLookup()(keras.Input(dtype="string"))`).
    Run there, before the step, on the batch as it comes, it computes
    what it computes in Keras; its result goes into the step as one
    more input (`runtime/host_prefix.py`).

    A call qualifies when its layer type may run on the host
    (`capabilities.Capability.host`: lookups, and random augmentations
    DTensor cannot lay out), each input is a model input, another such
    call's result, or one of those passed through layers that can run
    on the host too (`_host_feeder`: reshapes, casts, Keras's weightless
    preprocessing layers, which then run on the host), and no result is
    a model output. A nested model of such layers alone, with one that
    must run on the host (keras.io's `data_augmentation` Sequential), is
    one such call. Other calls of such types keep their `error`: the
    model trains as plain Keras, saying why.
    """
    nodes = _nodes_in_order(function)
    outputs = {id(kt) for kt in function.outputs}
    ready = {id(kt) for kt in function.inputs}
    lookups, feeders = set(), set()
    for node in nodes:
        operation = node.operation
        if (any(id(kt) not in ready for kt in node.arguments.keras_tensors)
                or any(id(kt) in outputs for kt in node.outputs)):
            continue
        if _must_run_on_host(operation):
            lookups.add(id(node))
        elif _host_feeder(operation):
            feeders.add(id(node))
        else:
            continue
        ready.update(id(kt) for kt in node.outputs)
    # A feeder runs on the host only for a lookup it leads to.
    needed: set[int] = set()
    hosted = set()
    for node in reversed(nodes):
        if id(node) in lookups or (
                id(node) in feeders
                and any(id(kt) in needed for kt in node.outputs)):
            hosted.add(id(node))
            needed.update(id(kt) for kt in node.arguments.keras_tensors)
    return [node for node in nodes if id(node) in hosted]


def _must_run_on_host(operation: Any) -> bool:
    """A layer DTensor cannot run that may run on the host instead, or a
    nested model of host feeders with one such layer."""
    from flexflow_keras import capabilities

    inner = _as_function(operation)
    if inner is None:
        capability = capabilities.listed(operation)
        return capability is not None and capability.host
    layers = [node.operation for node in _nodes_in_order(inner)]
    return (any(_must_run_on_host(layer) for layer in layers)
            and all(_must_run_on_host(layer) or _host_feeder(layer)
                    for layer in layers))


def _host_feeder(operation: Any) -> bool:
    """A Keras layer without weights that may run on the host before a
    layer that must (`capabilities.HOST_FEEDERS`, or one of Keras's
    preprocessing layers, which Keras runs in tf.data pipelines too:
    `DataLayer`). It computes there what it computes in the step."""
    from keras.src.layers.preprocessing.data_layer import DataLayer

    from flexflow_keras import capabilities

    if (getattr(operation, "weights", ())
            or not type(operation).__module__.startswith("keras.")):
        return False
    return (isinstance(operation, DataLayer)
            or type(operation).__name__ in capabilities.HOST_FEEDERS)


def _nodes_in_order(function: Any) -> list:
    """`function`'s layer calls, producers first, a shared layer's calls
    in the user's order."""
    by_depth = function._nodes_by_depth
    return [
        node
        for depth in sorted(by_depth, reverse=True)
        for node in sorted(
            by_depth[depth],
            key=lambda n: _call_index(n) if n.operation else 0,
        )
        if node.operation is not None and not node.is_input
    ]


def has_graph(model: Any) -> bool:
    """Whether `build_graph` can walk `model` (functional or Sequential)."""
    return _as_function(model) is not None


def function_of(model: Any) -> Any:
    """What runs `model`'s layers: its Keras `Function` (a Sequential's
    inner one), else the model itself (e.g. a Sequential not yet built)."""
    function = _as_function(model)
    return model if function is None else function


def trace_call(model: Any, inputs: Any, batch_size: int) -> str | None:
    """Gives a model a graph: its `call` run on symbolic inputs (see
    `needs_trace`). Returns None, or why its call cannot be traced.

    The layers called inside `call()` record their calls, as in a
    functional model, so each becomes an op; inner models are flattened
    as usual. The model still runs its own `call()` (and step); the
    graph only names the layer calls a strategy places. A model without
    a `call()` (a VAE whose `train_step` calls its encoder and decoder)
    gets the graphs of the functional models it holds, side by side.

    The call is traced on inputs of any batch size first. A call that
    needs the batch size as a number (keras.io's PatchConvNet repeats a
    class token `ops.shape(x)[0]` times, which leaves the concatenated
    tensor's shape unknown) is traced again on inputs of `batch_size`,
    as Keras itself builds such a model on the first batch; the graph
    of another batch size is then traced on that size (`_traced_at`).
    A call that runs on no symbolic tensor makes the model one op
    (`_as_one_op`), on any batch size or on `batch_size` alike. A call
    that fails even so, of a model whose class defines its own step, is
    replaced by the functional models it holds, side by side, as for a
    model without a call.

    Args:
        model: A Keras model.
        inputs: `keras.Input`s (any structure) shaped like `fit`'s data,
            the batch dim None.
        batch_size: The global batch size fit() feeds first.
    """
    import keras

    failure = None
    # A model without a call() is not called as one op: Keras would mark
    # it built on the way to the NotImplementedError, and a script's
    # `save_weights` that Keras refuses would then pass.
    no_call = type(model).call is keras.Model.call
    for whole in (False,) if no_call else (False, True):
        for batch in (None, batch_size):
            tracer = _as_one_op if whole else _traced
            try:
                with _quiet_auto_builds():
                    function = tracer(model, inputs if batch is None
                                      else _with_batch(inputs, batch))
            except Exception as error:  # noqa: BLE001 - no graph
                # The first failure is the one reported.
                failure = failure or f"{type(error).__name__}: {error}"
                continue
            # Kept off Keras's attribute tracking (`model_state`): a
            # trace must not become a tracked sublayer of the model.
            state = state_of(model)
            state.traced_function, state.traced_whole = function, whole
            if batch is not None:
                state.traced_batch, state.trace_inputs = batch, inputs
                state.traced_at = {batch: function}
            return None
    # A model whose class defines its own step decides there what each
    # model it holds is called on: planned as those models, as one
    # without a call() is. keras.io's siamese network feeds unlabelled
    # (anchor, positive, negative) triples; Keras reads the anchor as
    # the input, so its call() (a three-input network on that one
    # tensor) fails, while its train_step calls the network on the
    # whole triple. It trained as plain Keras on one device.
    if not no_call and overrides_step(model):
        try:
            function = _inner_models(model)
        except ValueError:
            return failure
        state = state_of(model)
        state.traced_function, state.traced_whole = function, False
        return None
    return failure


@contextlib.contextmanager
def _quiet_auto_builds() -> Iterator[None]:
    """Keras's warnings that it could not build a layer by tracing its
    call, silenced while a model's call is traced for its graph.

    They are about the trace, not the user's code: sizes a call takes
    with `tf.shape` and passes to the next layer are known on the real
    tensors plain Keras builds on, and unknown on symbolic ones (keras.io's
    focal modulation network passes `height, width, channels` from layer
    to layer). A trace that fails there is followed by one that builds
    the model as one op (`_as_one_op`); the step builds nothing the
    user's first call would not."""
    with notices.ignoring(
            r"Layer '.*' looks like it has unbuilt state",
            r"`build\(\)` was called on layer '.*', "
            r"however the layer does not have a `build\(\)` method"):
        yield


def _as_one_op(model: Any, inputs: Any) -> Any:
    """A graph whose one op is `model` itself, called as Keras calls a
    layer on symbolic inputs (its `compute_output_spec` runs `call()` on
    TensorFlow placeholders). For a `call()` that cannot run on Keras's
    symbolic tensors (TensorFlow NumPy or `tf.*` ops between its layers:
    keras.io's `tensorflow_numpy_models`): the model trains split over
    the batch, as a custom layer does, instead of on one device."""
    import keras

    return keras.Model(inputs, model(inputs), name=model.name)


def _traced(model: Any, inputs: Any) -> Any:
    """A functional model of `model`'s call on `inputs` (raises what the
    call raises)."""
    import inspect

    import keras
    from keras.src.utils import python_utils

    if type(model).call is keras.Model.call:
        return _inner_models(model)
    if not model.built and not python_utils.is_default(model.build):
        # As Keras's first call does: a build() of the user's may make
        # the layers or weights that call() uses.
        model.build(keras.tree.map_structure(
            lambda kt: tuple(kt.shape), inputs))
    kwargs = {}
    if "training" in inspect.signature(model.call).parameters:
        kwargs["training"] = False
    outputs = model.call(inputs, **kwargs)
    # The trace's own inputs are unnamed; Keras warns when a dict of
    # them (a model fed {"source": ..., ...}) does not match their names,
    # which is not the user's doing.
    with notices.ignoring("When providing `inputs` as a dict"):
        return keras.Model(inputs, outputs, name=model.name)


def _with_batch(inputs: Any, batch_size: int) -> Any:
    """`keras.Input`s like `inputs` whose batch dim is `batch_size`."""
    import keras

    return keras.tree.map_structure(
        lambda kt: keras.Input(
            batch_shape=(batch_size,) + tuple(kt.shape)[1:],
            dtype=kt.dtype, sparse=kt.sparse),
        inputs,
    )


def _traced_at(model: Any, batch_size: int) -> Any:
    """The trace of a model whose call needs a static batch size
    (`trace_call`) on `batch_size`, traced once per size."""
    state = state_of(model)
    function = state.traced_at.get(batch_size)
    if function is None:
        tracer = _as_one_op if state.traced_whole else _traced
        try:
            with _quiet_auto_builds():
                function = tracer(
                    model, _with_batch(state.trace_inputs, batch_size))
        except Exception as error:  # noqa: BLE001 - said, not raised
            raise UntracedBatchSize(
                f"its call() runs on batches of {state.traced_batch} but "
                f"could not be traced on batches of {batch_size} "
                f"({type(error).__name__}: {error})") from error
        state.traced_at[batch_size] = function
    return function


class SideBySide:
    """The functional models a model without `call()` holds, as one
    graph: a VAE's encoder and decoder, a diffusion model's network and
    its EMA copy. Each part is walked as it is; `parts` holds (prefix of
    its op names, its Keras `Function`).

    Why not one `keras.Model` over their layers: Keras requires the
    layer names of one model to be unique, and `keras.models.clone_model`
    (the EMA copy of keras.io's DDIM, a target network) keeps every name;
    such a model trained as plain Keras. Where the parts' layer names
    collide, each part's ops are named under the attribute that holds it
    (`network/conv2d`, `ema_network/conv2d`); elsewhere as the layers
    are named, as before.
    """

    def __init__(self, name: str, parts: list[tuple[str, Any]]):
        self.name = name
        self.parts = parts
        self.inputs = [t for _, p in parts for t in p.inputs]
        self.outputs = [t for _, p in parts for t in p.outputs]


def _inner_models(model: Any) -> SideBySide:
    """The functional models `model` holds, side by side."""
    held = [
        (layer, _own_function(layer))
        for layer in model._flatten_layers(include_self=False,
                                           recursive=False)
    ]
    held = [(layer, f) for layer, f in held if f is not None]
    if not held:
        raise ValueError(
            "it holds no functional or Sequential model as an attribute"
        )
    names = [op.name for _, f in held for op in f.operations]
    if len(set(names)) == len(names):
        return SideBySide(model.name, [("", f) for _, f in held])
    attributes = {id(v): k for k, v in vars(model).items()
                  if not k.startswith("_")}
    prefixes = [attributes.get(id(layer), layer.name) for layer, _ in held]
    prefixes = [p if prefixes.count(p) == 1 else f"{p}#{i}"
                for i, p in enumerate(prefixes)]
    return SideBySide(model.name, [
        (prefix + "/", f) for prefix, (_, f) in zip(prefixes, held)
    ])


def is_traced(model: Any) -> bool:
    """Whether `model`'s graph comes from `trace_call`."""
    return state_of(model).traced_function is not None


def needs_trace(model: Any) -> bool:
    """Whether `model`'s graph must come from `trace_call`: a subclassed
    model (no graph of its own), or a functional or Sequential one whose
    inputs have unknown non-batch dims (`keras.Input((None,))`: the
    simulator needs the shapes `fit` feeds)."""
    if is_traced(model):
        return False
    function = _own_function(model)
    if function is None:
        return is_subclassed(model)
    return unknown_dims(function.inputs)


# Methods whose override makes the model's own step the one to run.
STEP_METHODS = (
    "train_step", "test_step", "predict_step", "compute_loss",
    "_compute_loss",
)


def overrides_step(model: Any) -> bool:
    """Whether `model`'s class defines its own train, test or predict
    step (what it passes its compiled metrics and loss is its own)."""
    return any(defined_outside_keras(type(model), method)
               for method in STEP_METHODS[:3])


def defined_outside_keras(cls: type, method: str) -> bool:
    """Whether the class that defines `method` for `cls` is the user's
    (not Keras's, not ours)."""
    for klass in cls.__mro__:
        if method in vars(klass):
            module = klass.__module__
            return not module.startswith(("keras.", "flexflow_keras."))
    return False


def is_subclassed(model: Any) -> bool:
    """A Keras model with no functional graph of its own (its `call()`
    is Python code)."""
    from keras.src.models.sequential import Sequential

    return not isinstance(model, Sequential) and _own_function(model) is None


def _as_function(model: Any, batch_size: int | None = None) -> Any:
    """The Keras `Function` behind a model (its trace, if it has one; on
    `batch_size` where the trace needed a static batch), or None."""
    state = state_of(model)
    traced = state.traced_function
    if traced is None:
        return _own_function(model)
    if batch_size is None or state.traced_batch in (None, batch_size):
        return traced
    return _traced_at(model, batch_size)


def _own_function(model: Any) -> Any:
    """The Keras `Function` a model was built as, or None."""
    from keras.src.models.functional import Functional
    from keras.src.models.sequential import Sequential

    if isinstance(model, Sequential):
        if model._functional is None and model.built is False:
            return None
        return model._functional
    if isinstance(model, Functional):
        return model
    return None


def unknown_dims(tensors: Any) -> bool:
    """Whether any of `tensors` has an unknown dim beyond the batch."""
    return any(None in tuple(t.shape)[1:] for t in tensors)


def _on_call_shapes(inner: Any, in_kts: list) -> Any:
    """A nested model's `Function`, run again on inputs shaped as this
    call's where its own inputs leave dims unknown (an encoder built on
    `keras.Input((None,))`, called on the traced, fully known shapes):
    its layers' calls then carry the shapes the search needs. `inner`
    itself otherwise, or if its `call` cannot run on them."""
    if not unknown_dims(inner.inputs) or unknown_dims(in_kts):
        return inner
    import keras
    from keras import tree
    from keras.src.ops.function import Function

    inputs = [
        keras.Input(batch_shape=(None,) + tuple(kt.shape)[1:],
                    dtype=own.dtype, sparse=own.sparse, name=own.name)
        for own, kt in zip(inner.inputs, in_kts)
    ]
    structured = tree.pack_sequence_as(inner._inputs_struct, inputs)
    try:
        outputs = inner.call(structured)
    except Exception:  # noqa: BLE001 - keep the model's own graph
        return inner
    return Function(structured, outputs, name=inner.name)


def _specs_on(node: Any, in_kts: list, input_shapes: tuple) -> Any:
    """The output shapes of `node`'s call on inputs of `input_shapes`
    (all static), by the layer's `compute_output_spec`, else by tracing
    its `call` on them; None if both fail or leave a dim unknown.

    Why the trace: a layer's own `compute_output_shape` may leave a dim
    unknown that its call computes (`EinsumDense("btd,de->bte",
    output_shape=(None, 24))`, as Keras's docs write it, gives
    `(None, None, 24)` on a `(None, 10, 16)` input); the model trained
    as plain Keras on one device. Keras's own default for a layer
    without `compute_output_shape` is that trace
    (`backend.compute_output_spec(self.call, ...)`)."""
    from keras import tree
    from keras.src import backend
    from keras.src.backend.common.keras_tensor import KerasTensor

    known = {
        id(kt): KerasTensor(shape, dtype=kt.dtype, sparse=kt.sparse)
        for kt, shape in zip(in_kts, input_shapes)
    }
    operation = node.operation
    try:
        args, kwargs = node.arguments.fill_in(known)
    except Exception:  # noqa: BLE001 - the unknown dim is reported
        return None
    ways = [(operation.compute_output_spec, operation.compute_output_spec)]
    if hasattr(operation, "call"):
        ways.append((lambda *a, **k: backend.compute_output_spec(
            operation.call, *a, **k), operation.call))
    for way, takes in ways:
        try:
            specs = tree.flatten(way(*args, **_accepted(takes, kwargs)))
        except Exception:  # noqa: BLE001 - the unknown dim is reported
            continue
        shapes = [tuple(spec.shape) for spec in specs]
        if not any(None in shape for shape in shapes):
            return tuple(tuple(int(d) for d in shape) for shape in shapes)
    return None


def _accepted(function: Any, kwargs: dict) -> dict:
    """The `kwargs` `function` takes: a call traced on fit's data records
    `training=`, which Keras's `Layer.__call__` passes on only to a
    `call` that takes it (an Embedding's does not)."""
    import inspect

    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}


def _call_index(node: Any) -> int:
    """Position of a call among all calls of its layer (user order)."""
    return node.operation._inbound_nodes.index(node)


class _GraphBuilder:
    """Walks Keras nodes depth-first through nested models."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.ops: list[Op] = []
        self.tensors: dict[str, TensorInfo] = {}
        self.names: dict[int, str] = {}  # id(KerasTensor) -> tensor name
        self.first_op_of_layer: dict[int, str] = {}
        self.inputs: list[str] = []  # the model's, then hosted results
        self.hosted: set[int] = set()  # ids of `hosted_nodes`
        self.host_reads: set[str] = set()  # tensors hosted calls read
        self.any_varying = False  # a step input has `varying` dims
        # Tensors the loss's gradient reaches (`Op.gradient_inputs`).
        self.differentiable: set[str] = set()

    def add_inputs(self, function: Any, prefix: str = "") -> tuple[str, ...]:
        names = []
        for kt in function.inputs:
            layer = kt._keras_history.operation
            name = prefix + (layer.name if layer is not None else kt.name)
            fixed = kt.shape[0] if kt.shape else None
            if fixed is not None and fixed != self.batch_size:
                # Every shape downstream would carry the fixed batch.
                raise ValueError(
                    f"Model input '{name}' has a fixed batch size of "
                    f"{fixed}, which differs from the global batch size. "
                    f"Received: batch_size={self.batch_size}. Use "
                    f"batch_size={fixed}, or leave the batch dim of "
                    "`keras.Input` as None."
                )
            shape, varying = self.step_input_shape(kt, name)
            self.tensors[name] = TensorInfo(name, shape, str(kt.dtype),
                                            varying=varying)
            self.names[id(kt)] = name
            names.append(name)
        self.inputs.extend(names)
        return tuple(names)

    def static_shape(self, kt: Any, where: str) -> tuple[int, ...]:
        shape = list(kt.shape)
        if shape and shape[0] is None:
            shape[0] = self.batch_size
        if any(d is None for d in shape):
            raise UnknownDimension(
                f"Tensor of '{where}' has an unknown dimension; the search "
                "needs static shapes. Received: shape="
                f"{tuple(kt.shape)}, on static input shapes: its length "
                "is known only when the layer runs. Give its output a "
                "length that its inputs' shapes decide (a fixed slice, "
                "a `compute_output_shape`)."
            )
        return tuple(int(d) for d in shape)

    def step_input_shape(self, kt: Any, where: str
                         ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shape of an input of the step (a model input, a host
        layer's output) and its `varying` dims: those unknown beyond the
        batch, at `VARYING_DIM_SIZE`."""
        shape = list(kt.shape)
        if shape and shape[0] is None:
            shape[0] = self.batch_size
        varying = tuple(d for d, size in enumerate(shape) if size is None)
        if varying:
            self.any_varying = True
        return tuple(VARYING_DIM_SIZE if size is None else int(size)
                     for size in shape), varying

    def output_shapes(self, name: str, node: Any, in_kts: list,
                      input_shapes: tuple) -> tuple[tuple[int, ...], ...]:
        """The static shapes of `node`'s outputs. Where Keras left a dim
        unknown beyond the batch (keras.io's EANet: `ops.reshape(x, (B,
        -1, d))` with `B = ops.shape(x)[0]`), the layer's output spec is
        computed again on inputs whose batch dim is the graph's: then
        TensorFlow's shape inference knows the `-1`."""
        try:
            return tuple(self.static_shape(kt, name) for kt in node.outputs)
        except UnknownDimension as unknown:
            shapes = _specs_on(node, in_kts, input_shapes)
            if shapes is None or len(shapes) != len(node.outputs):
                raise unknown
            return shapes

    def varying_dims(self, kt: Any) -> tuple[int, ...]:
        """The dims of an op's output that may change from batch to
        batch: where the step has `varying` inputs, those Keras leaves
        unknown beyond the batch (the padded length an Embedding, a
        Conv1D or an attention layer keeps). Unknown dims of a model
        whose inputs are all static are ones Keras did not infer (a
        reshape's -1): static, so splittable, as before."""
        if not self.any_varying:
            return ()
        return tuple(d for d, size in enumerate(tuple(kt.shape))
                     if d and size is None)

    def walk(
        self, function: Any, prefix: str, bindings: dict[int, str]
    ) -> tuple[str, ...]:
        """Adds the ops of `function`; returns its output tensor names."""
        self.names.update(bindings)
        nodes = _nodes_in_order(function)
        # `name#k` numbers the calls of a shared layer in the user's order.
        call_rank = {}
        for node in nodes:
            calls = call_rank.setdefault(id(node.operation), [])
            calls.append(_call_index(node))
        for node in nodes:
            index = _call_index(node)
            rank = sorted(call_rank[id(node.operation)]).index(index)
            base = prefix + node.operation.name
            name = base if rank == 0 else f"{base}#{rank}"
            if id(node) in self.hosted:
                self.add_hosted(node, name)
            else:
                self.add_node(node, name)
        return tuple(self.names[id(kt)] for kt in function.outputs)

    def add_hosted(self, node: Any, name: str) -> None:
        """A call run on the host (`hosted_nodes`): its results are
        inputs of the step, named as an op's outputs would be."""
        self.host_reads.update(
            self.names[id(kt)] for kt in node.arguments.keras_tensors
        )
        for i, kt in enumerate(node.outputs):
            out = f"{name}:{i}"
            shape, varying = self.step_input_shape(kt, name)
            self.tensors[out] = TensorInfo(
                out, shape, str(kt.dtype), hosted_by=name, varying=varying,
            )
            self.names[id(kt)] = out
            self.inputs.append(out)

    def add_node(self, node: Any, name: str) -> None:
        operation = node.operation
        # A model traced as one op (`_as_one_op`) is that op.
        inner = None if state_of(operation).traced_whole else (
            _as_function(operation))
        in_kts = node.arguments.keras_tensors
        if inner is not None:
            inner = _on_call_shapes(inner, in_kts)
            bindings = {
                id(inner_kt): self.names[id(kt)]
                for inner_kt, kt in zip(inner.inputs, in_kts)
            }
            out_names = self.walk(inner, name + "/", bindings)
            for kt, out in zip(node.outputs, out_names):
                self.names[id(kt)] = out
            return
        self.add_op(name, node, in_kts)

    def add_op(self, name: str, node: Any, in_kts: list) -> None:
        operation = node.operation
        inputs = tuple(self.names[id(kt)] for kt in in_kts)
        input_shapes = tuple(self.tensors[t].shape for t in inputs)
        output_shapes = self.output_shapes(name, node, in_kts, input_shapes)
        outputs = tuple(f"{name}:{i}" for i in range(len(node.outputs)))
        varying = [self.varying_dims(kt) for kt in node.outputs]
        for i, (kt, out) in enumerate(zip(node.outputs, outputs)):
            self.tensors[out] = TensorInfo(
                out, output_shapes[i], str(kt.dtype), name, i,
                varying=varying[i],
            )
            self.names[id(kt)] = out
        spec = op_specs.describe(
            operation, input_shapes, output_shapes, node.arguments
        )
        partitionable = {
            dim: kind for dim, kind in spec.partitionable.items()
            if not varying or dim not in varying[0]
        }
        weights = tuple(
            WeightInfo(
                v.path,
                tuple(int(d) for d in v.shape),
                str(v.dtype),
                bool(v.trainable),
                spec.weight_shard_axes.get(v.path),
            )
            for v in getattr(operation, "weights", ())
        )
        owner = self.first_op_of_layer.setdefault(id(operation), name)
        dtype = str(node.outputs[0].dtype) if node.outputs else "float32"
        self.ops.append(
            Op(
                name=name,
                type=type(operation).__name__,
                inputs=inputs,
                outputs=outputs,
                input_shapes=input_shapes,
                output_shapes=output_shapes,
                dtype=dtype,
                weights=weights,
                shares_weights_with=(
                    owner if owner != name and weights else None
                ),
                forward_flops=float(spec.forward_flops),
                backward_flops=float(spec.backward_flops),
                flops_exact=spec.flops_exact,
                partitionable=partitionable,
                layer=operation,
                arguments=node.arguments,
                tensor_names={id(kt): self.names[id(kt)] for kt in in_kts},
                varying_inputs=(
                    tuple(self.tensors[t].varying for t in inputs)
                    if self.any_varying else ()),
                gradient_inputs=tuple(
                    t in self.differentiable for t in inputs),
            )
        )
        if self.ops[-1].has_backward:  # its float outputs get a gradient
            self.differentiable.update(
                out for out, kt in zip(outputs, node.outputs)
                if "float" in str(kt.dtype))


def fill_arguments(
    op: Op, values: Mapping[str, Any] | Sequence[Any]
) -> tuple[tuple, dict]:
    """Call arguments of `op` with tensors looked up by name, or (a
    sequence) taken by input position, `op.inputs`'s order.

    Why: the runtime replays each call with its own (sharded) values
    while keeping every non-tensor argument the user passed. By position
    where one tensor is several inputs laid out apart: `mha(x, x)`'s
    query split on the sequence, its value whole.
    """
    from keras import tree
    from keras.src.backend.common.keras_tensor import KerasTensor

    by_position = not isinstance(values, Mapping)
    positions = iter(range(len(op.inputs)))

    def swap(x):
        if isinstance(x, KerasTensor):
            if by_position:
                return values[next(positions)]
            return values[op.tensor_names[id(x)]]
        return x

    args = tree.map_structure(swap, op.arguments.args)
    kwargs = tree.map_structure(swap, op.arguments.kwargs)
    return args, kwargs
