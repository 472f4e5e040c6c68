"""Forward and backward time of one op partition, measured or analytic.

Measured (`mode="measured"`): ops run on one attached device, under
`tf.function` (forward and forward+backward in one traced function),
warmed up, then timed a few times (fewer when runs are long); results
are cached on disk, so a second compile of the same model measures
nothing. Two ways, by the op's size:

- A small op (its roofline estimate, whole, under `SMALL_OP_MS`) is
  timed per shard: the shard-shaped input, keyed by (op signature, shard
  shapes, dtype, device kind). A parameter-partitioned shard is a clone
  of its layer built from its config with the channel count (`units`,
  `filters`, `output_dim`) divided by the parameter degree.
- A bigger op is timed once, whole but on a batch cut down until one
  training run takes about `max_run_ms` while moving at least
  `min_bytes` (its representative, keyed by the op's signature and its
  shapes less the batch; ops without weights or with per-channel ones
  by their ranks only); each config is that time scaled by the
  roofline's ratio of the config's part to the representative. Why: timing every shard of every op at full size cost
  minutes on a CPU (a deep separable-conv model at batch 128 measured
  117 shards in 155 s), while the search needs the ops' relative costs;
  big ops run near their roofline's proportions. `per_shard=True` times
  every shard of every op as before.
- A recurrent layer's representative is timed on two batches, the cut
  one and four times it (or a quarter, where the cut one is the whole),
  and its time taken as linear in the batch between them (`_at_samples`)
  before the roofline's ratio scales it to a config's part. Why: its
  loop reads the recurrent kernel and pays its overhead at every
  timestep, whatever the batch, which the roofline (weights read once)
  does not see: Deep Learning with Python's character GRU (1,024 units,
  100 steps, batch 64), timed on 1 sample and scaled 64 times, was
  priced at 14.3 s a step, where it runs in 1.6 s.

Analytic (`mode="analytic"`): a roofline from FLOPs and bytes against
the device spec plus a launch overhead per kernel, so strategies can be
planned for machines that are not attached.

All parts of one config cost the same: degrees divide dims evenly, so
part 0 stands for every part. Only measuring imports TensorFlow.
"""

import json
import math
import os
import statistics
import time
from typing import Any

import numpy as np

from flexflow_keras import (code_digest, disk_cache, notices, op_specs,
                            partition)
from flexflow_keras.graph import Op
from flexflow_keras.machine import DeviceSpec, MachineModel
from flexflow_keras.op_specs_sequence import recurrent
from flexflow_keras.strategy import ParallelConfig

