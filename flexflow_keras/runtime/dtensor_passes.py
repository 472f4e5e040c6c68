"""DTensor's device, made once per process with the settings it reads
only then: synchronous execution, and all-reduce combining chosen by
model size.

**Synchronous** (`make_device`). In DTensor's default asynchronous mode a
step that fails while it runs (a label outside the classes, an embedding
id past the table, an assertion in the user's code) cancels every later
DTensor op for the life of the process (measured on TF 2.21: each raises
`CancelledError`; DTensor's own recovery, a copy off the device, crashed
the process). A script could then neither train the model again once its
data was mended nor read back what it had trained. Synchronous, the
failed step raises its error and the next one runs. The cost is the
overlap of a step with the host's work for the next one (docs/RUNTIME.md
has the figures).

**All-reduce combining.**

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

from flexflow_keras import settings

# Layer calls from which a model's first steps run without the pass.
DEEP_GRAPH_OPS = 200


def choose_for(graph: Any) -> bool | None:
    """Before DTensor's first use in this process: sets the switch for
    `graph` (unless the user set it). Returns whether combining is on,
    or None when DTensor's device exists already (nothing can change)."""
    from tensorflow.dtensor.python import api

    # TensorFlow's module-level device; if a version renames it, the
    # device is taken to exist (the switch would then change nothing).
    if getattr(api, "_dtensor_singleton", True) is not None:
        return None
    return settings.combine_all_reduces(len(graph) < DEEP_GRAPH_OPS)


def make_device(graph: Any = None) -> None:
    """Makes DTensor's device before its first use in this process:
    synchronous, all-reduce combining chosen for `graph` (`choose_for`;
    None leaves the switch as it is). A device that exists already (the
    script used DTensor itself first) is left as it is."""
    from tensorflow.dtensor.python import api

    if getattr(api, "_dtensor_singleton", True) is not None:
        return
    if graph is not None:
        choose_for(graph)
    api.reset_dtensor_device(is_async=False)
