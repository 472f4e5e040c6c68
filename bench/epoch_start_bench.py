"""Time from one epoch's end to the next epoch's first step, plain Keras
against flexflow_keras (docs/RUNTIME.md, "The epoch-start wait").

Each run is a fresh process fitting Inception-v3 (`--small`: 75 x 75
images, 32 samples, batch 16, so 2 steps an epoch) for 4 epochs; a
callback times each epoch boundary in two parts: epoch end -> epoch
begin (Keras's and the runtime's callbacks, the metric reset) and epoch
begin -> first batch (Keras drops the last epoch's `tf.data` iterator and
makes the next). `ffk-autotune` is flexflow_keras with the pipelines
Keras builds left autotuned (as before `runtime/input_pipelines.py`).

    python bench/epoch_start_bench.py --runs 3
"""

import argparse
import os
import subprocess
import sys
import time

CHILD = r'''
import sys, time
T0 = time.time()
impl = sys.argv[1]
if impl == "keras":
    import keras
else:
    import flexflow_keras as keras
    if impl == "ffk-autotune":
        from flexflow_keras.runtime import input_pipelines
        input_pipelines.without_autotune = lambda dataset: dataset
import numpy as np
rng = np.random.default_rng(0)
x = rng.random((32, 75, 75, 3), "float32"); y = rng.integers(0, 10, 32)
model = keras.applications.InceptionV3(
    weights=None, input_shape=(75, 75, 3), classes=10)
model.compile(optimizer=keras.optimizers.SGD(0.045, momentum=0.9),
              loss="sparse_categorical_crossentropy")
gaps = []
class Gaps(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.end = time.time()
    def on_epoch_begin(self, epoch, logs=None):
        self.begin = time.time()
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0 and hasattr(self, "end"):
            gaps.append((self.begin - self.end, time.time() - self.begin))
model.fit(x, y, batch_size=16, epochs=4, verbose=0, callbacks=[Gaps()])
print("RESULT", " ".join(f"{a:.2f}+{b:.2f}" for a, b in gaps),
      f"{time.time() - T0:.1f}", flush=True)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--impls", default="keras,ffk,ffk-autotune")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2")
    print(f"{'impl':14s} {'boundaries 1-2, 2-3, 3-4 (end->begin+begin->step, s)':55s}"
          f" {'fit (s)':>8s}")
    for run in range(args.runs):
        for impl in args.impls.split(","):
            start = time.time()
            out = subprocess.run(
                [sys.executable, "-c", CHILD, impl], env=env,
                capture_output=True, text=True, timeout=900,
            )
            line = next((l for l in out.stdout.splitlines()
                         if l.startswith("RESULT")), None)
            if line is None:
                print(f"{impl:14s} failed: {out.stderr.strip()[-300:]}")
                continue
            *gaps, fit_s = line.split()[1:]
            print(f"{impl:14s} {' '.join(gaps):55s} {fit_s:>8s}"
                  f"  (wall {time.time() - start:.1f})")


if __name__ == "__main__":
    main()
