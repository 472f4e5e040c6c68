"""What switching costs: each example on plain Keras and on flexflow_keras.

For every script in `examples/` (small sizes), the `compare` command's
two runs (`flexflow_keras.compare.run_side`: its own process, seeded
alike): plain Keras, then flexflow_keras on 1 device and on 4 virtual
CPU devices (`FLEXFLOW_KERAS_CPU_DEVICES`). Prints wall time and time to
the first training step (both from process start), the first fit's first
epoch (validation included), and each flexflow_keras figure relative to
plain Keras's.

Usage:
    python bench/overhead_bench.py [--examples mlp,cnn] [--budget 100]
        [--devices 1,4]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from flexflow_keras.compare import first_epoch_s, run_side  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The examples whose default sizes are already small; the others take
# `--small` (FlexFlow's benchmark models).
SMALL_BY_DEFAULT = {"mlp", "custom_train_step", "distillation",
                    "bidirectional_lstm", "cnn", "transformer"}


def example_args(name: str) -> list[str]:
    flags = ["--epochs", "2"]
    return flags if name in SMALL_BY_DEFAULT else ["--small"] + flags


def quiet_env(**extra: str) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **extra)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default=None,
                        help="Comma-separated names; default: all.")
    parser.add_argument("--budget", type=int, default=100)
    parser.add_argument("--devices", default="1,4")
    args = parser.parse_args()
    names = args.examples.split(",") if args.examples else sorted(
        f[:-3] for f in os.listdir(os.path.join(ROOT, "examples"))
        if f.endswith(".py"))
    counts = [int(n) for n in args.devices.split(",")]
    header = f"{'example':<20}{'keras wall/step/epoch':>24}" + "".join(
        f"{f'ffk x{n} wall/step/epoch':>44}" for n in counts)
    print(header, flush=True)
    for name in names:
        script = os.path.join(ROOT, "examples", f"{name}.py")
        flags = example_args(name)
        with open(os.devnull, "w") as sink:
            sys.stdout.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            try:
                plain = run_side("keras", script, flags, env=quiet_env())
                ours = [run_side("flexflow_keras", script, flags, env=quiet_env(
                    FLEXFLOW_KERAS_CPU_DEVICES=str(n),
                    FLEXFLOW_KERAS_SEARCH_BUDGET=str(args.budget),
                    FLEXFLOW_KERAS_SEARCH_VERBOSE="0",
                )) for n in counts]
            finally:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
        cells = [_pair(plain, None)] + [_pair(r, plain) for r in ours]
        print(f"{name:<20}{cells[0]:>24}" + "".join(f"{c:>44}"
                                                     for c in cells[1:]),
              flush=True)


def _pair(result: dict, base: dict | None) -> str:
    """`wall/first step/first epoch` seconds, with ratios to `base`'s."""
    if result.get("status"):
        return f"failed ({result.get('status')})"
    figures = [result.get("wall_s"), result.get("first_step_s"),
               first_epoch_s(result)]
    text = "/".join("-" if f is None else f"{f:.1f}" for f in figures) + " s"
    if base:
        bases = [base.get("wall_s"), base.get("first_step_s"),
                 first_epoch_s(base)]
        text += " (" + "/".join(
            f"{f / b:.2f}x" if f and b else "-"
            for f, b in zip(figures, bases)) + ")"
    return text


if __name__ == "__main__":
    main()
