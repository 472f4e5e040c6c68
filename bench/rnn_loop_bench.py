"""Steady step time and first step of a rolled recurrent loop under DTensor.

keras.io's IMDB Bidirectional LSTM at its own sizes (20,000 x 128
embedding, 200 steps, two Bidirectional LSTM(64), batch 32), data
parallel over `--devices` virtual CPU devices, `--batches` training
steps: prints the first step (from `fit`'s start) and the median and
mean of the others, each step waited for (DTensor runs asynchronously).
`--plain` runs the same on plain Keras. Each run is its own process.

Usage:
    python bench/rnn_loop_bench.py [--devices 2] [--batches 20] [--plain]
        [--repeats 2]
"""

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RUN = r'''
import sys, time
import numpy as np
plain, devices, batches = sys.argv[1] == "plain", int(sys.argv[2]), int(sys.argv[3])
if plain:
    import keras
else:
    import flexflow_keras as keras
    from flexflow_keras.strategy import Strategy
    from flexflow_keras.strategy_files import save_strategy
from keras import layers
from tensorflow.python.eager import context
ids = keras.Input(shape=(200,), dtype="int32")
h = layers.Embedding(20000, 128)(ids)
h = layers.Bidirectional(layers.LSTM(64, return_sequences=True))(h)
h = layers.Bidirectional(layers.LSTM(64))(h)
model = keras.Model(ids, layers.Dense(1, activation="sigmoid")(h))
rng = np.random.default_rng(0)
x = rng.integers(0, 20000, (32 * batches, 200)).astype("int32")
y = rng.integers(0, 2, (32 * batches,)).astype("float32")
options = {}
if not plain:
    from flexflow_keras.keras_graph import build_graph
    options["import_strategy"] = sys.argv[4]
    save_strategy(Strategy.data_parallel(build_graph(model, 32), devices),
                  sys.argv[4])
model.compile(optimizer="adam", loss="binary_crossentropy", **options)
ends = []
class Wait(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        context.async_wait()
        ends.append(time.time())
start = time.time()
model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[Wait()])
steps = np.diff(ends)
print(f"first step {ends[0] - start:.1f} s, then median "
      f"{np.median(steps) * 1000:.0f} ms, mean {np.mean(steps) * 1000:.0f} ms")
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH",
                                                              ""))
    if not args.plain:
        env["FLEXFLOW_KERAS_CPU_DEVICES"] = str(max(args.devices, 2))
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            result = subprocess.run(
                [sys.executable, "-c", _RUN,
                 "plain" if args.plain else "ours", str(args.devices),
                 str(args.batches), os.path.join(folder, "s.txt")],
                env=env, capture_output=True, text=True, check=False)
            lines = result.stdout.strip().splitlines()
            name = "plain Keras" if args.plain else (
                f"data parallel over {args.devices}")
            print(f"{name}: {lines[-1] if lines else result.stderr[-2000:]}",
                  flush=True)


if __name__ == "__main__":
    main()
