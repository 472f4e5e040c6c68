"""Expert-designed strategies: the baselines FlexFlow's paper compares to.

FlexFlow (MLSys'19, section 8.1) measures its search against data
parallelism and against the strategies experts use:

- `one_weird_trick` (Krizhevsky, 2014) for CNNs: data parallelism for
  the convolutional part, model parallelism for the fully connected
  layers (each device holds a slice of their output channels and sees
  the whole batch).
- `layerwise_placement` (GNMT, Wu et al. 2016) for stacked RNNs: each
  recurrent layer whole on its own device, the ops between them with the
  layer that feeds them, and the output projection (the large softmax)
  split over every device by its output channels.
- `embedding_columns` for DLRM-style models: every embedding table split
  by its columns (embedding dims) over all devices, the rest data
  parallel.

`expert_strategy` picks the one that fits a graph (RNN layers:
layerwise; attention: data parallelism; other embeddings: columns;
convolutions with fully connected layers: the trick; else data
parallelism). The search can start from it (`search(...,
candidates=...)`), and `bench/search_bench.py` compares against it.

Every strategy here uses only configs the op allows (`validate_config`):
a split an op cannot take falls back to its data-parallel config.
"""

from collections.abc import Callable

from flexflow_keras.graph import Op, OpGraph
from flexflow_keras.strategy import (
    ParallelConfig, Strategy, data_parallel_config, largest_divisor,
    validate_config,
)

RNN_TYPES = frozenset({"LSTM", "GRU", "SimpleRNN", "Bidirectional", "RNN"})
CONV_TYPES = frozenset({
    "Conv1D", "Conv2D", "Conv3D", "SeparableConv1D", "SeparableConv2D",
    "DepthwiseConv1D", "DepthwiseConv2D",
})
FC_TYPES = frozenset({"Dense", "EinsumDense"})


def _channel_split(op: Op, num_devices: int) -> ParallelConfig | None:
    """`op` split by its parameter (output channel) dim over as many of
    `num_devices` devices as divide it, batch whole; None if it cannot."""
    dim = op.parameter_dim
    if dim is None:
        return None
    degree = largest_divisor(op.output_shape[dim], num_devices)
    if degree == 1:
        return None
    dims = [1] * op.rank
    dims[dim] = degree
    return ParallelConfig(tuple(dims), tuple(range(degree)))


def _valid(op: Op, config: ParallelConfig | None, num_devices: int) -> bool:
    if config is None:
        return False
    try:
        validate_config(op, config, num_devices)
    except ValueError:
        return False
    return True


def _follow_or_data_parallel(
    graph: OpGraph, op: Op, configs: dict, num_devices: int
) -> ParallelConfig:
    """The config of the op feeding `op` when `op` can take it (keeps a
    chain of elementwise ops on the same split), else data parallel."""
    for producer in graph.predecessors(op):
        config = configs.get(producer.name)
        if config is not None and _valid(op, config, num_devices):
            return config
    return data_parallel_config(op, num_devices)


def one_weird_trick(graph: OpGraph, num_devices: int) -> Strategy:
    """Data parallelism for convolutions, model parallelism for the fully
    connected layers after them (Krizhevsky's "one weird trick").

    The fully connected part is every op after the last convolution in
    graph order: Dense layers split their output channels over the
    devices (the whole batch on each), the ops between them follow the
    Dense they read when they can.
    """
    ops = graph.ops
    last_conv = max(
        (i for i, op in enumerate(ops) if op.type in CONV_TYPES), default=-1
    )
    configs: dict[str, ParallelConfig] = {}
    for i, op in enumerate(ops):
        if i <= last_conv:
            configs[op.name] = data_parallel_config(op, num_devices)
        elif op.type in FC_TYPES and _valid(
            op, split := _channel_split(op, num_devices), num_devices
        ):
            configs[op.name] = split
        elif any(p.type in FC_TYPES for p in graph.predecessors(op)):
            configs[op.name] = _follow_or_data_parallel(
                graph, op, configs, num_devices
            )
        else:
            configs[op.name] = data_parallel_config(op, num_devices)
    return Strategy(configs)


def layerwise_placement(graph: OpGraph, num_devices: int) -> Strategy:
    """Each layer of stacked RNNs whole on its own device (GNMT-style).

    An RNN op that is the k-th RNN on the longest path reaching it runs
    on device `(k - 1) mod num_devices` (so an encoder's and a decoder's
    k-th layers share a device, as in GNMT); every other op runs whole
    with the deepest RNN that feeds it (device 0 before any), except the
    fully connected ops after the last RNN layer (the output projection
    and its softmax), which split their output channels over every
    device.
    """
    configs: dict[str, ParallelConfig] = {}
    depth: dict[str, int] = {}  # RNN ops on the longest path, inclusive
    ops = graph.ops
    last_rnn = max(
        (i for i, op in enumerate(ops) if op.type in RNN_TYPES), default=-1
    )
    for i, op in enumerate(ops):
        depth[op.name] = max(
            (depth[p.name] for p in graph.predecessors(op)), default=0
        ) + (op.type in RNN_TYPES)
        device = max(depth[op.name] - 1, 0) % num_devices
        config = ParallelConfig((1,) * max(op.rank, 1), (device,))
        if i > last_rnn >= 0 and op.type in FC_TYPES:
            split = _channel_split(op, num_devices)
            if _valid(op, split, num_devices):
                config = split
        configs[op.name] = config
    return Strategy(configs)


def embedding_columns(graph: OpGraph, num_devices: int) -> Strategy:
    """Every embedding table split by its columns over all devices; the
    rest data parallel."""
    configs = {}
    for op in graph:
        config = None
        if op.type == "Embedding":  # its parameter dim: the columns
            config = _channel_split(op, num_devices)
        if not _valid(op, config, num_devices):
            config = data_parallel_config(op, num_devices)
        configs[op.name] = config
    return Strategy(configs)


EXPERTS: dict[str, Callable[[OpGraph, int], Strategy]] = {
    "one_weird_trick": one_weird_trick,
    "layerwise_placement": layerwise_placement,
    "embedding_columns": embedding_columns,
}


def expert_name(graph: OpGraph) -> str | None:
    """The expert strategy that fits `graph`'s kind of model, or None
    (data parallelism is the expert choice for the rest)."""
    types = {op.type for op in graph}
    if types & RNN_TYPES:
        return "layerwise_placement"
    if "MultiHeadAttention" in types:
        return None  # Transformers of this size: data parallelism
    if "Embedding" in types and not types & CONV_TYPES:
        return "embedding_columns"
    if types & CONV_TYPES and types & FC_TYPES:
        return "one_weird_trick"
    return None


def expert_strategy(graph: OpGraph, num_devices: int) -> Strategy:
    """`EXPERTS[expert_name(graph)]`, or data parallelism when none fits."""
    name = expert_name(graph)
    if name is None:
        return Strategy.data_parallel(graph, num_devices)
    return EXPERTS[name](graph, num_devices)

