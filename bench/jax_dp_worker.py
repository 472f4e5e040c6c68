"""Samples/s of Keras on JAX with `keras.distribution.DataParallel`.

Run by `runtime_bench.py` in a subprocess with `KERAS_BACKEND=jax` and
`XLA_FLAGS=--xla_force_host_platform_device_count=N` (the backend and
the device count are fixed at import). Prints one number.

Usage: python bench/jax_dp_worker.py MODEL EPOCHS SAMPLES
"""

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from bench_models import MODELS, Timer, loss_of  # noqa: E402


def main(name, epochs, samples):
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices())
    )
    builder, data, batch_size = MODELS[name]
    keras.utils.set_random_seed(0)
    x, y = data(samples, np.random.default_rng(0))
    model = builder()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss_of(name))
    timer = Timer()
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
              callbacks=[timer], shuffle=False)
    print(samples / statistics.median(timer.seconds[1:]))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
