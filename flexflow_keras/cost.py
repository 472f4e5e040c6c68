"""Forward and backward time of one op partition, measured or analytic.

Measured (`mode="measured"`): the op runs on a shard-shaped input on one
attached device, a few warm-ups, then the median of timed repeats; the
result is cached on disk keyed by (op signature, shard shapes, dtype,
device kind), so a second compile of the same model measures nothing.
A parameter-partitioned op is measured as a clone of its layer built
from its config with the channel count (`units`, `filters`,
`output_dim`) divided by the parameter degree.

Analytic (`mode="analytic"`): a roofline from FLOPs and bytes against
the device spec plus a launch overhead per kernel, so strategies can be
planned for machines that are not attached.

All parts of one config cost the same: degrees divide dims evenly, so
part 0 stands for every part. Only measuring imports TensorFlow.
"""

import json
import warnings
import math
import os
import statistics
import time
from typing import Any

import numpy as np

from flexflow_keras import disk_cache, partition
from flexflow_keras.graph import Op
from flexflow_keras.machine import DeviceSpec, MachineModel
from flexflow_keras.strategy import ParallelConfig

MODES = ("analytic", "measured")
DEFAULT_CACHE_PATH = os.path.join(disk_cache.CACHE_DIR, "op_costs.json")
_CHANNEL_KEYS = ("units", "filters", "output_dim")
_GATHERS = ("Embedding",)  # read only the looked-up rows of their weights


class CostModel:
    """Time of one op partition on one device, cached per shard shape.

    Args:
        machine: Devices that `device` indices refer to; needed by the
            analytic mode and by `update_ms`.
        mode: `analytic` (roofline) or `measured` (run on an attached
            device); None picks measured for live machines.
        cache_path: JSON file of measured costs; None uses
            `~/.cache/flexflow_keras/op_costs.json`.
        warmup: Untimed runs before measuring.
        repeats: Timed runs; the median is kept.
    """

    def __init__(
        self,
        machine: MachineModel | None = None,
        mode: str | None = None,
        cache_path: str | None = None,
        warmup: int = 2,
        repeats: int = 5,
    ):
        if mode is None:
            mode = "measured" if machine is None or machine.live else (
                "analytic"
            )
        if mode not in MODES:
            raise ValueError(
                f"`mode` must be one of {MODES}. Received: mode={mode!r}"
            )
        if mode == "analytic" and machine is None:
            raise ValueError(
                "The analytic cost model needs a machine spec. "
                "Received: machine=None"
            )
        self.machine = machine
        self.mode = mode
        self.cache_path = cache_path or DEFAULT_CACHE_PATH
        self.warmup, self.repeats = warmup, repeats
        self.num_measured = 0  # ops timed by this instance (tests)
        # (op name, config, error) of shards that could not be measured
        # and were costed by the roofline instead.
        self.fallbacks: list[tuple[str, ParallelConfig, str]] = []
        self._memo: dict[Any, tuple[float, float]] = {}
        self._disk: dict[str, list[float]] | None = None

    def __repr__(self) -> str:
        name = self.machine.name if self.machine else None
        return f"CostModel(mode={self.mode!r}, machine={name!r})"

    def device_spec(self, device: int | DeviceSpec) -> DeviceSpec:
        if isinstance(device, DeviceSpec):
            return device
        if self.machine is None:
            raise ValueError(
                "Device indices need a machine. Received: "
                f"device={device!r}, machine=None"
            )
        return self.machine.devices[device]

    def op_cost(
        self, op: Op, config: ParallelConfig, device: int | DeviceSpec
    ) -> tuple[float, float]:
        """(forward_ms, backward_ms) of one partition of `op`."""
        spec = self.device_spec(device)
        key = (id(op), config.dims, spec)
        hit = self._memo.get(key)
        if hit is None:
            if self.mode == "analytic":
                hit = analytic_op_ms(op, config, spec)
            else:
                hit = self._measured(op, config, spec)
            self._memo[key] = hit
        return hit

    def update_ms(
        self, num_bytes: float, slots: int, device: int | DeviceSpec
    ) -> float:
        """Optimizer update of `num_bytes` of weights, memory bound.

        Reads weight, gradient and slots; writes weight and slots.
        """
        spec = self.device_spec(device)
        moved = num_bytes * (3 + 2 * slots)
        return spec.launch_overhead_ms + moved / (spec.memory_gbps * 1e6)

    def _measured(
        self, op: Op, config: ParallelConfig, spec: DeviceSpec
    ) -> tuple[float, float]:
        key = cache_key(op, config, spec.kind)
        disk = self._load()
        if key not in disk:
            try:
                measured = measure_op_ms(
                    op, config, self.warmup, self.repeats
                )
            except Exception as error:  # any op the shard breaks
                if self.machine is None:
                    raise
                # Why: a shard shape some layer cannot run (e.g. a split
                # it does not support) must not stop the search; the
                # roofline still ranks the config. Not cached on disk.
                self.fallbacks.append((op.name, config, repr(error)))
                return analytic_op_ms(op, config, spec)
            disk[key] = list(measured)
            self.num_measured += 1
            self._save()
        forward_ms, backward_ms = disk[key]
        return float(forward_ms), float(backward_ms)

    def _load(self) -> dict[str, list[float]]:
        if self._disk is None:
            self._disk = {}
            if os.path.exists(self.cache_path):
                with open(self.cache_path) as f:
                    self._disk = json.load(f)
        return self._disk

    def _save(self) -> None:
        disk_cache.write(self.cache_path, self._disk)


