"""Search quality on FlexFlow's benchmark suite: MCMC against data
parallelism, the expert strategy, greedy and random search.

    python bench/search_bench.py [--budget 1000] [--seed 0] [--alpha A]
        [--relative-alpha R] [--sweep S] [--models alexnet,...] [--no-random]
        [--export-dir strategies] [--tune 10,30,100,300]

The models are the example scripts' (`examples/<model>.py`, full size,
built without allocating weights), each on the machine of FlexFlow's
evaluation (`p100x16`; the RNNs also on `k80x64`; DLRM on `v100x4` as
in its case study). Per model, the best simulated step time of:

- data parallelism (FlexFlow's start point);
- the expert strategy (`flexflow_keras.experts.expert_strategy`: one
  weird trick for CNNs, layer-wise placement for RNNs, embedding
  columns for DLRM, data parallelism for the Transformer);
- greedy: ops in graph order, each trying `budget / num_ops` random
  configs and keeping the fastest (as many simulations as MCMC);
- random: `budget` independent random strategies, best feasible kept;
- MCMC (`flexflow_keras.search.search`, the defaults `compile()` uses:
  started from the better of data parallelism and the expert strategy,
  a first sweep over each op's splits for up to half the budget, then
  the chain with relative acceptance) with `budget` iterations in all,
  and its wall time; `--sweep 0` is FlexFlow's plain MCMC;
- the reference optimum where one exists (`flexflow_keras.reference`):
  the chain dynamic program for chain-shaped models, exhaustive
  enumeration for the small `*_v100x4` cases; MCMC over it.

`--seeds N` runs greedy and MCMC with seeds 0..N-1 and prints medians
and on how many seeds MCMC is at least as fast as greedy.

`--tune` runs MCMC at each listed relative alpha on every model and
prints the step time relative to the best any setting found: how the
default (`search.RELATIVE_ALPHA`) was chosen. Figures: docs/SEARCH.md.
"""

import argparse
import math
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import flexflow_keras  # noqa: E402,F401  (device setup first)
import keras  # noqa: E402
import model_zoo  # noqa: E402  (load_example)

from flexflow_keras import experts  # noqa: E402
from flexflow_keras import machine as machine_lib  # noqa: E402
from flexflow_keras import reference  # noqa: E402
from flexflow_keras import search as search_lib  # noqa: E402
from flexflow_keras import settings  # noqa: E402
from flexflow_keras import simulator as simulator_lib  # noqa: E402
from flexflow_keras import strategy_files  # noqa: E402
from flexflow_keras.keras_graph import build_graph  # noqa: E402
from flexflow_keras.search_space import random_config  # noqa: E402
from flexflow_keras.strategy import Strategy  # noqa: E402

CASES = {
    # name: (example script, machine, global batch)
    "alexnet": ("alexnet", "p100x16", 1024),
    "inception_v3": ("inception_v3", "p100x16", 512),
    "resnet101": ("resnet101", "p100x16", 512),
    "rnntc": ("rnntc", "p100x16", 1024),
    "rnnlm": ("rnnlm", "p100x16", 1024),
    "nmt": ("nmt", "p100x16", 1024),
    "rnntc_k80": ("rnntc", "k80x64", 1024),
    "rnnlm_k80": ("rnnlm", "k80x64", 1024),
    "nmt_k80": ("nmt", "k80x64", 1024),
    "dlrm": ("dlrm", "v100x4", 1024),
    "transformer": ("transformer_encoder", "p100x16", 256),
    # Small enough to enumerate (12,544 strategies of aligned blocks).
    "rnnlm_v100x4": ("rnnlm", "v100x4", 1024),
}


def case_graph(name):
    """The example's full-size model as an OpGraph (no weight values).

    Keras's name counters are reset first: `keras.applications` models
    name their layers `conv2d`, `conv2d_1`, ... per process, and a saved
    strategy names ops as a script building only that model does."""
    example, _, batch = CASES[name]
    keras.backend.clear_session()
    with model_zoo.without_weight_values():
        model = model_zoo.load_example(example).build_model(small=False)
    return build_graph(model, batch)


def _ms(result) -> float:
    return float(result.step_ms) if result.feasible else math.inf


