"""`python -m flexflow_keras compare SCRIPT [ARGS...]`: try before you
switch.

Runs a user's script twice, each in a process of its own: as written on
plain Keras, then with its Keras imports turned into flexflow_keras
ones (`compare_child.rewrite_imports`), both seeded alike. Prints side
by side each fit's per-epoch losses and metrics, the wall time and the
time to the first training step, the strategy flexflow_keras trained
under with its simulated speed-up, and the warnings only the
flexflow_keras run raised (a fallback and its reason). The package's
own flags (`--search-budget`, `--import-strategy`, ...) given to
`compare` reach the flexflow_keras run only; every other argument
reaches both runs of the script.
"""

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from flexflow_keras import settings as settings_lib

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                     "compare_child.py")
IMPLS = ("keras", "flexflow_keras")


def run_side(impl: str, script: str, args: Sequence[str], seed: int = 0,
             env: dict | None = None, timeout: float | None = None) -> dict:
    """Runs `script` on `impl`; the child's result (`compare_child`),
    with its exit status. The script's output goes to ours."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        done = subprocess.run(
            [sys.executable, CHILD, "--impl", impl, "--out", out,
             "--seed", str(seed), script, *args],
            env=env, timeout=timeout,
        )
        if not os.path.exists(out):  # killed before writing (a crash)
            return {"impl": impl, "status": done.returncode, "fits": [],
                    "error": f"the process ended with status "
                    f"{done.returncode} before it reported", "warnings": [],
                    "wall_s": None, "first_step_s": None}
        with open(out) as f:
            result = json.load(f)
    result["status"] = done.returncode
    return result


def _flexflow_env() -> dict:
    """Our environment plus the package's flags given to `compare`, as
    the variables the flexflow_keras run reads."""
    env = dict(os.environ)
    for field, value in settings_lib.command_line().items():
        env[settings_lib.ENV_PREFIX + field.upper()] = str(value)
    return env


def compare(script: str, args: Sequence[str], out: Any = None,
            seed: int = 0) -> int:
    """Both runs, then the side-by-side report on `out`; 0 when both
    scripts ended well."""
    out = out or sys.stdout
    if not os.path.isfile(script):
        raise ValueError(
            f"`compare` needs a Python script to run. Received: {script!r}, "
            "which is not a file."
        )
    results = {}
    for impl in IMPLS:
        print(f"=== {impl}: python {script} {' '.join(args)}", file=out,
              flush=True)
        env = _flexflow_env() if impl == "flexflow_keras" else None
        results[impl] = run_side(impl, script, args, seed, env)
    print(report(results["keras"], results["flexflow_keras"]), file=out)
    return 0 if all(r["status"] == 0 for r in results.values()) else 1


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def report(plain: dict, ours: dict) -> str:
    """The side-by-side text of two `run_side` results."""
    lines = ["", "=== compare: plain Keras | flexflow_keras"]
    lines.append(f"{'wall time':<24}{_seconds(plain.get('wall_s')):>14}"
                 f"{_seconds(ours.get('wall_s')):>16}")
    lines.append(f"{'time to first step':<24}"
                 f"{_seconds(plain.get('first_step_s')):>14}"
                 f"{_seconds(ours.get('first_step_s')):>16}")
    lines.append(f"{'first epoch':<24}"
                 f"{_seconds(first_epoch_s(plain)):>14}"
                 f"{_seconds(first_epoch_s(ours)):>16}")
    for side, result in (("plain Keras", plain), ("flexflow_keras", ours)):
        if result.get("error") or result.get("status"):
            lines.append(f"{side} failed (status {result.get('status')}): "
                         f"{result.get('error') or 'see its output above'}")
    fits_a, fits_b = plain.get("fits", []), ours.get("fits", [])
    if len(fits_a) != len(fits_b):
        lines.append(f"fits: {len(fits_a)} on plain Keras, {len(fits_b)} "
                     "on flexflow_keras")
    for index, (a, b) in enumerate(zip(fits_a, fits_b)):
        lines.append("")
        lines.append(f"fit {index + 1} (model '{b.get('model')}')")
        lines.extend(_epochs_table(a["epochs"], b["epochs"]))
        lines.extend(_strategy_lines(b))
    only_ours = [w for w in ours.get("warnings", [])
                 if w not in plain.get("warnings", [])]
    if only_ours:
        lines.append("")
        lines.append("warnings only flexflow_keras raised:")
        lines.extend(f"  {w}" for w in only_ours)
    return "\n".join(lines)


def first_epoch_s(result: dict) -> float | None:
    """Seconds of the first fit's first epoch in a `run_side` result."""
    fits = result.get("fits") or []
    seconds = fits[0].get("epoch_s") if fits else None
    return seconds[0] if seconds else None


def _epochs_table(plain: list[dict], ours: list[dict]) -> list[str]:
    keys = [k for k in (plain[0] if plain else {})
            if ours and k in ours[0]]
    if not keys:
        return [f"  epochs: {len(plain)} on plain Keras, {len(ours)} on "
                "flexflow_keras (no shared logs)"]
    header = f"  {'epoch':<6}" + "".join(
        f"{k + ' K':>16}{k + ' FF':>16}" for k in keys)
    rows = [header]
    for epoch in range(max(len(plain), len(ours))):
        cells = []
        for key in keys:
            for side in (plain, ours):
                value = side[epoch].get(key) if epoch < len(side) else None
                cells.append(f"{'-' if value is None else f'{value:.4f}':>16}")
        rows.append(f"  {epoch + 1:<6}" + "".join(cells))
    return rows


def _strategy_lines(fit: dict) -> list[str]:
    if "strategy" not in fit:
        return ["  flexflow_keras: no strategy (trained as plain Keras)"]
    lines = [f"  strategy ({fit.get('source', '?')}) over "
             f"{fit['devices']} device(s):"]
    lines.extend(f"    {line}" for line in fit["strategy"].splitlines()
                 if line.strip())
    if "simulated_ms" in fit and fit["simulated_ms"] > 0:
        speedup = fit["data_parallel_ms"] / fit["simulated_ms"]
        lines.append(f"  simulated step {fit['simulated_ms']:.2f} ms, data "
                     f"parallelism {fit['data_parallel_ms']:.2f} ms: "
                     f"{speedup:.2f}x")
    return lines
