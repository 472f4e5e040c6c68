"""Training throughput side by side on the same devices.

For the MLP, CNN and Transformer of `bench/model_zoo.py`, samples/s of:
plain Keras `fit` on one device; `tf.distribute.MirroredStrategy` over
the attached devices; Keras on JAX with `keras.distribution.DataParallel`
over as many JAX CPU devices (only when `jax` is installed: `pip install
-e ".[bench]"`; run in a subprocess, as the backend is chosen at
import); flexflow_keras data parallelism; and the strategy flexflow_keras
searches for the attached devices (4 virtual CPU devices without GPUs).
Epoch 0 (tracing) is left out; the median of the other epochs is used.

Usage:
    python bench/runtime_bench.py [--epochs 4] [--samples 2048]
        [--models mlp,cnn,transformer] [--budget 200]
"""

import argparse
import contextlib
import functools
import importlib.util
import os
import statistics
import subprocess
import sys

os.environ.setdefault("FLEXFLOW_KERAS_CPU_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import flexflow_keras  # noqa: E402,F401  (devices first)
import keras  # noqa: E402
import numpy as np  # noqa: E402

from bench_models import MODELS, Timer, loss_of  # noqa: E402
from flexflow_keras import devices, runtime, search  # noqa: E402
from flexflow_keras.keras_graph import build_graph  # noqa: E402
from flexflow_keras.machine import live_machine  # noqa: E402
from flexflow_keras.simulator import Simulator  # noqa: E402
from flexflow_keras.strategy import Strategy  # noqa: E402


class BenchModel(runtime.StrategyTrainer, keras.Model):
    pass


def throughput(name, mode, epochs, samples, budget=200):
    """Samples/s of `mode`: "keras" (one device), "mirrored", "data
    parallel" (flexflow_keras) or "searched" (flexflow_keras)."""
    builder, data, batch_size = MODELS[name]
    keras.utils.set_random_seed(0)
    x, y = data(samples, np.random.default_rng(0))
    if mode == "mirrored":
        scope = _mirrored().scope()
    else:
        scope = contextlib.nullcontext()
    with scope:
        base = builder()
        model = base if mode in ("keras", "mirrored") else BenchModel(
            base._inputs_struct, base._outputs_struct
        )
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=loss_of(name))
    if mode in ("data parallel", "searched"):
        graph = build_graph(model, batch_size)
        n = len(devices.device_names())
        strategy = Strategy.data_parallel(graph, n)
        if mode == "searched":
            sim = Simulator(graph, live_machine(), optimizer_slots=2)
            strategy = search.search(graph, sim, n, budget=budget,
                                     verbose=0).strategy
        runtime.attach_strategy(model, graph, strategy)
    timer = Timer()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
              callbacks=[timer], shuffle=False)
    return samples / statistics.median(timer.seconds[1:])


@functools.lru_cache(maxsize=None)
def _mirrored():
    """One MirroredStrategy for the process: a second one reuses the first
    one's collective instance keys, and its all-reduce fails with a shape
    mismatch (measured, TF 2.21)."""
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(
        devices=list(devices.device_names())
    )


def jax_throughput(name, epochs, samples):
    """Samples/s of Keras on JAX with `DataParallel` over as many JAX CPU
    devices, in a subprocess (the backend is chosen at import); None
    when jax is not installed."""
    if importlib.util.find_spec("jax") is None:
        return None
    env = dict(
        os.environ, KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count="
        + str(len(devices.device_names())),
    )
    worker = os.path.join(os.path.dirname(__file__), "jax_dp_worker.py")
    done = subprocess.run(
        [sys.executable, worker, name, str(epochs), str(samples)],
        env=env, capture_output=True, text=True, check=True,
    )
    return float(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--budget", type=int, default=200)
    args = parser.parse_args()
    n = len(devices.device_names())
    print(f"devices: {n} x {devices.device_kind()}; samples/s, and "
          "relative to plain Keras on one device")
    modes = ("keras", "mirrored", "jax dp", "data parallel", "searched")
    print(f"{'model':<12}" + "".join(f"{m:>16}" for m in modes))
    for name in args.models.split(","):
        row = {}
        for mode in modes:
            if mode == "jax dp":
                row[mode] = jax_throughput(name, args.epochs, args.samples)
            else:
                row[mode] = throughput(name, mode, args.epochs,
                                       args.samples, args.budget)
        base = row["keras"]
        cells = [
            f"{'-':>16}" if v is None else f"{v:>9.0f} ({v / base:.2f})"
            for v in row.values()
        ]
        print(f"{name:<12}" + "".join(f"{c:>16}" for c in cells),
              flush=True)


if __name__ == "__main__":
    main()
