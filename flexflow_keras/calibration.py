"""What the attached devices really cost, measured once and cached.

The simulator's picture of a preset is analytic; the attached devices
are what `fit()` then runs on, so the live machine model is measured
on them (like op costs, and cached on disk the same way):

- `compute_groups`: how many devices compute at once. Virtual CPU
  devices share the host's cores: a matmul split over N of them runs
  about as long as the whole matmul on one (TensorFlow's intra-op
  threads already use every core). Measured as the speed-up of a
  batch-split matmul on a DTensor mesh of all devices over the same
  matmul on one device.
- `link_gbps`, `link_latency_ms`: a transfer between devices, fitted to
  DTensor all-gathers (a batch-split tensor made replicated) of two
  sizes: the simulator moves each part over its own link, so the fit is
  per part.
- `copy_gbps`, `copy_latency_ms`: a region copied from a part on one
  mesh to a part on another, as the layer-by-layer executor moves a
  tensor between meshes (`runtime/moves.py`: the piece sliced on the
  device holding it, copied, joined on the reader's, all in one
  compiled function; plain TensorFlow ops, no DTensor collective).
  Fitted per piece to a tensor split by rows on half the devices moved
  to a split by columns on the other half, at two sizes. On virtual CPU
  devices such a copy is a memcpy, about 8-20x faster than the
  DTensor all-gather the link figures are fitted to (measured
  2026-11-29).
- `allreduce_gbps`, `allreduce_latency_ms`: a DTensor all-reduce (a sum
  over the split batch made replicated: a weight gradient under data
  parallelism), fitted the same way by the bytes of the result. DTensor
  on CPU does not reduce in a ring, so the simulator prices the live
  machine's all-reduce by this fit.
- `update_overhead_ms`, `update_gbps`: Keras's Adam applied to weights
  of two sizes on one device, fitted to `cost.update_ms`'s model (a fixed
  cost per weight shard plus the bytes moved).
- `call_overhead_ms`: one call of a compiled function on the mesh (a
  strategy over several meshes makes two per segment).
- `step_overhead_ms`: the fixed cost of one step: one DTensor function
  call on the mesh, the batch copied onto it, and Keras's loop around
  it (a plain Keras `fit` step of a one-weight model).

Imports TensorFlow only when measuring. `live_calibration()` is what
`machine.live_machine()` uses; `FLEXFLOW_KERAS_CALIBRATE=0` skips it
(nominal figures, as before).

In DTensor's multi-client mode the measurement runs in a process of its
own (`python -m flexflow_keras.calibration`, one client's devices, no
DTensor clients): a collective on a mesh only one client knows would
put that client's collective keys out of step with the others', and the
next collective they share would fail or hang.
"""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

from flexflow_keras import settings
from typing import Any

from flexflow_keras import disk_cache

