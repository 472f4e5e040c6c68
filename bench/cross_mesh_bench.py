"""Bytes moved between meshes: what the simulator prices against what
the layer-by-layer executor moves (docs/RUNTIME.md, "What a move between
two layouts costs").

    python bench/cross_mesh_bench.py [--models alexnet,...]

For each saved strategy in `strategies/` (FlexFlow's suite, as
`bench/search_bench.py` exports them), over the edges whose producer
and consumer are not on one mesh (`taskgraph.one_mesh`), forward only:

- simulated: FlexFlow's region transfers, what each consumer part reads
  from producer parts on other devices (`taskgraph.overlaps`);
- runtime: what `runtime/step.py` does at a segment boundary, the value
  relaid out to replicated on the producer's mesh (an all-gather: each
  of its devices receives the rest) and one device's copy packed onto
  every other device of the consumer's mesh.
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
from flexflow_keras import strategy_files, taskgraph  # noqa: E402


def cross_mesh_bytes(graph, strategy) -> tuple[int, float, float]:
    """(edges, simulated bytes, runtime bytes) over cross-mesh edges."""
    edges, simulated, moved = 0, 0.0, 0.0
    for consumer in graph.ops:
        for k, tensor in enumerate(consumer.inputs):
            producer = graph.producer(tensor)
            if producer is None:
                continue
            source, sink = strategy[producer.name], strategy[consumer.name]
            if taskgraph.one_mesh(source, sink):
                continue
            edges += 1
            itemsize = np.dtype(producer.dtype).itemsize
            size = math.prod(consumer.input_shapes[k]) * itemsize
            simulated += itemsize * sum(
                forward for i, j, forward, _ in taskgraph.overlaps(
                    producer, producer.outputs.index(tensor), source.dims,
                    consumer, k, sink.dims)
                if sink.device_ids[i] != source.device_ids[j])
            others = set(sink.device_ids) - {source.device_ids[0]}
            moved += size * (len(source.device_ids) - 1) + size * len(others)
    return edges, simulated, moved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES))
    args = parser.parse_args(argv)
    print("| strategy | cross-mesh edges | simulated MB | runtime MB | ratio |")
    print("|---|---|---|---|---|")
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
        edges, simulated, moved = cross_mesh_bytes(graph, strategy)
        ratio = moved / simulated if simulated else math.inf
        print(f"| {example} {machine_name} | {edges} | {simulated / 1e6:.1f}"
              f" | {moved / 1e6:.1f} | {ratio:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
