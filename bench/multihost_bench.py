"""Samples/s of one training script as 2 hosts x 2 devices against one
process with 4 devices, on this machine.

    python bench/multihost_bench.py [--epochs 5] [--batch-size 256]
        [--steps 20] [--budget B]

Runs itself as the training script: alone with `--cpu-devices 4`, then
under `python -m flexflow_keras.launch --hosts 2 --devices-per-host 2`
(DTensor multi-client mode over loopback). The model is an MLP
(784 -> 1024 -> 1024 -> 10, SGD) on synthetic data; each run reports
the samples/s of its epochs after the first (which traces the step),
and both runs' final losses, which must agree. Data parallelism by
default (`--budget 0`): with a search, each run plans for its own
machine (the two clients price the link between them) and may train
under another strategy. On one machine the two
hosts share its cores and talk over gRPC, so this measures what
multi-client costs, not what a cluster gains.
"""

import argparse
import os
import re
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def worker(args) -> None:
    import numpy as np

    import flexflow_keras as keras

    class Rate(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.starts, self.ends = [], []

        def on_epoch_begin(self, epoch, logs=None):
            self.starts.append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            self.ends.append(time.perf_counter())

    keras.utils.set_random_seed(0)  # the same initial weights in both
    rng = np.random.default_rng(0)
    samples = args.batch_size * args.steps
    x = rng.normal(size=(samples, 784)).astype("float32")
    y = rng.integers(0, 10, size=(samples,))
    inputs = keras.Input(shape=(784,))
    h = keras.layers.Dense(1024, activation="relu")(inputs)
    h = keras.layers.Dense(1024, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rate = Rate()
    history = model.fit(x, y, batch_size=args.batch_size,
                        epochs=args.epochs, shuffle=False, verbose=0,
                        callbacks=[rate])
    seconds = sum(e - s for s, e in zip(rate.starts[1:], rate.ends[1:]))
    per_s = samples * (args.epochs - 1) / seconds
    print(f"RESULT samples_per_s={per_s:.1f} "
          f"final_loss={history.history['loss'][-1]:.6f}", flush=True)


def _run(command) -> tuple[float, float]:
    done = subprocess.run(command, capture_output=True, text=True)
    found = re.findall(
        r"RESULT samples_per_s=([\d.]+) final_loss=([\d.]+)", done.stdout
    )
    if done.returncode != 0 or not found:
        raise SystemExit(f"run failed ({done.returncode}):\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return float(found[0][0]), float(found[0][1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20,
                        help="Steps per epoch.")
    args, rest = parser.parse_known_args()
    if args.worker:
        worker(args)
        return 0
    if args.epochs < 2:
        parser.error("--epochs must be >= 2 (the first traces the step).")
    if not any(a.split("=")[0] in ("--budget", "--search-budget")
               for a in rest):
        rest = [*rest, "--budget", "0"]
    own = ["--worker", "--epochs", str(args.epochs), "--batch-size",
           str(args.batch_size), "--steps", str(args.steps), *rest]
    start = time.perf_counter()
    alone, alone_loss = _run(
        [sys.executable, HERE, *own, "--cpu-devices", "4"]
    )
    hosts, hosts_loss = _run(
        [sys.executable, "-m", "flexflow_keras.launch", "--hosts", "2",
         "--devices-per-host", "2", HERE, *own]
    )
    print(f"MLP 784-1024-1024-10, batch {args.batch_size}, "
          f"{args.steps} steps/epoch, epochs 2-{args.epochs} timed "
          f"({time.perf_counter() - start:.0f} s in all):")
    print(f"  1 process x 4 devices: {alone:9.1f} samples/s  "
          f"final loss {alone_loss:.6f}")
    print(f"  2 hosts x 2 devices:   {hosts:9.1f} samples/s  "
          f"final loss {hosts_loss:.6f}  ({hosts / alone:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
