"""Where the first compile's planning time goes, cold or warm cache.

The model is keras.io's vision/image_classification_from_scratch (a
small Xception: RandomFlip + RandomRotation in the model, Rescaling, a
Conv2D stem, blocks of SeparableConv2D + BatchNormalization + Activation
with residual adds and 1x1 strided Conv2D projections, sizes 256, 512,
728, SeparableConv2D(1024), GlobalAveragePooling2D, Dropout, Dense),
planned with `compile(batch_size=..., search_budget=...)` on the live
machine (the attached devices, costs measured).

Prints the planning time (wall and process CPU) and its parts: graph
building, probing (runtime/probe.py), the live machine's calibration
(calibration.py), op cost measurement (cost.py: representatives and
per-shard), the search (sim.start holds the first simulation, which
measures most costs) and the count of measured ops.

`--cache cold` (default) points HOME at a fresh temporary folder, so
every measured fact (calibration, probes, op costs) is measured again;
`--cache warm` runs twice in one folder and reports the second run;
`--cache home` uses the real ~/.cache/flexflow_keras.

Usage: python bench/planning_bench.py [--size 90] [--batch 128]
       [--budget 200] [--cache cold|warm|home] [--no-augment]
       [--per-shard] [--profile]

Each run is a fresh process (TensorFlow's DTensor state and the cache
folder are read at import).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def make_model(keras, input_shape, num_classes=2, augment=True):
    """keras.io's `make_model` (image_classification_from_scratch), with
    the augmentation layers in the model as the issue's report had."""
    layers = keras.layers
    inputs = keras.Input(shape=input_shape)
    x = inputs
    if augment:
        x = layers.RandomFlip("horizontal")(x)
        x = layers.RandomRotation(0.1)(x)
    x = layers.Rescaling(1.0 / 255)(x)
    x = layers.Conv2D(128, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    previous = x
    for size in [256, 512, 728]:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(
            previous
        )
        x = layers.add([x, residual])
        previous = x
    x = layers.SeparableConv2D(1024, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.25)(x)
    outputs = layers.Dense(1 if num_classes == 2 else num_classes)(x)
    return keras.Model(inputs, outputs)


def _one_run(args: argparse.Namespace) -> dict:
    """Plans once in this process; returns the figures."""
    import flexflow_keras as keras
    from flexflow_keras import calibration, cost, planner, search
    from flexflow_keras import simulator
    import flexflow_keras.runtime as runtime

    spent: dict[str, float] = {}

    def timed(owner, name, label):
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + (
                    time.perf_counter() - start
                )

        setattr(owner, name, wrapper)

    timed(planner, "build_graph", "graph")
    timed(runtime, "probe_graph", "probe")
    timed(calibration, "measure", "calibration")
    timed(cost, "measure_representative", "measure: representatives")
    timed(cost, "measure_op_ms", "measure: per shard")
    timed(simulator.Simulator, "start", "search: sim.start")
    timed(simulator.Simulator, "propose", "search: sim.propose")
    timed(search, "search", "search (total)")
    models = []
    init = cost.CostModel.__init__

    def keep(self, *a, **k):
        init(self, *a, **k)
        models.append(self)
        if args.per_shard:
            self.per_shard = True

    cost.CostModel.__init__ = keep
    model = make_model(keras, (args.size, args.size, 3),
                       augment=not args.no_augment)
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    wall, cpu = time.perf_counter(), time.process_time()
    model.compile(
        optimizer="adam", loss="binary_crossentropy",
        search_budget=args.budget, batch_size=args.batch,
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if profile is not None:
        import pstats

        profile.disable()
        pstats.Stats(profile, stream=sys.stderr).sort_stats(
            "cumulative").print_stats(40)
    from flexflow_keras import model_state

    plan = model_state.state_of(model).plans[args.batch]
    return {
        "wall_s": wall, "cpu_s": cpu, "parts_s": spent,
        "measured": sum(m.num_measured for m in models),
        "step_ms": plan.step_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=90)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--budget", type=int, default=200)
    parser.add_argument("--cache", choices=("cold", "warm", "home"),
                        default="cold")
    parser.add_argument("--no-augment", action="store_true")
    parser.add_argument("--per-shard", action="store_true",
                        help="time every shard (the old cost model)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile of the compile, to stderr")
    parser.add_argument("--child", action="store_true",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(_one_run(args)), flush=True)
        return
    argv = [sys.executable, __file__, "--child", "--size", str(args.size),
            "--batch", str(args.batch), "--budget", str(args.budget)]
    argv += ["--no-augment"] * args.no_augment
    argv += ["--per-shard"] * args.per_shard
    argv += ["--profile"] * args.profile
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as home:
        if args.cache != "home":
            env["HOME"] = home
        runs = 2 if args.cache == "warm" else 1
        for _ in range(runs):
            done = subprocess.run(argv, env=env, capture_output=True,
                                  text=True)
            lines = [ln for ln in done.stdout.splitlines()
                     if ln.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                sys.exit(done.stderr[-3000:])
        if args.profile:
            print(done.stderr[-20000:])
    found = json.loads(lines[-1][len("RESULT "):])
    print(f"model: image_classification_from_scratch {args.size}x"
          f"{args.size}x3, batch {args.batch}, budget {args.budget}, "
          f"cache {args.cache}" + (", per shard" if args.per_shard else ""))
    print(f"planning: {found['wall_s']:.2f} s wall, "
          f"{found['cpu_s']:.2f} s CPU; ops measured: {found['measured']}; "
          f"simulated step {found['step_ms']:.0f} ms")
    for label, seconds in sorted(found["parts_s"].items()):
        print(f"  {label:28s} {seconds:7.2f} s")


if __name__ == "__main__":
    main()