MODES = ("analytic", "measured")
DEFAULT_CACHE_PATH = os.path.join(disk_cache.CACHE_DIR, "op_costs.json")
_CHANNEL_KEYS = ("units", "filters", "output_dim")
_GATHERS = ("Embedding",)  # read only the looked-up rows of their weights
# An op whose whole roofline estimate (forward + backward) is under this
# is timed per shard; a bigger one by its representative.
SMALL_OP_MS = 2.0
# About how long one training run of a representative takes (the batch
# is cut down to it); also the per-function budget of timed repeats is
# three times this.
MAX_RUN_MS = 10.0
# ... but moves at least this many bytes (the roofline's count), past
# the caches of a CPU core.
MIN_REPRESENTATIVE_BYTES = 32 * 2**20
_REPRESENTATIVE = "representative"
# A recurrent layer's representative (two batches: `_at_samples`); its
# own tag, so that one timed on one batch by an older version is not read
# as one.
_REPRESENTATIVE_TWO = "representative on two batches"
# Tags a shard's entry: timed net of the function call (`measure_op_ms`);
# entries timed with it, by older versions, are not reused.
_SHARD = "shard net of the call"


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
        repeats: Timed runs at most; the median is kept. Fewer once the
            timed runs of a function took `3 * max_run_ms`.
        max_run_ms: Target time of one training run of a big op's
            representative (module docstring).
        min_bytes: The least a representative moves (roofline bytes).
        per_shard: Time every shard of every op (slow on big models);
            by default only small ops are.
    """

    def __init__(
        self,
        machine: MachineModel | None = None,
        mode: str | None = None,
        cache_path: str | None = None,
        warmup: int = 1,
        repeats: int = 5,
        max_run_ms: float = MAX_RUN_MS,
        min_bytes: float = MIN_REPRESENTATIVE_BYTES,
        per_shard: bool = False,
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
        self.max_run_ms, self.per_shard = max_run_ms, per_shard
        self.min_bytes = min_bytes
        self.num_measured = 0  # shards or representatives timed (tests)
        self.measure_s = 0.0  # seconds spent timing them (benches)
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
            if not op.has_backward:  # timed, it would be noise
                hit = (hit[0], 0.0)
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
        # A big op's configs all scale its representative (not a shard
        # timed by an older version, which would mix the two ways).
        if not self.per_shard and not is_small(op, spec):
            rep = self._representative(op, spec)
            if rep is not None:
                return scaled_ms(op, config, spec, rep)
        key = cache_key(op, config, spec.kind)
        disk = self._load()
        roofline = analytic_op_ms(op, config, spec)
        if key not in disk:
            measured = self._timed(
                op, spec, lambda: measure_op_ms(
                    op, config, self.warmup, self.repeats, self.max_run_ms
                ),
            )
            if measured is None:  # costed by the roofline instead
                self.fallbacks.append((op.name, config, self._error))
                return roofline
            disk[key] = list(measured)
            self._save()
        # Why the floor: net of the call, a tiny shard's time is noise
        # around 0; no kernel runs faster than the roofline says.
        forward_ms, backward_ms = disk[key]
        return (max(float(forward_ms), roofline[0]),
                max(float(backward_ms), roofline[1]))

    def _representative(
        self, op: Op, spec: DeviceSpec
    ) -> list[float] | None:
        """`measure_representative`'s list for `op` (disk-cached; measured
        on a miss); None when it cannot run."""
        key = representative_key(op, spec.kind)
        disk = self._load()
        if key not in disk:
            measured = self._timed(
                op, spec, lambda: measure_representative(
                    op, spec, self.warmup, self.repeats, self.max_run_ms,
                    self.min_bytes,
                ),
            )
            if measured is None:
                self.fallbacks.append(
                    (op.name, whole_config(op), self._error)
                )
                return None
            disk[key] = list(measured)
            self._save()
        return disk[key]

    def _timed(self, op: Op, spec: DeviceSpec, measure: Any) -> Any:
        """`measure()`, counted; None (the error kept) when it fails on
        a machine model, where the roofline can stand in."""
        start = time.perf_counter()
        try:
            found = measure()
        except Exception as error:  # any op the shard breaks
            if self.machine is None:
                raise
            # Why: a shard shape some layer cannot run (e.g. a split
            # it does not support) must not stop the search; the
            # roofline still ranks the config. Not cached on disk.
            self._error = repr(error)
            return None
        finally:
            self.measure_s += time.perf_counter() - start
        self.num_measured += 1
        return found

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
    ins, out = shard_shapes(op, config)
    return _roofline_ms(
        op, ins, out, partition.parameter_degree(op, config),
        (1, config.num_parts), spec,
    )


def _roofline_ms(
    op: Op,
    ins: tuple[tuple[int, ...], ...],
    out: tuple[int, ...],
    degree: int,
    share: tuple[int, int],
    spec: DeviceSpec,
) -> tuple[float, float]:
    """`analytic_op_ms` of a part reading `ins`, writing `out`, holding
    the weights of parameter degree `degree` and the fraction `share`
    (numerator, denominator) of the FLOPs."""
    return _work_ms(_work(op, ins, out, degree, share), spec)


def _work(
    op: Op,
    ins: tuple[tuple[int, ...], ...],
    out: tuple[int, ...],
    degree: int,
    share: tuple[int, int],
) -> tuple[float, float, float, int]:
    """(forward FLOPs, backward FLOPs, bytes moved, kernels) of a part
    (`_roofline_ms`'s arguments)."""
    itemsize = np.dtype(op.dtype).itemsize
    sharded, replicated = partition.weight_split(op, degree)
    frozen = partition.frozen_weight_bytes(op, degree)
    moved = itemsize * (sum(map(math.prod, ins)) + math.prod(out))
    if op.type in _GATHERS:
        moved += itemsize * math.prod(out)  # only the rows looked up
    else:
        moved += sharded + replicated + frozen
    num, den = share
    flops = op_specs.part_flops(op, ins, out)
    if flops is None:  # an even share of the whole's
        flops = (op.forward_flops * num / den, op.backward_flops * num / den)
    return _with_backward(op, flops, moved, 2 if op.weights else 1)


def _with_backward(
    op: Op, flops: Any, moved: float, kernels: int
) -> tuple[float, float, float, int]:
    """`_work`'s figures less the gradients the step does not compute
    (`Op.gradient_inputs`, frozen weights). The backward of an op with
    weights is two kernels, the float inputs' gradient and the
    weights', of about equal work: a first layer, or the first
    trainable one after a frozen base, does one of them; an op of a
    frozen base none (0 kernels: `_work_ms` prices no backward)."""
    floats = [k for k in range(len(op.inputs))
              if "int" not in _input_dtype(op, k)]
    could = bool(floats) + bool(op.weights)
    does = (any(op.input_needs_gradient(k) for k in floats)
            + op.trains_weights)
    if does == could or not could:
        return (*flops, moved, kernels)
    return (flops[0], flops[1] * does / could, moved, does)


def _work_ms(work: Any, spec: DeviceSpec) -> tuple[float, float]:
    """Roofline ms (forward, backward) of `_work`'s figures on `spec`."""
    forward_flops, backward_flops, moved, kernels = work
    per_ms_bytes = spec.memory_gbps * 1e6
    per_ms_flops = spec.peak_flops / 1e3
    forward = max(forward_flops / per_ms_flops, moved / per_ms_bytes)
    if not kernels:  # no gradient computed (`Op.has_backward`)
        return forward + spec.launch_overhead_ms, 0.0
    backward = max(backward_flops / per_ms_flops, 2 * moved / per_ms_bytes)
    return (forward + spec.launch_overhead_ms,
            backward + kernels * spec.launch_overhead_ms)


def whole_config(op: Op) -> ParallelConfig:
    """The unsplit config of `op`."""
    return ParallelConfig((1,) * len(op.output_shape), (0,))


def is_small(op: Op, spec: DeviceSpec) -> bool:
    """Whether `op` is timed per shard: its whole roofline estimate
    (forward + backward) is under `SMALL_OP_MS`."""
    return sum(analytic_op_ms(op, whole_config(op), spec)) < SMALL_OP_MS


def _batched(op: Op) -> bool:
    """Whether every input and output leads with one batch (graph shapes
    include it first), so a representative may cut it down."""
    shapes = list(op.input_shapes) + list(op.output_shapes)
    return bool(shapes) and all(
        len(s) > 0 and s[0] == shapes[0][0] for s in shapes
    )


def _representative_shapes(
    op: Op, batch: int | None
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """(input shapes, output shape) of `op` whole on `batch` samples."""
    ins, out = shard_shapes(op, whole_config(op))
    if batch is None or not _batched(op):
        return ins, out
    return (tuple((batch,) + tuple(s[1:]) for s in ins),
            (batch,) + tuple(out[1:]))


def representative_work(
    op: Op, batch: int | None
) -> tuple[float, float, float, int]:
    """The roofline's work (`_work`) of `op` whole on `batch` samples."""
    ins, out = _representative_shapes(op, batch)
    whole = op.output_shape[0] if _batched(op) else None
    share = (batch, whole) if whole and batch else (1, 1)
    return _work(op, ins, out, 1, share)


def scaled_ms(
    op: Op,
    config: ParallelConfig,
    spec: DeviceSpec,
    representative: Any,
) -> tuple[float, float]:
    """A config's part timed as a representative (`[batch, forward ms,
    backward ms, *its roofline work]`, a recurrent layer's followed by
    `[batch, forward ms, backward ms]` on a second batch) times the
    roofline's ratio of the part to the representative; a recurrent
    layer's is first taken to the part's samples (`_at_samples`)."""
    batch, forward_ms, backward_ms, *work = representative
    work, second = work[:4], work[4:]
    part = analytic_op_ms(op, config, spec)
    if second:
        samples = shard_shapes(op, config)[1][0]
        forward_ms, backward_ms = _at_samples(
            (batch, forward_ms, backward_ms), second, samples)
        work = representative_work(op, samples)
    reference = _work_ms(work, spec)
    return (forward_ms * part[0] / reference[0],
            backward_ms * part[1] / reference[1] if reference[1] else 0.0)


def _at_samples(
    first: Any, second: Any, samples: int
) -> tuple[float, float]:
    """(forward ms, backward ms) of the whole op on `samples` samples,
    linear in the batch through two timed `(batch, forward ms, backward
    ms)`; never under the first's time (more samples), or under it
    scaled in proportion (fewer): a slope noise made negative."""
    (b1, *t1), (b2, *t2) = first, second
    return tuple(
        max(y1 + (y2 - y1) * (samples - b1) / (b2 - b1),
            y1 * min(samples / b1, 1.0))
        for y1, y2 in zip(t1, t2)
    )


def _is_recurrent(op: Op) -> bool:
    """Whether `op` runs a recurrent loop over a batched input: its
    representative is timed on two batches."""
    return op.layer is not None and recurrent(op.layer) and _batched(op)


def representative_key(op: Op, device_kind: str) -> str:
    """Disk-cache key of `op`'s representative: op signature, whole
    shapes less the batch (which the measurement picks), dtype, device
    kind. Ops without weights or with per-channel ones only (elementwise,
    pooling, resizing, normalization) run alike per byte whatever their
    shapes: their key keeps only the ranks, so one representative serves
    every call of a layer config."""
    ins, out = shard_shapes(op, whole_config(op))
    if all(len(w.shape) <= 1 for w in op.weights):
        ins = tuple(len(s) for s in ins)
        out = len(out)
    elif _batched(op):
        ins = tuple(("*",) + tuple(s[1:]) for s in ins)
        out = ("*",) + tuple(out[1:])
    tag = _REPRESENTATIVE_TWO if _is_recurrent(op) else _REPRESENTATIVE
    return json.dumps(
        [tag, op.type, _signature(op, 1), ins, out, op.dtype, device_kind,
         *_gradient_tag(op)],
        sort_keys=True, default=str,
    )


def cache_key(op: Op, config: ParallelConfig, device_kind: str) -> str:
    """Disk-cache key: op signature, shard shapes, dtype, device kind."""
    ins, out = shard_shapes(op, config)
    degree = partition.parameter_degree(op, config)
    signature = _signature(op, degree)
    return json.dumps(
        [_SHARD, op.type, signature, ins, out, op.dtype, device_kind,
         *_gradient_tag(op)],
        sort_keys=True, default=str,
    )


def _gradient_tag(op: Op) -> tuple:
    """What a cache key adds for an op some of whose inputs get no
    gradient (`Op.gradient_inputs`): which inputs do, by distinct
    tensor (`_unique_inputs`'s order). Nothing where all do, so keys of
    such ops stay as older versions wrote them."""
    wanted = _gradient_wanted(op)
    return () if all(wanted) else (["input gradients", wanted],)


def _gradient_wanted(op: Op) -> list[bool]:
    """Per distinct input tensor of `op` (`_unique_inputs`'s order),
    whether the step computes its gradient."""
    wanted: dict[str, bool] = {}
    for k, name in enumerate(op.inputs):
        wanted[name] = wanted.get(name, False) or op.input_needs_gradient(k)
    return list(wanted.values())


def _signature(op: Op, degree: int) -> Any:
    """The layer config without its name, channels divided by `degree`,
    and the digest of the code of a class of the user's (a layer of the
    same name and config in another script, or edited, runs other
    code)."""
    get_config = getattr(op.layer, "get_config", None)
    if get_config is None:
        return None
    try:
        config = dict(get_config())
    except (NotImplementedError, TypeError):
        return None
    config.pop("name", None)
    code = code_digest.class_digest(type(op.layer))
    if code is not None:
        config["code digest"] = code
    for key in _CHANNEL_KEYS:
        if key in config and degree > 1:
            config[key] = config[key] // degree
    return config


def measure_op_ms(
    op: Op,
    config: ParallelConfig,
    warmup: int,
    repeats: int,
    max_run_ms: float = float("inf"),
) -> tuple[float, float]:
    """Times forward and forward+backward of part 0; returns ms each.

    The forward is net of calling a function (`_call_ms`): a small op's
    own function costs more to call (0.3 to 1 ms on a CPU) than its
    work, while in the step the runtime compiles every op is one
    kernel among many; left in, it priced a strategy of many small
    parts far above what it ran in (a Transformer's data parallelism at
    35 ms a step that ran in 13 to 18). Backward is the difference of
    forward+backward and forward, in which the call cancels out. Both
    floored at 0; `CostModel` floors them at the roofline. Runs on the
    first attached device: all devices of a live machine are of one
    kind.
    """
    _check_layer(op)
    ins, _ = shard_shapes(op, config)
    layer_degree = partition.parameter_degree(op, config)
    with _on_first_device() as tf:
        values = _random_inputs(tf, op, ins)
        forward, train = _shard_steps(tf, op, layer_degree, ins, values)
        forward_ms = _median_ms(
            lambda: forward(*values), warmup, repeats, 3 * max_run_ms
        )
        train_ms = _median_ms(
            lambda: train(*values), warmup, repeats, 3 * max_run_ms
        )
        call_ms = _call_ms(tf, values, warmup, repeats)
    return (max(forward_ms - call_ms, 0.0),
            max(train_ms - forward_ms, 0.0))


_EMPTY_STEPS: dict[Any, Any] = {}


def _call_ms(tf: Any, values: list, warmup: int, repeats: int) -> float:
    """Median ms of calling a function shaped like `_step_functions`'s
    (a flag and `values`, the branch on the flag) that does nothing
    else: what timing an op in its own function adds. Traced once per
    ranks and dtypes; timed afresh, under the load the op ran under."""
    key = tuple((len(v.shape), v.dtype.name) for v in values)
    empty = _EMPTY_STEPS.get(key)
    if empty is None:
        signature = [tf.TensorSpec((), tf.bool)] + [
            tf.TensorSpec((None,) * rank, dtype) for rank, dtype in key
        ]

        @tf.function(input_signature=signature)
        def empty(backward: Any, *inputs: Any) -> Any:
            return tf.cond(backward, lambda: tf.constant(1.0),
                           lambda: tf.constant(0.0))

        _EMPTY_STEPS[key] = empty
    flag = tf.constant(False)
    return _median_ms(lambda: empty(flag, *values), warmup + 1, repeats)


def measure_representative(
    op: Op,
    spec: DeviceSpec,
    warmup: int,
    repeats: int,
    max_run_ms: float,
    min_bytes: float = 0.0,
) -> list[float]:
    """`[batch, forward ms, backward ms, *roofline work]` of `op` whole,
    on a batch cut down so that one training run takes about
    `max_run_ms`, but moves at least `min_bytes` (the roofline's bytes:
    smaller tensors stay in the CPU's caches, where a sample costs up to
    half what it costs in a big batch) where a run takes at most 4
    times `max_run_ms`. The work (`representative_work`) is what
    `scaled_ms` divides by.

    The step function, traced once, takes any batch: the batch starts
    at the roofline's guess and is corrected once by a timed training
    run. An op without a leading batch everywhere is timed whole.
    `warmup` is unused: the first calls warm up. Each time is the least
    of a few runs (`_least_ms`).
    """
    _check_layer(op)
    ins, out = shard_shapes(op, whole_config(op))
    whole = out[0] if _batched(op) else None

    def clamp(batch: float) -> int:
        return max(1, min(whole, int(batch)))

    def inputs(batch: int | None) -> list:
        return _random_inputs(tf, op, _representative_shapes(op, batch)[0])

    with _on_first_device() as tf:
        forward, train = _step_functions(
            tf, op, op.layer, ins, whole is not None
        )
        batch = floor = whole
        if whole is not None:
            work = representative_work(op, whole)
            floor = clamp(math.ceil(whole * min_bytes / max(work[2], 1)))
            guess = sum(_work_ms(work, spec)) / whole  # ms a sample
            batch = clamp(max(
                max_run_ms / max(guess, 1e-9),
                min(floor, 4 * max_run_ms / max(guess, 1e-9)),
            ))
        values = inputs(batch)
        _run(forward, values)  # traces (and builds the layer)
        _run(train, values)  # the first run of the backward
        trains = [_run(train, values)]
        if whole is not None:
            # The byte floor, up to 4 times the target time.
            per_sample = trains[0] / batch
            better = clamp(max(
                max_run_ms / max(per_sample, 1e-9),
                min(floor, 4 * max_run_ms / max(per_sample, 1e-9)),
            ))
            if not batch / 1.5 < better < batch * 1.5:
                batch, trains = better, []
                values = inputs(batch)
                _run(forward, values)
                _run(train, values)
        budget = 3 * max_run_ms
        forward_ms = _least_ms(lambda: forward(*values), repeats, budget)
        train_ms = _least_ms(
            lambda: train(*values), repeats, budget, trains
        )
        found = [batch or 1, forward_ms, max(train_ms - forward_ms, 0.0),
                 *representative_work(op, batch)]
        other = _second_batch(batch, whole) if _is_recurrent(op) else None
        if other is not None:
            values = inputs(other)
            _run(train, values)  # this batch's first run
            forward_ms = _least_ms(lambda: forward(*values), repeats, budget)
            train_ms = _least_ms(lambda: train(*values), repeats, budget)
            found += [other, forward_ms, max(train_ms - forward_ms, 0.0)]
    return found


def _second_batch(batch: int, whole: int) -> int | None:
    """The batch a recurrent layer's representative is timed on again:
    four times `batch`, at most the whole, else a quarter of it; None
    where `batch` is 1 and the whole."""
    other = min(4 * batch, whole)
    if other == batch:
        other = max(1, batch // 4)
    return None if other == batch else other


def _check_layer(op: Op) -> None:
    if op.layer is None or op.arguments is None:
        raise ValueError(
            f"Op '{op.name}' has no Keras layer to measure; build the "
            "graph with `build_graph(model, batch)` or use the analytic "
            "cost model. Received: layer=None"
        )


class _on_first_device:
    """`with _on_first_device() as tf:` on the first attached device,
    Keras's warnings silenced (a shard is not the user's layer, e.g. a
    1-unit softmax Dense: its warnings would only confuse the user)."""

    def __enter__(self) -> Any:
        import tensorflow as tf

        from flexflow_keras import devices

        self._device = tf.device(devices.device_names()[0])
        self._warnings = notices.ignoring()
        self._device.__enter__()
        self._warnings.__enter__()
        return tf

    def __exit__(self, *exc: Any) -> None:
        self._warnings.__exit__(*exc)
        self._device.__exit__(*exc)


def _unique_inputs(op: Op, ins: Any) -> list[tuple[str, Any, str]]:
    """(tensor name, shape, dtype) of each distinct input of `op`."""
    found: dict[str, tuple[str, Any, str]] = {}
    for k, (name, shape) in enumerate(zip(op.inputs, ins)):
        found.setdefault(name, (name, shape, _input_dtype(op, k)))
    return list(found.values())


def _random_inputs(tf: Any, op: Op, ins: Any) -> list:
    return [_random_input(tf, tuple(shape), dtype)
            for _, shape, dtype in _unique_inputs(op, ins)]


def _run(fn: Any, values: list) -> float:
    start = time.perf_counter()
    fn(*values).numpy()  # .numpy() waits for the device
    return (time.perf_counter() - start) * 1e3


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
    shard = type(layer).from_config(config)
    shard.trainable = layer.trainable  # a frozen layer's has no gradient
    return shard


# (op type, layer config (or op name), parameter degree, each input's
# dims beyond the batch and dtype) -> (the layer traced, what backed
# its weights then, `_step_functions` of its shard for any batch).
_SHARD_STEPS: dict[tuple, tuple[Any, tuple, tuple[Any, Any]]] = {}
# Each holds its layer and graphs alive: a process that plans many
# models keeps the newest.
_SHARD_STEPS_KEPT = 256


def _shard_steps(
    tf: Any, op: Op, degree: int, ins: Any, values: list
) -> tuple[Any, Any]:
    """`_step_functions` of `op`'s shard of parameter degree `degree`,
    one trace for every batch size.

    Why: a trace (Keras's call, its gradient, Grappler) costs more than
    the timed runs of a small op, and a search times each op at each
    batch degree, and again for each batch size a plan is made for:
    keras.io-sized models spent 60% of their measuring in traces
    (a 30-op TCN: 46 traces, 5.9 of 10.6 s, first compile 19.6 s).
    The runs are timed on shapes as before; only the trace is shared.
    A layer whose call needs its batch as a number is traced on the
    batch it runs (the first run below fails on an unknown one).
    Keyed as the disk cache keys what it measures (`cache_key`: the
    layer's type and config, the shard's shapes) less the batch, so
    layers alike share one trace, as they share one measurement (a
    TCN's sixteen `Conv1D(16, 1)`); a layer without a config by its
    op's name, checked against its layer (a name reused by another
    model). A trace is used while the variables it captured still
    back its layer's weights (`_backing`): one of weights since
    replaced would time variables the layer no longer holds."""
    signature = _signature(op, degree)
    key = (op.type, json.dumps(signature, sort_keys=True, default=str)
           if signature is not None else ("op", op.name), degree,
           tuple((tuple(shape[1:]), dtype)
                 for _, shape, dtype in _unique_inputs(op, ins)),
           tuple(_gradient_wanted(op)))
    found = _SHARD_STEPS.get(key)
    if found is not None:
        layer, backing, steps = found
        if (signature is not None or layer is op.layer) \
                and _backing(layer) == backing:
            return steps
    layer = _shard_layer(op, degree)
    steps = _step_functions(tf, op, layer, ins, batched=True)
    try:
        steps[0](*values).numpy()
    except Exception:  # noqa: BLE001 - traced on its own batch below
        return _step_functions(tf, op, layer, ins, batched=False)
    if len(_SHARD_STEPS) >= _SHARD_STEPS_KEPT:  # the oldest goes
        del _SHARD_STEPS[next(iter(_SHARD_STEPS))]
    _SHARD_STEPS[key] = (layer, _backing(layer), steps)
    return steps


def _backing(layer: Any) -> tuple:
    """What holds each of `layer`'s weights now (a Keras variable's
    backend variable)."""
    return tuple(id(getattr(w, "_value", w))
                 for w in getattr(layer, "weights", ()))


def _step_functions(
    tf: Any, op: Op, layer: Any, ins: Any, batched: bool
) -> tuple[Any, Any]:
    """forward(*inputs) and train(*inputs) of `layer` called as `op`,
    one per distinct input tensor; `batched`: any leading batch."""
    from flexflow_keras.keras_graph import fill_arguments

    inputs = _unique_inputs(op, ins)
    signature = [
        tf.TensorSpec((None,) + tuple(shape[1:]) if batched
                      else tuple(shape), dtype)
        for _, shape, dtype in inputs
    ]
    names = [name for name, _, _ in inputs]
    wanted = _gradient_wanted(op)

    def total(y: Any) -> Any:
        leaves = [t for t in tf.nest.flatten(y) if t.dtype.is_floating]
        return tf.add_n([tf.reduce_sum(t) for t in leaves])

    def call(values: tuple) -> Any:
        args, kwargs = fill_arguments(op, dict(zip(names, values)))
        return layer(*args, **kwargs)

    @tf.function(input_signature=[tf.TensorSpec((), tf.bool)] + signature)
    def step(backward: Any, *values: Any) -> Any:
        # Only the inputs whose gradient the model's step computes.
        floats = [v for v, w in zip(values, wanted)
                  if w and v.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(floats)
            loss = total(call(values))
        weights = list(getattr(layer, "trainable_variables", []))

        def gradients() -> Any:
            grads = tape.gradient(loss, floats + weights)
            return tf.add_n(
                [tf.reduce_sum(g) for g in grads if g is not None] + [loss]
            )

        return tf.cond(backward, gradients, lambda: loss)

    # Why one function: a trace (Keras's call, the gradient, Grappler)
    # costs more than the runs of a small op; the branch not taken
    # does not run.
    with_backward, without = tf.constant(True), tf.constant(False)
    return (lambda *v: step(without, *v)), (lambda *v: step(with_backward, *v))


def _least_ms(
    fn: Any, repeats: int, budget_ms: float, times: list[float] = ()
) -> float:
    """The least of up to `repeats` timed runs (`times` taken already;
    one more at least), fewer once they took `budget_ms`. Why the least:
    a representative gets few runs on a host shared with other work,
    whose noise only adds time; a median of 2 or 3 runs followed it
    (a backward below its forward, floored at 0, was seen)."""
    times, fresh = list(times), 0
    while fresh < 1 or (len(times) < repeats and sum(times) < budget_ms):
        fresh += 1
        start = time.perf_counter()
        fn().numpy()  # .numpy() waits for the device
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def _median_ms(
    fn: Any, warmup: int, repeats: int, budget_ms: float = float("inf")
) -> float:
    """Median of up to `repeats` timed runs after `warmup` untimed ones
    (a first call also traces); fewer once the timed runs took
    `budget_ms` (at least one)."""
    for _ in range(warmup):
        fn().numpy()
    times: list[float] = []
    while len(times) < repeats and sum(times) < budget_ms:
        start = time.perf_counter()
        fn().numpy()  # .numpy() waits for the device
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
