"""Simulations per second, full and delta, on FlexFlow's case-study models.

DLRM (8 embedding tables of 1,000,000 x 64, bottom MLP 64-512-512-64,
top MLP 576-1024-1024-1024-1, batch 1024) on `v100x4`, and InceptionV3
(batch 64 per device) on `p100x16`. Delta simulations are random
single-op proposals from the search space, accepted by the Metropolis
rule of the MCMC search (FlexFlow's, alpha = 0.05 per ms).

Usage: python bench/simulator_bench.py [--seconds S] [--check N]
       [--skip-inception] [--python-loop]
"""

import argparse
import math
import random
import time

from flexflow_keras import schedule, search_space
from flexflow_keras.graph import PARAMETER, SAMPLE, Op, OpGraph
from flexflow_keras.graph import TensorInfo, WeightInfo
from flexflow_keras.machine import load_machine
from flexflow_keras.simulator import Simulator
from flexflow_keras.strategy import Strategy


def _dense(name: str, src: str, shape_in: tuple, units: int) -> Op:
    rows, features = shape_in
    forward = 2.0 * rows * features * units + rows * units
    return Op(
        name, "Dense", (src,), (f"{name}:0",), (shape_in,),
        ((rows, units),), "float32",
        (WeightInfo(f"{name}/kernel", (features, units), "float32", True, 1),
         WeightInfo(f"{name}/bias", (units,), "float32", True, 0)),
        forward_flops=forward, backward_flops=2 * forward, flops_exact=True,
        partitionable={0: SAMPLE, 1: PARAMETER},
    )


def dlrm_graph(
    batch: int = 1024, tables: int = 8, rows: int = 1_000_000,
    dim: int = 64, bottom: tuple = (64, 512, 512, 64),
    top: tuple = (576, 1024, 1024, 1024, 1),
) -> OpGraph:
    """DLRM as a hand-built OpGraph (no 2 GB of Keras embeddings)."""
    ops: list[Op] = []
    tensors = {}
    inputs = []
    for t in range(tables):
        name = f"sparse_{t}"
        tensors[name] = TensorInfo(name, (batch,), "int32")
        inputs.append(name)
        emb = f"embedding_{t}"
        ops.append(Op(
            emb, "Embedding", (name,), (f"{emb}:0",), ((batch,),),
            ((batch, dim),), "float32",
            (WeightInfo(f"{emb}/embeddings", (rows, dim), "float32", True,
                        1),),
            forward_flops=float(batch * dim),
            backward_flops=float(batch * dim), flops_exact=True,
            partitionable={0: SAMPLE, 1: PARAMETER},
        ))
    tensors["dense_in"] = TensorInfo("dense_in", (batch, bottom[0]),
                                     "float32")
    inputs.append("dense_in")
    src = "dense_in"
    for k, units in enumerate(bottom[1:]):
        ops.append(_dense(f"bottom_{k}", src, (batch, tensors[src].shape[1]
                   if src in tensors else bottom[k]), units))
        src = f"bottom_{k}:0"
        tensors[src] = TensorInfo(src, (batch, units), "float32",
                                  f"bottom_{k}")
    concat_in = tuple(f"embedding_{t}:0" for t in range(tables)) + (src,)
    width = dim * tables + bottom[-1]
    ops.append(Op(
        "concat", "Concatenate", concat_in, ("concat:0",),
        tuple((batch, dim) for _ in range(tables)) + ((batch, bottom[-1]),),
        ((batch, width),), "float32", forward_flops=float(batch * width),
        backward_flops=float(batch * width), partitionable={0: SAMPLE},
    ))
    for t in range(tables):
        tensors[f"embedding_{t}:0"] = TensorInfo(
            f"embedding_{t}:0", (batch, dim), "float32", f"embedding_{t}")
    tensors["concat:0"] = TensorInfo("concat:0", (batch, width), "float32",
                                     "concat")
    src = "concat:0"
    for k, units in enumerate(top[1:]):
        ops.append(_dense(f"top_{k}", src, (batch, top[k]), units))
        src = f"top_{k}:0"
        tensors[src] = TensorInfo(src, (batch, units), "float32", f"top_{k}")
    return OpGraph(tuple(ops), tensors, tuple(inputs), (src,), batch)


def inception_graph(per_device: int, devices: int) -> OpGraph:
    import keras

    from flexflow_keras.keras_graph import build_graph

    model = keras.applications.InceptionV3(weights=None)
    return build_graph(model, per_device * devices)


def bench(
    label: str, graph: OpGraph, machine_name: str, seconds: float,
    check: int, seed: int = 0,
) -> None:
    machine = load_machine(machine_name)
    n = machine.num_devices
    sim = Simulator(graph, machine, optimizer_slots=2)
    strategy = Strategy.data_parallel(graph, n)
    rng = random.Random(seed)
    full = _rate(lambda: sim.simulate(strategy), seconds)
    ops = list(graph.ops)
    proposals = [
        (op.name, search_space.random_config(op, n, rng))
        for op in (rng.choice(ops) for _ in range(1000))
    ]
    sim.start(strategy)
    dp_tasks = sim.num_tasks
    for name, config in proposals:  # pieces cached, as in a long search
        sim.propose(name, config)
    it = iter(proposals * 100)
    from_dp = _rate(lambda: sim.propose(*next(it)), seconds)
    walk, walk_tasks = _walk(sim, proposals, seconds, rng)
    mismatches = _check(sim, proposals[:check])
    print(
        f"{label}: {len(graph)} ops, {n} devices, {dp_tasks} tasks "
        f"(data parallel)\n"
        f"  full simulation      {full:8,.0f} /s\n"
        f"  delta, from DP       {from_dp:8,.0f} /s\n"
        f"  delta, search walk   {walk:8,.0f} /s  ({walk_tasks} tasks at "
        f"the end)\n"
        f"  delta == full        {check - mismatches}/{check} proposals"
    )


def _walk(
    sim: Simulator, proposals: list, seconds: float, rng: random.Random
) -> tuple[float, int]:
    """Proposals accepted by the search's Metropolis rule (0.05 / ms)."""
    current = sim.start(sim.strategy).step_ms
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        name, config = proposals[count % len(proposals)]
        step_ms = sim.propose(name, config).step_ms
        if rng.random() < math.exp(min(0.0, 0.05 * (current - step_ms))):
            sim.accept()
            current = step_ms
        count += 1
    return count / (time.perf_counter() - start), sim.num_tasks


def _rate(fn, seconds: float) -> float:
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or count < 3:
        fn()
        count += 1
    return count / (time.perf_counter() - start)


def _check(sim: Simulator, proposals: list) -> int:
    """Proposals whose delta result differs from a full simulation."""
    bad = 0
    for name, config in proposals:
        got = sim.propose(name, config)
        if got != sim.simulate(sim.strategy.replace(name, config)):
            bad += 1
        sim.accept()
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--check", type=int, default=200)
    parser.add_argument("--skip-inception", action="store_true")
    parser.add_argument("--python-loop", action="store_true",
                        help="schedule in Python even if the C loop is built")
    args = parser.parse_args()
    if args.python_loop:
        schedule._listsched = None
    print("list scheduling in",
          "Python (flexflow_keras._listsched not built, or --python-loop)"
          if schedule._listsched is None else "C (flexflow_keras._listsched)")
    bench("DLRM on v100x4", dlrm_graph(), "v100x4", args.seconds,
          args.check)
    if not args.skip_inception:
        bench("InceptionV3 on p100x16", inception_graph(64, 16), "p100x16",
              args.seconds, min(args.check, 50))


if __name__ == "__main__":
    main()
