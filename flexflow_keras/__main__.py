"""Plan parallelism without a training script: `python -m flexflow_keras`.

    python -m flexflow_keras search MODEL.keras --machine h100x8 \\
        --batch-size 512 --budget 5000 --export s.pb
    python -m flexflow_keras show s.pb [--model MODEL.keras --batch-size N]
    python -m flexflow_keras simulate MODEL.keras --machine h100x8 \\
        --batch-size 512 --import s.pb --trace trace.json
    python -m flexflow_keras compare SCRIPT.py [ARGS...]

The package is imported first (`python -m` does so), which sets up the
devices and takes the shared flags (`--machine`, `--budget`, `--alpha`,
`--seed`, `--export`, `--import`) out of `sys.argv`; they reach the
commands through `settings.resolve()`, so environment variables work
too. Errors print as one `Error: ...` line and exit with status 2.
"""

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from flexflow_keras import settings as settings_lib

PROG = "python -m flexflow_keras"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Search, inspect and simulate FlexFlow parallel "
        "strategies for a saved Keras model.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", help="Saved Keras model (.keras).")
        p.add_argument("--batch-size", type=int, required=True,
                       help="Global batch size to plan for.")
        p.add_argument("--machine", default=None,
                       help="Preset (v100x4, p100x16, k80x64, h100x8, "
                       "h100x64) or JSON spec; default: attached devices.")
        p.add_argument("--optimizer-slots", type=int, default=0,
                       help="Optimizer state per weight (Adam: 2).")

    p = commands.add_parser("search", help="MCMC search; print the best.")
    model_args(p)
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--alpha", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--export", default=None,
                   help="Write the best strategy (.pb or .txt).")
    p.add_argument("--quiet", action="store_true",
                   help="No progress lines.")

    p = commands.add_parser("show", help="Print a strategy file.")
    p.add_argument("strategy", help="Strategy file (.pb or .txt).")
    p.add_argument("--model", default=None,
                   help="Validate against this model and print a table.")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--machine", default=None)

    p = commands.add_parser(
        "simulate", help="Simulated step time and memory of a strategy."
    )
    model_args(p)
    p.add_argument("--import", dest="import_strategy", default=None,
                   help="Strategy file; default: data parallelism.")
    p.add_argument("--trace", default=None,
                   help="Write the simulated timeline (Chrome trace JSON).")

    p = commands.add_parser(
        "compare", help="Run a script on plain Keras and on flexflow_keras "
        "(its Keras imports turned into ours); print both side by side.",
    )
    p.add_argument("script", help="The training script.")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="Its arguments (both runs get them).")
    return parser


def _settings(args: argparse.Namespace) -> settings_lib.Settings:
    """Command flags win; then the flags taken at import, env, defaults."""
    kwargs = {
        "machine": getattr(args, "machine", None),
        "search_budget": getattr(args, "budget", None),
        "search_alpha": getattr(args, "alpha", None),
        "search_seed": getattr(args, "seed", None),
        "export_strategy": getattr(args, "export", None),
        "import_strategy": getattr(args, "import_strategy", None),
    }
    return settings_lib.resolve(kwargs)


def _load_model(path: str) -> Any:
    from flexflow_keras import models

    try:
        return models.load_model(path, compile=False)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"Cannot load the model {path!r}: {e}. Save it with "
            "`model.save('MODEL.keras')`."
        ) from None


def _load_graph(path: str, batch_size: int) -> Any:
    from flexflow_keras import keras_graph

    return keras_graph.build_graph(_load_model(path), batch_size)


def _simulator(graph: Any, machine: Any, slots: int) -> Any:
    from flexflow_keras import simulator

    return simulator.Simulator(graph, machine, optimizer_slots=slots)


def _per_op_ms(sim: Any, strategy: Any) -> dict[str, float]:
    from flexflow_keras.planner import per_op_ms

    return per_op_ms(sim.graph, strategy, sim.cost)