DEFAULT_CACHE_PATH = os.path.join(disk_cache.CACHE_DIR, "live_machine.json")
_VERSION = 4  # bump when what is measured changes


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured figures of the attached devices (module docstring)."""

    compute_groups: int
    link_latency_ms: float
    link_gbps: float
    allreduce_latency_ms: float
    allreduce_gbps: float
    call_overhead_ms: float
    step_overhead_ms: float
    update_overhead_ms: float
    update_gbps: float
    copy_latency_ms: float
    copy_gbps: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Calibration":
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


def live_calibration(
    device_names: tuple[str, ...], cache_path: str | None = None
) -> Calibration | None:
    """The calibration of `device_names` (cached; measured on a miss).
    None for a single device or when turned off."""
    if len(device_names) < 2 or os.environ.get(
        "FLEXFLOW_KERAS_CALIBRATE", "1"
    ) == "0":
        return None
    import tensorflow as tf

    path = cache_path or DEFAULT_CACHE_PATH
    key = json.dumps([
        _VERSION, len(device_names), device_names[0].split(":")[-2],
        os.cpu_count(), tf.__version__,
    ])
    entries = disk_cache.read(path)
    if key in entries:
        return Calibration.from_json(entries[key])
    if settings.dtensor_clients() is not None:
        found = _measure_alone(len(device_names), device_names[0])
    else:
        found = measure(device_names)
    entries[key] = found.to_json()
    try:
        disk_cache.write(path, entries)
    except OSError:
        pass  # a read-only home: measure again next time
    return found


def measure(device_names: tuple[str, ...]) -> Calibration:
    """Measures the figures on the attached devices (a few seconds)."""
    from tensorflow.experimental import dtensor

    from flexflow_keras import devices

    devices.synchronous_dtensor()
    mesh = dtensor.create_mesh(
        [("x", len(device_names))], devices=list(device_names)
    )
    link, allreduce = _collective_fits(mesh, len(device_names))
    return Calibration(
        compute_groups=_compute_groups(mesh, device_names),
        link_latency_ms=link[0],
        link_gbps=link[1],
        allreduce_latency_ms=allreduce[0],
        allreduce_gbps=allreduce[1],
        call_overhead_ms=_call_ms(mesh),
        step_overhead_ms=_step_overhead_ms(mesh),
        **_update_fit(device_names[0]),
        **_copy_fit(device_names),
    )


def _median_ms(fn: Any, repeats: int = 15, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _compute_groups(mesh: Any, device_names: tuple[str, ...]) -> int:
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    n = len(device_names)
    rows, width = 256 * n, 512
    x = tf.random.uniform((rows, width))
    w = tf.random.uniform((width, width))

    @tf.function
    def chain(x, w):
        for _ in range(4):
            x = tf.tanh(tf.matmul(x, w) * 0.01)
        return tf.reduce_sum(x)

    # Few repeats: each call is a ~2 GFLOP matmul chain (tens of ms on
    # a CPU) and the figure is a ratio rounded to a whole count.
    with tf.device(device_names[0]):
        xs, ws = tf.identity(x), tf.identity(w)
        one = _median_ms(lambda: chain(xs, ws).numpy(), 5, 1)
    split = dtensor.Layout(["x", dtensor.UNSHARDED], mesh)
    xd = dtensor.relayout(
        dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, 2)), split
    )
    wd = dtensor.copy_to_mesh(w, dtensor.Layout.replicated(mesh, 2))
    many = _median_ms(
        lambda: dtensor.unpack(chain(xd, wd))[0].numpy(), 5, 1
    )
    return max(1, min(n, round(one / many)))


def _collective_fits(mesh: Any, n: int) -> tuple[tuple[float, float], ...]:
    """((latency ms, GB/s) per part of an all-gather, (latency ms, GB/s)
    of an all-reduce) over the mesh, each fitted to two sizes, less the
    cost of calling a function that moves nothing."""
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    replicated = dtensor.Layout.replicated(mesh, 2)
    split = dtensor.Layout(["x", dtensor.UNSHARDED], mesh)

    @tf.function
    def nothing(x):
        return x * 1.0

    @tf.function
    def gather(x):  # a batch-split tensor made whole on every device
        return dtensor.relayout(x * 1.0, replicated)

    @tf.function
    def reduce(x):  # per-device partial sums made one replicated sum
        return tf.reduce_sum(x * 1.0, axis=0, keepdims=True)

    def timed(fn, rows, num_bytes):
        x = tf.random.uniform((rows, max(num_bytes // (rows * 4), 1)))
        xd = dtensor.relayout(dtensor.copy_to_mesh(x, replicated), split)
        run = lambda f: _median_ms(  # noqa: E731
            lambda: dtensor.unpack(f(xd))[0].numpy()
        )
        return max(run(fn) - run(nothing), 0.0)

    # A gather moves 1/n of the tensor over each link; an all-reduce of
    # an (n, k) tensor sums n partial results of k elements each.
    return (_two_size_fit(lambda b: timed(gather, n * 64, b), 1 / n),
            _two_size_fit(lambda b: timed(reduce, n, b), 1 / n))


def _two_size_fit(ms_of: Any, scale: float = 1.0) -> tuple[float, float]:
    """(latency ms, GB/s) of a line through `ms_of(bytes)` at 64 KiB and
    4 MiB, per `scale` of those bytes (a part's share)."""
    small, large = 1 << 16, 1 << 22
    t_small, t_large = ms_of(small), ms_of(large)
    slope = max(t_large - t_small, 1e-6) / ((large - small) * scale)
    return max(t_small - small * scale * slope, 0.0), 1e-6 / slope


def _copy_fit(device_names: tuple[str, ...]) -> dict[str, float]:
    """(latency ms, GB/s) per piece of a move between two meshes as
    `runtime/moves.py` makes it (the module docstring): the tensor's row
    blocks on the first `h` devices, its column blocks wanted on the
    next `h`, so each reader joins `h` pieces of 1/h^2 of the tensor,
    each cut where it lies. Less a function returning its inputs.

    On two or three devices (`h` = 1) the one reader still takes two
    column blocks: a whole part copied to another virtual CPU device
    shares its buffer and costs nothing, which the runtime's cut pieces
    do not (measured: a fit of one whole piece gave 4e6 GB/s)."""
    import tensorflow as tf

    h = max(len(device_names) // 2, 1)
    sources, readers = device_names[:h], device_names[h:2 * h]
    blocks = max(h, 2)  # column blocks, block b read by reader b % h

    @tf.function
    def move(parts):
        joined = []
        for r, reader in enumerate(readers):
            pieces = []
            for device, part in zip(sources, parts):
                width = part.shape[1] // blocks
                with tf.device(device):
                    pieces += [part[:, b * width:(b + 1) * width]
                               for b in range(r, blocks, len(readers))]
            with tf.device(reader):
                joined.append(tf.concat(pieces, axis=0))
        return joined

    @tf.function
    def nothing(parts):
        return [part * 1.0 for part in parts]

    def piece_ms(piece_bytes):
        rows = 64
        width = max(piece_bytes // (rows * 4), 1) * blocks
        parts = []
        for device in sources:
            with tf.device(device):
                parts.append(tf.random.uniform((rows, width)))
        spent = _median_ms(lambda: [x.numpy() for x in move(parts)])
        base = _median_ms(lambda: [x.numpy() for x in nothing(parts)])
        return max(spent - base, 0.0)

    latency_ms, gbps = _two_size_fit(piece_ms)
    return {"copy_latency_ms": latency_ms, "copy_gbps": gbps}


def _call_ms(mesh: Any) -> float:
    """One call of a function that does nearly nothing on the mesh."""
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    x = dtensor.copy_to_mesh(
        tf.ones((mesh.size, 4)), dtensor.Layout.replicated(mesh, 2)
    )

    @tf.function
    def call(x):
        return x * 1.0

    return _median_ms(lambda: dtensor.unpack(call(x))[0].numpy())


def _step_overhead_ms(mesh: Any) -> float:
    """One DTensor call with a batch copied onto the mesh, plus a plain
    Keras `fit` step of a one-weight model (its loop around the call)."""
    import keras
    import numpy as np
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    replicated = dtensor.Layout.replicated(mesh, 2)
    batch = np.ones((mesh.size * 8, 4), "float32")

    @tf.function
    def call(x):
        return tf.reduce_sum(x)

    def one_call():  # as the runtime feeds a batch: one local copy each
        x = dtensor.pack([tf.constant(batch)] * mesh.size, replicated)
        return dtensor.unpack(call(x))[0].numpy()

    dtensor_ms = _median_ms(one_call)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    steps = 32
    x, y = np.ones((steps * 8, 4), "float32"), np.ones((steps * 8, 1))
    model.fit(x, y, batch_size=8, verbose=0)  # traces
    start = time.perf_counter()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    keras_ms = (time.perf_counter() - start) * 1e3 / (2 * steps)
    return dtensor_ms + keras_ms


def _update_fit(device: str) -> dict[str, float]:
    """Keras's Adam applied to weights of two sizes on one device, as
    `cost.update_ms` models it: a fixed cost per weight plus the bytes
    moved (weight, gradient and 2 slots read; weight and slots written)
    over a bandwidth."""
    import keras
    import tensorflow as tf

    count, slots = 8, 2

    def per_weight_ms(shape):
        with tf.device(device):
            weights = [keras.Variable(tf.ones(shape)) for _ in range(count)]
            optimizer = keras.optimizers.Adam()
            optimizer.build(weights)
            grads = [tf.ones(shape) * 0.1 for _ in range(count)]

            @tf.function
            def step(grads):
                optimizer.apply(grads, weights)
                return grads[0]

            @tf.function
            def nothing(grads):
                return grads[0] * 1.0

            spent = _median_ms(lambda: step(grads).numpy())
            base = _median_ms(lambda: nothing(grads).numpy())
        return max(spent - base, 0.0) / count

    small, large = (16,), (256, 512)
    t_small, t_large = per_weight_ms(small), per_weight_ms(large)
    moved = (3 + 2 * slots) * 4 * (256 * 512 - 16)
    gbps = moved / max(t_large - t_small, 1e-6) / 1e6
    return {"update_overhead_ms": t_small, "update_gbps": gbps}


def _measure_alone(count: int, first_device: str) -> Calibration:
    """`measure` in a fresh process on `count` devices of this host."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DTENSOR_")}
    if ":CPU:" in first_device:
        env[settings.ENV_PREFIX + "CPU_DEVICES"] = str(count)
    done = subprocess.run(
        [sys.executable, "-m", "flexflow_keras.calibration"],
        env=env, capture_output=True, text=True,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            "Measuring this host's devices in a process of its own failed "
            f"(status {done.returncode}): {done.stderr.strip()[-2000:]}. "
            "Set FLEXFLOW_KERAS_CALIBRATE=0 to use nominal figures."
        )
    return Calibration.from_json(json.loads(lines[-1]))


if __name__ == "__main__":
    # One host's calibration, as one JSON line (see `_measure_alone`).
    from flexflow_keras import devices

    names = devices.device_names()
    print(json.dumps(measure(names).to_json()))
