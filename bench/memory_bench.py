"""What a step holds in memory: plain Keras and DTensor data parallelism
on the attached devices, against what the simulator counts.

keras.io's Xception-like image classifier (`image_classification_from_
scratch.py`'s `make_model`, as `planning_bench.py` builds it, without
the augmentation layers), 2 epochs of 2 steps, each run in its own
process; peak resident memory (`ru_maxrss`) at two batch sizes, and its
growth between them (what the step's activations take, the process's
fixed part cancelled), beside the simulator's peak for the same growth
(one device; data parallelism summed over the devices). The ratio for
data parallelism is `planner.DTENSOR_CPU_MEMORY_FACTOR`'s measurement.

Usage:
    python bench/memory_bench.py [--size 90] [--batches 32,64]
"""

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from planning_bench import make_model  # noqa: E402  (keras.io's model)

CHILD = r'''
import resource, sys
impl, size, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if impl == "keras":
    import keras
else:
    import flexflow_keras as keras
import numpy as np
sys.path.insert(0, sys.argv[4])
from planning_bench import make_model

keras.utils.set_random_seed(1)
model = make_model(keras, (size, size, 3), augment=False)
options = {} if impl == "keras" else {"search_budget": 0}
model.compile(optimizer="adam", metrics=["acc"], **options,
              loss=keras.losses.BinaryCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.integers(0, 255, (batch * 2, size, size, 3)).astype("float32")
y = rng.integers(0, 2, (batch * 2, 1)).astype("float32")
model.fit(x, y, batch_size=batch, epochs=2, verbose=0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("PEAK", peak)
'''


def measured_peak(impl: str, size: int, batch: int, devices: int) -> int:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               FLEXFLOW_KERAS_CPU_DEVICES=str(devices),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH",
                                                             ""))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, impl, str(size), str(batch),
         os.path.dirname(os.path.abspath(__file__))],
        capture_output=True, text=True, env=env,
    )
    found = re.search(r"^PEAK (\d+)$", done.stdout, re.M)
    if found is None:
        raise RuntimeError(f"{impl} run failed:\n{done.stderr[-3000:]}")
    return int(found.group(1))


def simulated_peaks(size: int, batch: int, devices: int) -> tuple:
    """(one device's peak, data parallelism's peaks summed)."""
    import keras

    from flexflow_keras import machine as machine_lib
    from flexflow_keras import simulator
    from flexflow_keras.keras_graph import build_graph
    from flexflow_keras.optimizer_slots import optimizer_slots
    from flexflow_keras.strategy import Strategy

    graph = build_graph(make_model(keras, (size, size, 3), augment=False),
                        batch)
    sim = simulator.Simulator(graph, machine_lib.load_machine(None),
                              optimizer_slots=optimizer_slots("adam"))
    one = sim.simulate(Strategy.data_parallel(graph, 1)).peak_memory_bytes
    spread = sim.simulate(
        Strategy.data_parallel(graph, devices)).peak_memory_bytes
    return one[0], sum(spread)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=90)
    parser.add_argument("--batches", default="32,64")
    parser.add_argument("--devices", type=int, default=4)
    args = parser.parse_args()
    small, large = (int(b) for b in args.batches.split(","))
    os.environ.setdefault("FLEXFLOW_KERAS_CPU_DEVICES", str(args.devices))
    import flexflow_keras  # noqa: F401  (devices, before TensorFlow)

    gb = 1e9
    rows = []
    for impl, label in (("keras", "plain Keras, 1 device"),
                        ("flexflow_keras",
                         f"data parallelism, {args.devices} devices")):
        peaks = [measured_peak(impl, args.size, b, args.devices)
                 for b in (small, large)]
        rows.append((label, peaks))
    sims = [simulated_peaks(args.size, b, args.devices)
            for b in (small, large)]
    print(f"{args.size}x{args.size} images, batch {small} -> {large}; "
          "peak resident memory, GB")
    print(f"{'run':<32}{'measured':>22}{'growth':>10}"
          f"{'simulated growth':>18}{'ratio':>8}")
    for index, (label, peaks) in enumerate(rows):
        growth = (peaks[1] - peaks[0]) / gb
        simulated = (sims[1][index] - sims[0][index]) / gb
        print(f"{label:<32}{peaks[0] / gb:>10.2f} -> {peaks[1] / gb:<8.2f}"
              f"{growth:>10.2f}{simulated:>18.2f}"
              f"{growth / simulated:>8.2f}")


if __name__ == "__main__":
    main()
