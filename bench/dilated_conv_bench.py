"""What a dilated convolution costs under a strategy.

DTensor has no rule for TensorFlow's `SpaceToBatchND`, which a dilated
convolution emits; the runtime runs it as phases beside the batch
(`op_rules.dilated_as_phases`). This prints the median step time of a
one-Conv2D model under data parallelism that way, with the kernel's
holes written in as zeros instead (what the runtime did before
2026-11-30: the kernel grows to `(taps - 1) * rate + 1` a side), and
plain Keras's, for several rates.

    python bench/dilated_conv_bench.py [--batch 32] [--rates 1 2 6 12]
"""

import argparse
import time
from unittest import mock

import numpy as np
import tensorflow as tf

import flexflow_keras as fk
import keras
from flexflow_keras.runtime import op_rules


def zero_filled(convolution, arguments, rates, kernel):
    """The dilated convolution as an undilated one whose kernel has
    `rate - 1` zeros between taps (spatial dims first, as Keras keeps
    kernels)."""
    weights = arguments[kernel]
    for axis, rate in enumerate(rates):
        shape = weights.shape.as_list()
        padding = [[0, 0]] * (len(shape) + 1)
        padding[axis + 1] = [0, rate - 1]
        spread = tf.pad(tf.expand_dims(weights, axis + 1), padding)
        weights = tf.reshape(
            spread, shape[:axis] + [shape[axis] * rate] + shape[axis + 1:]
        )[(slice(None),) * axis + (slice(0, (shape[axis] - 1) * rate + 1),)]
    return convolution(**dict(arguments, **{kernel: weights},
                              dilation_rate=1))


class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)


def step_ms(mod, rate, args):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    shape = (args.size, args.size, args.channels)
    x = rng.random((args.batch * args.steps,) + shape, dtype=np.float32)
    y = rng.random((args.batch * args.steps, 4), dtype=np.float32)
    inputs = mod.Input(shape)
    h = mod.layers.Conv2D(args.channels, 3, dilation_rate=rate,
                          padding="same")(inputs)
    h = mod.layers.GlobalAveragePooling2D()(h)
    model = mod.Model(inputs, mod.layers.Dense(4)(h))
    options = {} if mod is keras else {"search_budget": 0}
    model.compile(optimizer="sgd", loss="mse", **options)
    model.fit(x, y, batch_size=args.batch, verbose=0)  # traces
    timer = Timer()
    timer.times = []
    model.fit(x, y, batch_size=args.batch, verbose=0, callbacks=[timer])
    return 1000 * float(np.median(timer.times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rates", type=int, nargs="+", default=[1, 2, 6, 12])
    args = parser.parse_args()
    print(f"Conv2D({args.channels}, 3, padding='same') on "
          f"{args.size}x{args.size}x{args.channels}, batch {args.batch}, "
          f"data parallelism on {len(fk.devices.device_names())} devices; "
          f"median step ms:")
    print(f"  {'rate':>4}  {'phases':>8}  {'zeros':>8}  {'plain Keras':>11}")
    for rate in args.rates:
        phases = step_ms(fk, rate, args)
        with mock.patch.object(op_rules, "dilated_as_phases", zero_filled):
            zeros = step_ms(fk, rate, args)
        plain = step_ms(keras, rate, args)
        print(f"  {rate:>4}  {phases:8.2f}  {zeros:8.2f}  {plain:11.2f}")


if __name__ == "__main__":
    main()
