"""DTensor's all-reduce combining, chosen once per process by model size
(`make_device` makes DTensor's device with it, and synchronous:
`devices.synchronous_dtensor`).

DTensor merges independent all-reduces of a function into one
(`DTensorAllReduceCombineOptimization`). To find which are independent
it searches, for every pair of all-reduces, for a path between them
(`DependsOn`): a time that grows with the square of the all-reduce count
times the graph's size. Measured on 4 virtual CPUs (2026-11-26):

- ResNet-101 (`examples/resnet101.py --small`, 345 layer calls, data
  parallelism): the first step took 66-84 s with the pass (9 runs), 61%
  of it in `DependsOn` (py-spy), and 29-53 s without it (8 runs); the
  example's wall time 151.8 s against 51.5 s (`bench/overhead_bench.py`).
- Inception-v3 (313 layer calls): the first step the same either way
  (32.2 s with, 30.7 s without).
- The Transformer example (16 layer calls): 17-20 ms a step with the
  pass, 23-25 ms without (its all-reduces then run one by one).

DTensor reads the switch once, when it makes its device (the first
DTensor call of the process; with several DTensor clients, at import,
so the pass stays on there): later changes do nothing. So the first
model the process runs under a strategy (or probes) decides: a graph of
`DEEP_GRAPH_OPS` ops or more runs without the pass, a smaller one with
it. A user's own `DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION` wins.
"""

from typing import Any

from flexflow_keras import devices, settings

# Layer calls from which a model's first steps run without the pass.
DEEP_GRAPH_OPS = 200


def choose_for(graph: Any) -> bool | None:
    """Before DTensor's first use in this process: sets the switch for
    `graph` (unless the user set it). Returns whether combining is on,
    or None when DTensor's device exists already (nothing can change)."""
    if devices.dtensor_device_made():
        return None
    return settings.combine_all_reduces(len(graph) < DEEP_GRAPH_OPS)


def make_device(graph: Any) -> None:
    """Makes DTensor's device before its first use in this process, with
    all-reduce combining chosen for `graph` (`choose_for`), synchronous
    (`devices.synchronous_dtensor`). A device that exists already is left
    as it is."""
    choose_for(graph)
    devices.synchronous_dtensor()
