"""Runs a strategy on TensorFlow DTensor with Keras's training loops.

`StrategyTrainer` goes before `keras.Model` in a model class's bases;
`attach_strategy(model, graph, strategy)` switches fit/evaluate/predict to
the strategy's per-op meshes and layouts; `detach_strategy` switches back.
`own_step_reasons(model)` says why a model must run its own step (and so
keep one mesh). Importing it turns on DTensor's replicated fallback for
the ops in `op_rules.REPLICATED_OPS`.
"""

from flexflow_keras.runtime import op_rules
from flexflow_keras.runtime.support import own_step_reasons
from flexflow_keras.runtime.trainer import StrategyTrainer
from flexflow_keras.runtime.trainer import attach_strategy
from flexflow_keras.runtime.trainer import detach_strategy

op_rules.enable()

__all__ = [
    "StrategyTrainer",
    "attach_strategy",
    "detach_strategy",
    "own_step_reasons",
]