def greedy_search(graph, simulator, n, budget, seed):
    """Per-op coordinate descent: `budget / num_ops` tries per op."""
    rng = random.Random(seed)
    current = Strategy.data_parallel(graph, n)
    cur_ms = _ms(simulator.start(current))
    tries = max(1, budget // len(graph))
    for op in graph:
        best = None
        for _ in range(tries):
            config = random_config(op, n, rng)
            if config == current[op.name]:
                continue
            ms = _ms(simulator.propose(op.name, config))
            if ms < cur_ms and (best is None or ms < best[0]):
                best = (ms, config)
        if best is not None:
            simulator.propose(op.name, best[1])
            simulator.accept()
            current = current.replace(op.name, best[1])
            cur_ms = best[0]
    return current, cur_ms


def random_search(graph, simulator, n, budget, seed):
    """`budget` independent random strategies, best feasible kept."""
    rng = random.Random(seed)
    best, best_ms = None, math.inf
    for _ in range(budget):
        strategy = Strategy(
            {op.name: random_config(op, n, rng) for op in graph}
        )
        ms = _ms(simulator.simulate(strategy))
        if ms < best_ms:
            best, best_ms = strategy, ms
    return best, best_ms


def _timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def reference_ms(graph, simulator):
    """(step ms, kind) of the reference optimum, or (nan, "")."""
    try:
        found = reference.exhaustive_optimum(
            graph, simulator, simulator.machine.num_devices
        )
        return found.cost_ms, "exhaustive"
    except ValueError:  # too many strategies to enumerate
        pass
    chain = reference.chain_reference(graph, simulator)
    if chain is None:
        return math.nan, ""
    return chain[1], "chain DP"


def run_case(name, budget, seeds, alpha, relative_alpha, with_random=True,
             with_reference=True, sweep=search_lib.SWEEP_SHARE):
    """One model's row; greedy and MCMC at each seed (medians)."""
    _, machine_name, batch = CASES[name]
    graph = case_graph(name)
    machine = machine_lib.load_machine(machine_name)
    n = machine.num_devices

    def sim():
        return simulator_lib.Simulator(graph, machine)

    dp_ms = _ms(sim().simulate(Strategy.data_parallel(graph, n)))
    expert = experts.expert_strategy(graph, n)
    expert_ms = _ms(sim().simulate(expert))
    greedy = [greedy_search(graph, sim(), n, budget, s)[1] for s in seeds]
    random_ms = random_s = math.nan
    if with_random:
        (_, random_ms), random_s = _timed(random_search, graph, sim(), n,
                                          budget, seeds[0])
    results = [
        search_lib.search(graph, sim(), n, budget, alpha=alpha,
                          relative_alpha=relative_alpha, seed=s, verbose=0,
                          candidates=(expert,), sweep=sweep)
        for s in seeds
    ]
    for result in results:
        check = _ms(sim().simulate(result.strategy))
        assert math.isclose(check, result.best_ms, rel_tol=1e-9), (
            check, result.best_ms)
    ref_ms, ref_kind = math.nan, ""
    ref_s = 0.0
    if with_reference:
        (ref_ms, ref_kind), ref_s = _timed(reference_ms, graph, sim())
    mcmc = [r.best_ms for r in results]
    return {
        "model": name, "machine": machine_name, "batch": batch,
        "ops": len(graph), "dp": dp_ms, "expert": expert_ms,
        "expert_name": experts.expert_name(graph) or "data_parallel",
        "greedy": statistics.median(greedy), "random": random_ms,
        "random_s": random_s, "mcmc": statistics.median(mcmc),
        "mcmc_s": max(r.wall_s for r in results),
        "wins": sum(m <= g * (1 + 1e-9) for m, g in zip(mcmc, greedy)),
        "seeds": len(seeds), "reference": ref_ms, "reference_kind": ref_kind,
        "reference_s": ref_s,
        # The fastest seed's strategy is the one worth saving.
        "strategy": min(results, key=lambda r: r.best_ms).strategy,
    }


def tune(names, budget, seed, values):
    """MCMC at each relative alpha; step time over the best found."""
    print(f"relative alpha tuning, budget {budget}, seed {seed}: "
          "MCMC step time / best over all settings")
    print(f"{'model':<14}" + "".join(f"{v:>9g}" for v in values))
    totals = [0.0] * len(values)
    for name in names:
        _, machine_name, _ = CASES[name]
        graph = case_graph(name)
        machine = machine_lib.load_machine(machine_name)
        n = machine.num_devices
        expert = experts.expert_strategy(graph, n)
        found = [
            search_lib.search(
                graph, simulator_lib.Simulator(graph, machine), n, budget,
                relative_alpha=value, seed=seed, verbose=0,
                candidates=(expert,),
            ).best_ms
            for value in values
        ]
        best = min(found)
        ratios = [ms / best for ms in found]
        totals = [t + r for t, r in zip(totals, ratios)]
        print(f"{name:<14}" + "".join(f"{r:>9.3f}" for r in ratios),
              flush=True)
    print(f"{'mean':<14}" + "".join(
        f"{t / len(names):>9.3f}" for t in totals))


def format_rows(rows, budget) -> str:
    head = (f"{'model':<14}{'machine':<9}{'batch':>6}{'ops':>5}"
            f"{'DP ms':>9}{'expert ms':>10}{'greedy ms':>10}"
            f"{'random ms':>10}{'MCMC ms':>9}{'ref ms':>9}"
            f"{'MCMC/DP':>8}{'/expert':>8}{'/ref':>7}{'wins':>6}"
            f"{'MCMC s':>7}  expert; reference")
    seeds = rows[0]["seeds"] if rows else 1
    lines = [
        f"budget={budget} iterations/simulations per search; greedy and "
        f"MCMC: median over {seeds} seed(s), wins = seeds where MCMC <= "
        "greedy; MCMC s: slowest seed",
        head,
    ]
    for r in rows:
        lines.append(
            f"{r['model']:<14}{r['machine']:<9}{r['batch']:>6}"
            f"{r['ops']:>5}{r['dp']:>9.2f}{r['expert']:>10.2f}"
            f"{r['greedy']:>10.2f}{r['random']:>10.2f}{r['mcmc']:>9.2f}"
            f"{r['reference']:>9.2f}"
            f"{r['dp'] / r['mcmc']:>7.2f}x{r['expert'] / r['mcmc']:>7.2f}x"
            f"{r['mcmc'] / r['reference']:>7.3f}"
            f"{r['wins']:>4}/{r['seeds']}{r['mcmc_s']:>7.1f}  "
            f"{r['expert_name']}; {r['reference_kind'] or '-'}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    # `--budget`, `--seed`, `--alpha` are the package's own flags, taken
    # out of sys.argv at import; read them back through settings.
    flags = settings.resolve()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--relative-alpha", type=float,
                        default=search_lib.RELATIVE_ALPHA)
    parser.add_argument("--sweep", type=float,
                        default=search_lib.SWEEP_SHARE,
                        help="Share of the budget the search's first "
                        "sweep may use (0: plain MCMC).")
    parser.add_argument("--show-strategy", action="store_true")
    parser.add_argument("--no-random", action="store_true",
                        help="Skip random search (slow on big graphs).")
    parser.add_argument("--no-reference", action="store_true",
                        help="Skip the reference optima (the chain "
                        "program takes ~20 s on k80x64).")
    parser.add_argument("--seeds", type=int, default=1,
                        help="Run greedy and MCMC with seeds "
                        "seed..seed+N-1; medians are printed.")
    parser.add_argument("--export-dir", default=None,
                        help="Write each model's MCMC strategy (the "
                        "fastest seed's) as <example>_<machine>.txt and "
                        ".pb there.")
    parser.add_argument("--tune", default=None,
                        help="Comma-separated relative alphas to compare.")
    args = parser.parse_args(argv)
    budget = flags.search_budget
    seed = 0 if flags.search_seed is None else flags.search_seed
    names = args.models.split(",")
    if args.tune:
        tune(names, budget, seed,
             [float(v) for v in args.tune.split(",")])
        return 0
    rows = []
    for name in names:
        row = run_case(name, budget,
                       list(range(seed, seed + args.seeds)),
                       flags.search_alpha, args.relative_alpha,
                       not args.no_random, not args.no_reference,
                       args.sweep)
        rows.append(row)
        print(format_rows([row], budget).splitlines()[-1], flush=True)
        if args.show_strategy:
            print(row["strategy"].to_text())
        if args.export_dir:
            stem = os.path.join(args.export_dir,
                                f"{CASES[name][0]}_{row['machine']}")
            for ext in (".txt", ".pb"):
                strategy_files.save_strategy(row["strategy"], stem + ext)
    print(format_rows(rows, budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
