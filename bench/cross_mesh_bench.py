"""Bytes moved between meshes: what the simulator prices against what
the layer-by-layer executor moves (docs/RUNTIME.md, "What a move between
two layouts costs").

    python bench/cross_mesh_bench.py [--models alexnet,...]

For each saved strategy in `strategies/` (FlexFlow's suite, as
`bench/search_bench.py` exports them), over the tensors that enter a
segment (a run of ops on one mesh) from another mesh, forward only:

- simulated: FlexFlow's region transfers, what each consumer part reads
  from producer parts on other devices (`taskgraph.overlaps`), summed
  over the segment's readers of the tensor;
- runtime: what `runtime/step.py` copies, following `moves.copy_plan`
  from the producer's output layout to the layout of the tensor's first
  reader in the segment (`Executor._arrival`);
- other layouts: readers in the segment that want another layout than
  the first (the runtime relays those out on the consumer's mesh, which
  this table does not count);
- before: what the executor moved until 2026-11-29 (the value relaid out
  to replicated on the producer's mesh, an all-gather, and one device's
  copy packed onto every other device of the consumer's mesh).
"""

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import numpy as np  # noqa: E402

from search_bench import CASES, case_graph  # noqa: E402
from flexflow_keras import machine as machine_lib  # noqa: E402
from flexflow_keras import partition, search_space  # noqa: E402
from flexflow_keras import strategy_files, taskgraph  # noqa: E402
from flexflow_keras.runtime import moves  # noqa: E402


def config_grid(shape, dims, split) -> moves.Grid:
    """How a config's mesh (`layouts.MeshCache`: its degrees > 1 in
    order, over its device ids) cuts a tensor whose dims `split` follow
    the config's (`layouts.OpPlan`), per device in device-id order."""
    degrees = [d for d in dims if d > 1] or [1]
    axis = {}
    for dim, degree in enumerate(dims):
        if degree > 1:
            axis[dim] = len(axis)
    cut = {d: axis[d] for d in split if d in axis and d < len(shape)}
    blocks = []
    for n in range(math.prod(degrees)):
        where = np.unravel_index(n, degrees)
        blocks.append(tuple(int(where[cut[d]]) if d in cut else 0
                            for d in range(len(shape))))
    cuts = tuple(dims[d] if d in cut else 1 for d in range(len(shape)))
    return moves.Grid(tuple(shape), cuts, tuple(blocks))


def _segments(graph, strategy) -> list[list]:
    """Consecutive ops on one mesh (`layouts.segments`)."""
    groups: list[list] = []
    for op in graph.ops:
        key = search_space.mesh_key(strategy[op.name])
        if groups and groups[-1][0] == key:
            groups[-1][1].append(op)
        else:
            groups.append((key, [op]))
    return [ops for _, ops in groups]


def cross_mesh_bytes(graph, strategy) -> tuple[int, float, float, int, float]:
    """(tensors, simulated bytes, runtime bytes, readers wanting another
    layout, bytes before 2026-11-29) over tensors entering a segment from
    another mesh."""
    tensors, simulated, moved, others, before = 0, 0.0, 0.0, 0, 0.0
    for ops in _segments(graph, strategy):
        made = {t for op in ops for t in op.outputs}
        readers: dict[str, list] = {}
        for op in ops:
            for k, tensor in enumerate(op.inputs):
                if tensor not in made:
                    readers.setdefault(tensor, []).append((op, k))
        for tensor, reads in readers.items():
            producer = graph.producer(tensor)
            if producer is None:
                continue
            source = strategy[producer.name]
            first, k0 = reads[0]
            if taskgraph.one_mesh(source, strategy[first.name]):
                continue  # relaid out on the mesh, priced as gathers
            tensors += 1
            itemsize = np.dtype(producer.dtype).itemsize
            shape = first.input_shapes[k0]
            index = producer.outputs.index(tensor)
            out_split = {d for d in range(len(shape)) if index == 0 or d == 0}
            src = config_grid(shape, source.dims, out_split)
            grids = []
            for op, k in reads:
                sink = strategy[op.name]
                grids.append(config_grid(
                    shape, sink.dims,
                    partition.split_input_dims(op, k, tuple(shape))))
                simulated += itemsize * sum(
                    forward for i, j, forward, _ in taskgraph.overlaps(
                        producer, index, source.dims, op, k, sink.dims)
                    if sink.device_ids[i] != source.device_ids[j])
            others += sum(g != grids[0] for g in grids[1:])
            sink_ids = strategy[first.name].device_ids
            src_devices = [str(i) for i in source.device_ids]
            dst_devices = [str(i) for i in sink_ids]
            plan = moves.copy_plan(src, grids[0], src_devices, dst_devices)
            moved += itemsize * moves.moved_elements(plan, src_devices,
                                                     dst_devices)
            size = math.prod(shape) * itemsize
            rest = set(sink_ids) - {source.device_ids[0]}
            before += size * (len(source.device_ids) - 1) + size * len(rest)
    return tensors, simulated, moved, others, before


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES))
    args = parser.parse_args(argv)
    print("| strategy | tensors | simulated MB | runtime MB | ratio "
          "| other layouts | before MB |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        example, machine_name, _ = CASES[name]
        path = os.path.join(ROOT, "strategies",
                            f"{example}_{machine_name}.txt")
        if not os.path.exists(path):
            continue
        graph = case_graph(name)
        machine = machine_lib.load_machine(machine_name)
        strategy = strategy_files.load_strategy(path, graph,
                                                machine.num_devices)
        tensors, simulated, moved, others, before = cross_mesh_bytes(
            graph, strategy)
        ratio = moved / simulated if simulated else math.inf
        print(f"| {example} {machine_name} | {tensors} | "
              f"{simulated / 1e6:.1f} | {moved / 1e6:.1f} | {ratio:.2f} | "
              f"{others} | {before / 1e6:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
