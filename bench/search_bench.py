"""Search quality: MCMC against data parallelism, greedy and random search.

    /work/venv/bin/python bench/search_bench.py [--budget 1000] [--seed 0]
        [--models dlrm,alexnet,inception_v3,transformer]

For each model and machine (DLRM on `v100x4` as in FlexFlow's case study;
AlexNet, InceptionV3 and a Transformer encoder on `p100x16`), prints the
best simulated step time of:

- data parallelism (the start point);
- greedy: ops in graph order, each trying `budget / num_ops` random
  configs and keeping the fastest (same number of simulations);
- random: `budget` independent random strategies (every op a random
  config), best feasible kept;
- MCMC (`flexflow_keras.search.search`) with `budget` iterations,

with each search's wall time. FlexFlow reports 3.8x over data parallelism
for this DLRM on 4 GPUs after 1,000 iterations.

Last run (2 shared CPU cores; simulated ms; seed 0):

    bench/search_bench.py --budget 1000           (alpha 0.05, default)
    model        machine  batch ops  DP ms greedy  random   MCMC MCMC/DP
    dlrm         v100x4    1024  24  63.13  13.72    2.71   2.38  26.55x
    alexnet      p100x16   1024  12  46.63  39.79  172.49  40.09   1.16x
    inception_v3 p100x16    512 312 134.87 134.87 9404.92 134.87   1.00x
    transformer  p100x16    256  44 157.82 154.09 1456.97 153.99   1.02x

    bench/search_bench.py --budget 5000 --alpha 1.0 --no-random
    dlrm         v100x4    1024  24  63.13  13.71       -   2.46  25.63x
    alexnet      p100x16   1024  12  46.63  35.27       -  34.86   1.34x
    inception_v3 p100x16    512 312 134.87 134.87       - 134.87   1.00x
    transformer  p100x16    256  44 157.82 153.09       - 151.32   1.04x

At alpha 0.05 (FlexFlow's default, per ms) a proposal 10 ms slower is
still accepted with probability 0.6, so on 40-150 ms steps the chain is
nearly a random walk between restarts; alpha 1.0 beats greedy at 5000
iterations (alpha 0.05 there: AlexNet 37.73, Transformer 157.82).
"""

import argparse
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import flexflow_keras  # noqa: E402,F401  (device setup first)
import keras  # noqa: E402
import model_zoo  # noqa: E402  (tests/model_zoo.py)

from flexflow_keras import machine as machine_lib  # noqa: E402
from flexflow_keras import search as search_lib  # noqa: E402
from flexflow_keras import settings  # noqa: E402
from flexflow_keras import simulator as simulator_lib  # noqa: E402
from flexflow_keras import strategy_files  # noqa: E402
from flexflow_keras.graph import build_graph  # noqa: E402
from flexflow_keras.search_space import random_config  # noqa: E402
from flexflow_keras.strategy import Strategy  # noqa: E402

layers = keras.layers


def dlrm():
    """FlexFlow's DLRM case study: 8 tables 1e6 x 64, MLPs 64-512-512-64
    and 576-1024-1024-1024-1 (tables not allocated: search only)."""
    return model_zoo.dlrm(8, 1_000_000, 64, 64, (512, 512, 64),
                          (1024, 1024, 1024, 1), defer_weights=True)


def alexnet(classes=1000):
    inputs = keras.Input((224, 224, 3), name="image")
    x = layers.Conv2D(64, 11, 4, padding="same", activation="relu",
                      name="conv1")(inputs)
    x = layers.MaxPooling2D(3, 2, name="pool1")(x)
    x = layers.Conv2D(192, 5, padding="same", activation="relu",
                      name="conv2")(x)
    x = layers.MaxPooling2D(3, 2, name="pool2")(x)
    for i, filters in enumerate((384, 256, 256)):
        x = layers.Conv2D(filters, 3, padding="same", activation="relu",
                          name=f"conv{i + 3}")(x)
    x = layers.MaxPooling2D(3, 2, name="pool5")(x)
    x = layers.Flatten(name="flatten")(x)
    for i in (6, 7):
        x = layers.Dense(4096, activation="relu", name=f"fc{i}")(x)
    out = layers.Dense(classes, activation="softmax", name="fc8")(x)
    return keras.Model(inputs, out, name="alexnet")


def inception_v3():
    return keras.applications.InceptionV3(weights=None)


