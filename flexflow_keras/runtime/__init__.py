"""Runs a strategy on TensorFlow DTensor with Keras's training loops.

`StrategyTrainer` goes before `keras.Model` in a model class's bases;
`attach_strategy(model, graph, strategy)` switches fit/evaluate/predict to
the strategy's per-op meshes and layouts; `detach_strategy` switches back.
`own_step_reasons(model)` says why a model must run its own step (and so
keep one mesh); `probe_graph(graph)` learns what DTensor runs of layers
the capability table does not list.
"""

from flexflow_keras import capabilities, devices
from flexflow_keras.runtime import fresh_state  # noqa: F401 - hooks Keras variables
from flexflow_keras.runtime import probe
from flexflow_keras.runtime.support import own_step_reasons
from flexflow_keras.runtime.trainer import StrategyTrainer
from flexflow_keras.runtime.trainer import attach_strategy
from flexflow_keras.runtime.trainer import detach_strategy

def probe_graph(graph):
    """`probe.probe_graph` on the attached devices.

    Not in DTensor's multi-client mode: a probe's collectives on one
    client's mesh would put its collective keys out of step with the
    other clients', and only client 0 plans, so the others would not
    apply what it learned; layers the capability table does not list
    are refused there, with the reason."""
    if devices.local_device_names() is not None:
        unlisted = [op.name for op in graph if probe.needs_probe(op)]
        if unlisted:
            raise ValueError(
                f"Ops {unlisted} are layers the capability table does not "
                "list (the script's own classes, or Keras layers not "
                "measured here); across several DTensor clients they "
                "cannot be probed. Train this model on one host, or "
                "replace those layers with listed Keras layers."
            )
        # Listed layers DTensor cannot run (lookups) are refused here too.
        return capabilities.apply_probes(graph, {})
    return probe.probe_graph(graph, devices.device_names())


def agreed_plan(model, batch_size, make_plan):
    """In DTensor's multi-client mode: client 0's plan (`make_plan()`)
    on every client (`clients.agreed_plan`)."""
    from flexflow_keras.keras_graph import build_graph
    from flexflow_keras.runtime import clients

    return clients.agreed_plan(
        make_plan, lambda: build_graph(model, batch_size),
        len(devices.device_names()), model.get_weights,
    )


__all__ = [
    "StrategyTrainer",
    "agreed_plan",
    "attach_strategy",
    "detach_strategy",
    "own_step_reasons",
    "probe_graph",
]