def analytic_cost_model(machine: MachineModel) -> CostModel:
    """Roofline costs against `machine`'s device specs."""
    return CostModel(machine, mode="analytic")


def measured_cost_model(
    cache_path: str | None = None, machine: MachineModel | None = None
) -> CostModel:
    """Costs timed on the attached devices, cached at `cache_path`."""
    return CostModel(machine, mode="measured", cache_path=cache_path)


def shard_shapes(
    op: Op, config: ParallelConfig
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """(input shapes, output shape) of part 0 of `op` under `config`."""
    out_rect = partition.part_rects(op.output_shape, config.dims)[0]
    ins = tuple(
        tuple(hi - lo for lo, hi in partition.input_region(op, k, out_rect))
        for k in range(len(op.inputs))
    )
    return ins, tuple(hi - lo for lo, hi in out_rect)


def analytic_op_ms(
    op: Op, config: ParallelConfig, spec: DeviceSpec
) -> tuple[float, float]:
    """Roofline: max(FLOPs / peak, bytes / bandwidth) + launches.

    Bytes are the part's input regions, output part and weight shard.
    Backward moves about twice that (reads the output gradient and the
    forward tensors, writes input and weight gradients) and launches a
    second kernel for the weight gradient when the op has weights.
    """
    parts = config.num_parts
    ins, out = shard_shapes(op, config)
    itemsize = np.dtype(op.dtype).itemsize
    degree = partition.parameter_degree(op, config)
    sharded, replicated = partition.weight_split(op, degree)
    frozen = partition.frozen_weight_bytes(op, degree)
    moved = itemsize * (sum(map(math.prod, ins)) + math.prod(out))
    if op.type in _GATHERS:
        moved += itemsize * math.prod(out)  # only the rows looked up
    else:
        moved += sharded + replicated + frozen
    per_ms_bytes = spec.memory_gbps * 1e6
    per_ms_flops = spec.peak_flops / 1e3
    forward = max(op.forward_flops / parts / per_ms_flops,
                  moved / per_ms_bytes)
    backward = max(op.backward_flops / parts / per_ms_flops,
                   2 * moved / per_ms_bytes)
    kernels = 2 if op.weights else 1
    return (forward + spec.launch_overhead_ms,
            backward + kernels * spec.launch_overhead_ms)


def cache_key(op: Op, config: ParallelConfig, device_kind: str) -> str:
    """Disk-cache key: op signature, shard shapes, dtype, device kind."""
    ins, out = shard_shapes(op, config)
    degree = partition.parameter_degree(op, config)
    signature = _signature(op, degree)
    return json.dumps(
        [op.type, signature, ins, out, op.dtype, device_kind],
        sort_keys=True, default=str,
    )


def _signature(op: Op, degree: int) -> Any:
    """The layer config without its name, channels divided by `degree`."""
    get_config = getattr(op.layer, "get_config", None)
    if get_config is None:
        return None
    try:
        config = dict(get_config())
    except (NotImplementedError, TypeError):
        return None
    config.pop("name", None)
    for key in _CHANNEL_KEYS:
        if key in config and degree > 1:
            config[key] = config[key] // degree
    return config


def measure_op_ms(
    op: Op, config: ParallelConfig, warmup: int, repeats: int
) -> tuple[float, float]:
    """Times forward and forward+backward of part 0; returns ms each.

    Backward is the difference, floored at 0. Runs on the first attached
    device: all devices of a live machine are of one kind.
    """
    import tensorflow as tf

    from flexflow_keras import devices
    from flexflow_keras.keras_graph import fill_arguments

    if op.layer is None or op.arguments is None:
        raise ValueError(
            f"Op '{op.name}' has no Keras layer to measure; build the "
            "graph with `build_graph(model, batch)` or use the analytic "
            "cost model. Received: layer=None"
        )
    # A shard is not the user's layer (e.g. a 1-unit softmax Dense):
    # Keras's warnings about it would only confuse the user.
    with tf.device(devices.device_names()[0]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = _shard_layer(op, partition.parameter_degree(op, config))
        ins, _ = shard_shapes(op, config)
        values = {
            name: _random_input(tf, shape, _input_dtype(op, k))
            for k, (name, shape) in enumerate(zip(op.inputs, ins))
        }
        args, kwargs = fill_arguments(op, values)
        floats = [v for v in values.values() if v.dtype.is_floating]
        forward, train = _step_functions(tf, layer, args, kwargs, floats)
        forward_ms = _median_ms(forward, warmup, repeats)
        train_ms = _median_ms(train, warmup, repeats)
    return forward_ms, max(train_ms - forward_ms, 0.0)


def _input_dtype(op: Op, index: int) -> str:
    if op.type == "Embedding":
        return "int32"
    return op.dtype


def _random_input(tf: Any, shape: tuple[int, ...], dtype: str) -> Any:
    if "int" in dtype:
        return tf.zeros(shape, dtype=dtype)
    return tf.random.uniform(shape, dtype=dtype)


def _shard_layer(op: Op, degree: int) -> Any:
    """The layer itself, or a clone with channels divided by `degree`."""
    layer = op.layer
    if degree == 1 or not hasattr(layer, "get_config"):
        return layer
    config = layer.get_config()
    for key in _CHANNEL_KEYS:
        if key in config:
            config[key] = config[key] // degree
    config["name"] = f"{config.get('name', 'op')}_shard{degree}"
    return type(layer).from_config(config)


def _step_functions(
    tf: Any, layer: Any, args: tuple, kwargs: dict, floats: list
) -> tuple[Any, Any]:
    def total(y: Any) -> Any:
        leaves = [t for t in tf.nest.flatten(y) if t.dtype.is_floating]
        return tf.add_n([tf.reduce_sum(t) for t in leaves])

    @tf.function
    def forward() -> Any:
        return total(layer(*args, **kwargs))

    forward()  # builds the layer (and its weights) once
    weights = list(getattr(layer, "trainable_variables", []))

    @tf.function
    def train() -> Any:
        with tf.GradientTape() as tape:
            tape.watch(floats)
            loss = total(layer(*args, **kwargs))
        grads = tape.gradient(loss, floats + weights)
        return tf.add_n([tf.reduce_sum(g) for g in grads if g is not None]
                        + [loss])

    return forward, train


def _median_ms(fn: Any, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn().numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn().numpy()  # .numpy() waits for the device
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