def cmd_search(args: argparse.Namespace, out: Any) -> int:
    """Plans as `compile()` does (`planner.make_plan`: the same start
    points, the same one-mesh rule, the same export)."""
    from flexflow_keras import planner, report

    settings = _settings(args)
    plan = planner.make_plan(
        _load_model(args.model), args.batch_size, settings,
        verbose=0 if args.quiet else 2, slots=args.optimizer_slots,
        print_fn=lambda line: print(line, file=out, flush=True),
    )
    if args.quiet and plan.search_result is not None:
        print(report.search_report(plan.search_result), file=out)
    print(report.strategy_table(plan.graph, plan.strategy, plan.per_op_ms),
          file=out)
    if settings.export_strategy:
        print(f"Strategy written to {settings.export_strategy}", file=out)
    return 0


def cmd_show(args: argparse.Namespace, out: Any) -> int:
    from flexflow_keras import machine as machine_lib
    from flexflow_keras import report, strategy_files
    from flexflow_keras.strategy import Strategy

    if args.model is None:
        configs = strategy_files.read_configs(args.strategy)
        strategy = Strategy(configs)
        if not configs:
            raise ValueError(f"Strategy file {args.strategy!r} holds no ops.")
        print(strategy_files.to_text(strategy), end="", file=out)
        return 0
    if args.batch_size is None:
        raise ValueError("`show --model` needs `--batch-size`.")
    settings = _settings(args)
    graph = _load_graph(args.model, args.batch_size)
    machine = machine_lib.load_machine(settings.machine)
    strategy = strategy_files.load_strategy(
        args.strategy, graph, machine.num_devices
    )
    print(report.strategy_table(graph, strategy), file=out)
    return 0


def cmd_simulate(args: argparse.Namespace, out: Any) -> int:
    from flexflow_keras import machine as machine_lib
    from flexflow_keras import strategy_files
    from flexflow_keras.report import strategy_table
    from flexflow_keras.strategy import Strategy

    settings = _settings(args)
    graph = _load_graph(args.model, args.batch_size)
    machine = machine_lib.load_machine(settings.machine)
    n = machine.num_devices
    data_parallel = Strategy.data_parallel(graph, n)
    strategy = data_parallel
    if settings.import_strategy:
        strategy = strategy_files.load_strategy(
            settings.import_strategy, graph, n
        )
    sim = _simulator(graph, machine, args.optimizer_slots)
    result = sim.simulate(strategy)
    base = sim.simulate(data_parallel)
    print(strategy_table(graph, strategy, _per_op_ms(sim, strategy)),
          file=out)
    print(f"Machine: {machine}", file=out)
    print(
        f"Simulated step time: {result.step_ms:.3f} ms "
        f"(data parallelism: {base.step_ms:.3f} ms, speed-up "
        f"{base.step_ms / result.step_ms:.2f}x)",
        file=out,
    )
    peak = max(result.peak_memory_bytes, default=0)
    print(f"Fits in memory: {'yes' if result.feasible else 'NO'}; peak "
          f"memory of a device: {peak / 2**20:.1f} MiB; bytes over links: "
          f"{result.comm_bytes / 2**20:.1f} MiB", file=out)
    if args.trace:
        _write_trace(sim, strategy, args.trace)
        print(f"Trace written to {args.trace} (open in chrome://tracing "
              "or ui.perfetto.dev)", file=out)
    return 0


def _write_trace(sim: Any, strategy: Any, path: str) -> None:
    from flexflow_keras import trace

    trace.write_trace(path, sim.timeline(strategy))


def cmd_compare(args: argparse.Namespace, out: Any) -> int:
    """The script as written, then switched (`flexflow_keras.compare`)."""
    from flexflow_keras import compare

    return compare.compare(args.script, args.script_args, out)


COMMANDS = {"search": cmd_search, "show": cmd_show, "simulate": cmd_simulate,
            "compare": cmd_compare}


def main(argv: Sequence[str] | None = None, out: Any = None) -> int:
    """Runs one command; returns the exit status.

    Args:
        argv: Arguments after the program name; `sys.argv[1:]` if None.
        out: Text stream for the output; `sys.stdout` if None.
    """
    out = out or sys.stdout
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return COMMANDS[args.command](args, out)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
