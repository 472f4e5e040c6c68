"""Training throughput of the DTensor runtime against plain Keras `fit`.

For the MLP, CNN and Transformer of `tests/model_zoo.py`: samples/s of
plain Keras `fit` (one device), of flexflow_keras under data parallelism
on 1 device, and on all devices (4 virtual CPU devices without GPUs).
Epoch 0 (tracing) is left out; the median of the other epochs is used.

Usage:
    python bench/runtime_bench.py [--epochs 4] [--samples 2048]
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("FLEXFLOW_KERAS_CPU_DEVICES", "4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import flexflow_keras  # noqa: E402,F401  (devices first)
import keras  # noqa: E402
import numpy as np  # noqa: E402

import model_zoo  # noqa: E402
from flexflow_keras import devices, runtime  # noqa: E402
from flexflow_keras.graph import build_graph  # noqa: E402
from flexflow_keras.strategy import Strategy  # noqa: E402


class BenchModel(runtime.StrategyTrainer, keras.Model):
    pass


class _Timer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


MODELS = {
    "mlp": (
        lambda: model_zoo.mlp(input_dim=256, hidden=(512, 512), classes=10),
        lambda n, r: (r.random((n, 256), dtype=np.float32),
                      r.integers(0, 10, (n,))),
        64,
    ),
    "cnn": (
        lambda: model_zoo.cnn((32, 32, 3), (16, 32), 10, dropout_rate=0.0),
        lambda n, r: (r.random((n, 32, 32, 3), dtype=np.float32),
                      r.integers(0, 10, (n,))),
        64,
    ),
    "transformer": (
        lambda: model_zoo.transformer_block(seq=32, dim=64, heads=4),
        lambda n, r: (r.random((n, 32, 64), dtype=np.float32),
                      r.random((n, 32, 64), dtype=np.float32)),
        32,
    ),
}


def throughput(name, num_devices, epochs, samples):
    """Samples/s; num_devices=None means plain Keras."""
    builder, data, batch_size = MODELS[name]
    keras.utils.set_random_seed(0)
    base = builder()
    x, y = data(samples, np.random.default_rng(0))
    loss = ("mse" if name == "transformer" else
            keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if num_devices is None:
        model = base
    else:
        model = BenchModel(base._inputs_struct, base._outputs_struct)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    if num_devices is not None:
        graph = build_graph(model, batch_size)
        runtime.attach_strategy(
            model, graph, Strategy.data_parallel(graph, num_devices)
        )
    timer = _Timer()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
              callbacks=[timer], shuffle=False)
    return samples / statistics.median(timer.seconds[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--models", default="mlp,cnn,transformer")
    args = parser.parse_args()
    n = len(devices.device_names())
    print(f"devices: {n} x {devices.device_kind()}")
    print(f"{'model':<12} {'keras':>10} {'ff 1 dev':>10} {'ratio':>6} "
          f"{f'ff {n} dev':>10} {'ratio':>6}   (samples/s)")
    for name in args.models.split(","):
        keras_sps = throughput(name, None, args.epochs, args.samples)
        one = throughput(name, 1, args.epochs, args.samples)
        many = throughput(name, n, args.epochs, args.samples)
        print(f"{name:<12} {keras_sps:>10.0f} {one:>10.0f} "
              f"{one / keras_sps:>6.2f} {many:>10.0f} "
              f"{many / keras_sps:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
