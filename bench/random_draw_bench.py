"""What drawing random values whole costs per step (issue 21).

Under a strategy, every stateless random draw (Dropout's mask, noise,
augmentation) is drawn at its global shape on every device so that it
equals plain Keras's (`runtime/op_rules.py`). This prints the step time
of a Dropout MLP under data parallelism with that rule and with DTensor's
own split draws (each device draws its shard only, other values), and
plain Keras's.

    python bench/random_draw_bench.py [--batch 256] [--width 1024]
"""

import argparse
import time
from unittest import mock

import numpy as np

import flexflow_keras as fk
import keras
from flexflow_keras.runtime import op_rules


def build(mod, width):
    inputs = mod.Input((width,))
    h = inputs
    for _ in range(3):
        h = mod.layers.Dense(width, activation="relu")(h)
        h = mod.layers.Dropout(0.5)(h)
    outputs = mod.layers.Dense(10)(h)
    model = mod.Model(inputs, outputs)
    options = {} if mod is keras else {"search_budget": 0}
    model.compile(optimizer="adam", loss="mse", **options)
    return model


class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)


def step_ms(mod, args):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, args.width)).astype("f4")
    y = rng.normal(size=(args.batch * args.steps, 10)).astype("f4")
    model = build(mod, args.width)
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)  # traces
    timer = Timer()
    timer.times = []
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0,
              callbacks=[timer])
    return 1000 * float(np.median(timer.times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    whole = step_ms(fk, args)
    with mock.patch.object(op_rules, "_draw_substitutes", lambda mesh: []):
        split = step_ms(fk, args)
    plain = step_ms(keras, args)
    print(f"Dropout MLP, 3 x Dense({args.width}) + Dropout, batch "
          f"{args.batch}, data parallelism on "
          f"{len(fk.devices.device_names())} devices; median step ms:")
    print(f"  draws whole on every device (equal to Keras): {whole:8.2f}")
    print(f"  DTensor's split draws (other values):         {split:8.2f}")
    print(f"  plain Keras, one device:                      {plain:8.2f}")
    print(f"  cost of equal draws: {whole - split:+.2f} ms a step "
          f"({100 * (whole - split) / split:+.1f}%)")


if __name__ == "__main__":
    main()