def transformer(seq=128, d_model=1024, heads=16, ff=4096, num_layers=6,
                vocab=32000):
    tokens = keras.Input((seq,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab, d_model, name="embed")(tokens)
    for i in range(num_layers):
        a = layers.MultiHeadAttention(heads, d_model // heads,
                                      name=f"attn_{i}")(x, x)
        x = layers.LayerNormalization(name=f"ln1_{i}")(
            layers.Add(name=f"res1_{i}")([x, a]))
        h = layers.Dense(ff, activation="relu", name=f"ff1_{i}")(x)
        h = layers.Dense(d_model, name=f"ff2_{i}")(h)
        x = layers.LayerNormalization(name=f"ln2_{i}")(
            layers.Add(name=f"res2_{i}")([x, h]))
    out = layers.Dense(vocab, name="logits")(x)
    return keras.Model(tokens, out, name="transformer")


CASES = {
    # name: (builder, machine, global batch)
    "dlrm": (dlrm, "v100x4", 1024),
    "alexnet": (alexnet, "p100x16", 1024),
    "inception_v3": (inception_v3, "p100x16", 512),
    "transformer": (transformer, "p100x16", 256),
}


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


def run_case(name, budget, seed, alpha, with_random=True):
    builder, machine_name, batch = CASES[name]
    graph = build_graph(builder(), batch)
    machine = machine_lib.load_machine(machine_name)
    n = machine.num_devices

    def sim():
        return simulator_lib.Simulator(graph, machine)

    dp_ms = _ms(sim().simulate(Strategy.data_parallel(graph, n)))
    (_, greedy_ms), greedy_s = _timed(greedy_search, graph, sim(), n,
                                      budget, seed)
    random_ms = random_s = math.nan
    if with_random:
        (_, random_ms), random_s = _timed(random_search, graph, sim(), n,
                                          budget, seed)
    result = search_lib.search(graph, sim(), n, budget, alpha=alpha,
                               seed=seed, verbose=0)
    check = _ms(sim().simulate(result.strategy))
    assert math.isclose(check, result.best_ms, rel_tol=1e-9), (
        check, result.best_ms)
    return {
        "model": name, "machine": machine_name, "batch": batch,
        "ops": len(graph), "dp": dp_ms, "greedy": greedy_ms,
        "greedy_s": greedy_s, "random": random_ms, "random_s": random_s,
        "mcmc": result.best_ms, "mcmc_s": result.wall_s,
        "strategy": result.strategy,
    }


def format_rows(rows, budget) -> str:
    head = (f"{'model':<13}{'machine':<9}{'batch':>6}{'ops':>5}"
            f"{'DP ms':>10}{'greedy ms':>11}{'random ms':>11}"
            f"{'MCMC ms':>10}{'MCMC/DP':>9}{'MCMC s':>8}"
            f"{'greedy s':>9}{'random s':>9}")
    lines = [f"budget={budget} iterations/simulations per search", head]
    for r in rows:
        lines.append(
            f"{r['model']:<13}{r['machine']:<9}{r['batch']:>6}"
            f"{r['ops']:>5}{r['dp']:>10.2f}{r['greedy']:>11.2f}"
            f"{r['random']:>11.2f}{r['mcmc']:>10.2f}"
            f"{r['dp'] / r['mcmc']:>8.2f}x{r['mcmc_s']:>8.1f}"
            f"{r['greedy_s']:>9.1f}{r['random_s']:>9.1f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    # `--budget`, `--seed`, `--alpha` are the package's own flags, taken
    # out of sys.argv at import; read them back through settings.
    flags = settings.resolve()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--show-strategy", action="store_true")
    parser.add_argument("--no-random", action="store_true",
                        help="Skip random search (slow on big graphs).")
    parser.add_argument("--export-dir", default=None,
                        help="Write each MCMC strategy as "
                        "<model>_<machine>.txt there.")
    args = parser.parse_args(argv)
    args.budget = flags.search_budget
    args.seed = 0 if flags.search_seed is None else flags.search_seed
    args.alpha = flags.search_alpha
    rows = []
    for name in args.models.split(","):
        row = run_case(name, args.budget, args.seed, args.alpha,
                       not args.no_random)
        rows.append(row)
        print(format_rows([row], args.budget).splitlines()[-1], flush=True)
        if args.show_strategy:
            print(row["strategy"].to_text())
        if args.export_dir:
            path = os.path.join(args.export_dir,
                                f"{name}_{row['machine']}.txt")
            strategy_files.save_strategy(row["strategy"], path)
    print(format_rows(rows, args.budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
