"""Runs a strategy on TensorFlow DTensor with Keras's training loops.

`StrategyTrainer` goes before `keras.Model` in a model class's bases;
`attach_strategy(model, graph, strategy)` switches fit/evaluate/predict to
the strategy's per-op meshes and layouts; `detach_strategy` switches back.
`own_step_reasons(model)` says why a model must run its own step (and so
keep one mesh); `probe_graph(graph)` learns what DTensor runs of layers
the capability table does not list.
"""

from flexflow_keras import devices
from flexflow_keras.runtime import probe
from flexflow_keras.runtime.support import own_step_reasons
from flexflow_keras.runtime.trainer import StrategyTrainer
from flexflow_keras.runtime.trainer import attach_strategy
from flexflow_keras.runtime.trainer import detach_strategy

def probe_graph(graph):
    """`probe.probe_graph` on the attached devices."""
    return probe.probe_graph(graph, devices.device_names())


__all__ = [
    "StrategyTrainer",
    "attach_strategy",
    "detach_strategy",
    "own_step_reasons",
    "probe_graph",
]
