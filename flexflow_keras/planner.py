"""The compile-time pipeline: model -> OpGraph -> strategy (searched or read).

Why a module of its own: `models.py` only wires Keras to these stages,
and the command line (`python -m flexflow_keras`) plans the same way.
"""

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from flexflow_keras.graph import OpGraph
from flexflow_keras.keras_graph import build_graph
from flexflow_keras.optimizer_slots import optimizer_slots
from flexflow_keras import settings as settings_lib
from flexflow_keras.settings import Settings
from flexflow_keras.strategy import Strategy

@dataclasses.dataclass(frozen=True)
class Plan:
    """What compile() decided for one global batch size.

    Args:
        graph: The model's OpGraph at that batch size.
        strategy: The chosen strategy.
        source: `search`, `import`, `data_parallel`, or `one_device`
            (nothing over several virtual CPU devices fits in memory).
        search_result: The search's result, when one ran.
        machine: The machine model the strategy was planned for.
        step_ms: Simulated step time of the strategy.
        per_op_ms: Op name -> simulated forward + backward time of its
            slowest part, for `summary()`.
    """

    graph: OpGraph
    strategy: Strategy
    source: str
    search_result: Any = None
    machine: Any = None
    step_ms: float | None = None
    per_op_ms: Mapping[str, float] | None = None


def make_plan(
    model: Any,
    batch_size: int,
    settings: Settings,
    optimizer: Any = None,
    verbose: int | None = None,
    one_mesh_reason: str | None = None,
    probe: Callable[[OpGraph], OpGraph] | None = None,
    slots: int | None = None,
    print_fn: Callable[[str], None] | None = None,
) -> Plan:
    """Builds the graph and picks its strategy, per the settings.

    An imported strategy is used as is (no search); a budget of 0 keeps
    data parallelism; otherwise MCMC searches from data parallelism.

    `one_mesh_reason` (why the model runs its own training step, e.g.
    "it overrides train_step"; a shared layer's later calls give one too)
    keeps every op on one device mesh, which may have several axes
    (`mesh_space`): the search weighs the mesh shapes
    (`search.search_meshes`), data parallelism is the batch split over
    the 1-D mesh, and an imported strategy that is on no one mesh is
    replaced by a search, with a warning.

    `probe` (the runtime's `probe_graph`) learns what DTensor runs of the
    layers `capabilities.TABLE` does not list before anything is
    proposed; it raises `capabilities.Unsupported` for a layer that
    DTensor cannot run at all.

    `verbose` (None: `settings.search_verbose`): 0 silent, 1 a Keras
    progress bar (unless `print_fn` is given) and the chosen strategy, 2
    FlexFlow's lines instead of the bar; an imported strategy is printed
    at 1 and 2 with its file and simulated step time
    (`report.imported_report`).

    `slots` overrides the optimizer's state per weight (the command
    line's `--optimizer-slots`); `print_fn` is where the search's lines
    go (`print` when None).
    """
    from flexflow_keras import machine as machine_lib
    from flexflow_keras import report, search, search_space, simulator

    if verbose is None:
        verbose = settings.search_verbose
    from flexflow_keras import capabilities

    graph = build_graph(model, batch_size)
    if probe is not None:
        graph = probe(graph)
    splittable = graph  # before the optimizer's limits
    graph = capabilities.for_optimizer(graph, optimizer)
    machine = machine_lib.load_machine(settings.machine)
    num_devices = machine.num_devices
    if num_devices == 1 and not settings.import_strategy:
        # One device holds one strategy, every op whole on it (Keras's
        # own step): nothing to search, and no figure to price that any
        # choice depends on. Pricing it timed every op first: Inception-v3
        # (`examples/inception_v3.py --small`) reached its first step
        # 7.6 s after plain Keras did.
        return _exported(Plan(graph, Strategy.data_parallel(graph, 1),
                              "data_parallel", machine=machine), settings)
    sim = simulator.Simulator(
        graph, machine,
        optimizer_slots=optimizer_slots(optimizer) if slots is None
        else slots,
    )
    if one_mesh_reason is None:
        one_mesh_reason = _one_mesh_reason(graph)
    parts = None
    if one_mesh_reason is not None:
        parts = search_space.one_mesh_devices(graph, num_devices)
    plan = None
    if settings.import_strategy and graph is not splittable:
        tables = _tables_split(splittable, settings, machine)
        if tables:
            warnings.warn(
                f"{settings.import_strategy} splits the tables of Embedding "
                f"ops {tables}, which the "
                f"{type(optimizer).__name__} optimizer's sparse update "
                "cannot run on TensorFlow's DTensor "
                "(`capabilities.SPARSE_UPDATE_OPTIMIZERS`). Model "
                f"'{model.name}' trains under a strategy searched with the "
                "same budget instead.",
                stacklevel=2,
            )
            settings = dataclasses.replace(settings, import_strategy=None)
    if settings.import_strategy:
        plan = _imported(graph, settings, machine, parts)
        if plan is None:
            warnings.warn(
                f"{settings.import_strategy} places ops on several device "
                f"meshes, but model '{model.name}' runs its own training "
                f"step ({one_mesh_reason}), which runs on one mesh. It "
                f"trains under the best strategy on one mesh of {parts} "
                "devices instead (searched with the same budget).",
                stacklevel=2,
            )
    if plan is None and settings.search_budget == 0:
        strategy = (
            Strategy.data_parallel(graph, num_devices) if parts is None
            else search_space.one_mesh_data_parallel(graph, parts)
        )
        plan = Plan(graph, strategy, "data_parallel", machine=machine)
    elif plan is None:
        options = dict(
            budget=settings.search_budget,
            alpha=settings.search_alpha,
            seed=settings.search_seed,
            verbose=verbose,
            print_fn=print_fn,
        )
        if verbose == 1 and print_fn is None:
            from flexflow_keras.search_progress import progress_bar

            options["progress"] = progress_bar(settings.search_budget)
        if parts is None:
            result = search.search(
                graph, sim, num_devices,
                candidates=search_candidates(graph, num_devices), **options,
            )
        else:
            result = search.search_meshes(
                graph, sim, num_devices,
                meshes=search_space.planning_meshes(
                    parts, num_devices,
                    fewer=settings_lib.dtensor_clients() is None,
                ),
                **options,
            )
        plan = Plan(graph, result.strategy, "search", result, machine)
    if plan.source != "import":
        plan = _one_device_if_nothing_fits(model, plan, sim, machine)
    step_ms = sim.simulate(plan.strategy).step_ms
    if plan.source == "import" and verbose:
        # Nothing was searched, so nothing else says what it trains under.
        baseline = (
            Strategy.data_parallel(graph, num_devices) if parts is None
            else search_space.one_mesh_data_parallel(graph, parts)
        )
        (print_fn or print)(report.imported_report(
            settings.import_strategy, plan.strategy, step_ms,
            sim.simulate(baseline).step_ms,
            report.batch_split(graph.batch_size, baseline, num_devices),
        ))
    return dataclasses.replace(
        _exported(plan, settings),
        step_ms=step_ms,
        per_op_ms=per_op_ms(graph, plan.strategy, sim.cost),
    )


def _exported(plan: Plan, settings: Settings) -> Plan:
    """`plan`, its strategy written to `settings.export_strategy` if
    that names a file."""
    from flexflow_keras import strategy_files

    if settings.export_strategy:
        strategy_files.save_strategy(plan.strategy, settings.export_strategy)
    return plan


# What DTensor on virtual CPU devices holds for a step, against what the
# simulator counts for it (each part's saved outputs, weights, gradients
# and slots). Measured on TF 2.21, 2 cores, 4 devices, keras.io's
# Xception-like image classifier at 90x90 (`bench/memory_bench.py`): a
# step's peak resident memory grew by 2.70 and 2.83 GB (two runs) from
# batch 32 to 64 under data parallelism, against the simulator's 0.84 GB
# over the 4 devices (plain Keras on one device: 1.01 GB, the
# simulator's 0.84 GB). The simulator is not changed: a GPU holds what
# it computes.
DTENSOR_CPU_MEMORY_FACTOR = 3.4


def _one_device_if_nothing_fits(
    model: Any, plan: Plan, sim: Any, machine: Any
) -> Plan:
    """One device when no strategy over the host's virtual CPU devices
    fits in memory, but the whole model on one does.

    Why: virtual CPU devices share the host's memory, and the simulator
    gives each its share (what the search keeps to). A plan that does
    not fit it (a layer DTensor runs only replicated computes its whole
    batch on every device: keras.io's image_classification_from_scratch,
    180x180 images, SeparableConv2D) was trained anyway and the process
    was killed for memory, where plain Keras trains. On one device
    (Keras's own step) the model may use the whole host. What DTensor
    holds on virtual CPU devices is `DTENSOR_CPU_MEMORY_FACTOR` times
    what the simulator counts (with depthwise convolutions split, the
    same script planned data parallelism at 3.3 GiB a device and was
    killed at 24 GiB).

    The plan fits when what its devices hold together fits the host:
    one pool, as the factor was measured (all devices' growth against
    the simulator's sum). A plan over 2 of 4 devices may use half the
    host each (keras.io's transfer-learning guide, Xception at 150x150,
    batch 64: 6.3 GiB a device on 2 devices, over the 5.9 GiB share;
    it ran at a 16.2 GiB peak on a 23.5 GiB host, and had been sent to
    one device).
    """
    devices = machine.devices
    if (not machine.live or devices[0].kind != "CPU" or len(devices) < 2):
        return plan
    peaks = sim.simulate(plan.strategy).peak_memory_bytes
    host = sum(d.memory_bytes for d in devices)
    if sum(peaks) * DTENSOR_CPU_MEMORY_FACTOR <= host:
        return plan
    one = Strategy.data_parallel(plan.graph, 1)
    needs = sim.simulate(one).peak_memory_bytes[0]
    if needs > host:
        return plan
    gib = 2.0 ** 30
    warnings.warn(
        f"Model '{model.name}' trains on one device: no strategy over the "
        f"{len(devices)} virtual CPU devices fits in memory (they share "
        f"the host's {host / gib:.1f} GiB; the plan's step needs about "
        f"{sum(peaks) * DTENSOR_CPU_MEMORY_FACTOR / gib:.1f} GiB on its "
        f"{sum(1 for p in peaks if p)} devices under DTensor), and on one "
        f"device its step needs "
        f"{needs / gib:.1f} GiB. Use a smaller batch, or fewer devices "
        "(`--cpu-devices`), for a strategy over several.",
        stacklevel=3,
    )
    return dataclasses.replace(plan, strategy=one, source="one_device")


def search_candidates(
    graph: OpGraph, num_devices: int, one_mesh_parts: int | None = None
) -> tuple[Strategy, ...]:
    """The start points the search weighs against data parallelism: the
    model kind's expert strategy (`experts.py`) and data parallelism over
    each of `search_space.fewer_devices` (smallest first), except on one
    mesh, whose space they are not in."""
    from flexflow_keras import experts, search_space

    if one_mesh_parts is not None:
        return ()
    fewer = tuple(Strategy.data_parallel(graph, k)
                  for k in reversed(search_space.fewer_devices(num_devices)))
    return (experts.expert_strategy(graph, num_devices), *fewer)


def _one_mesh_reason(graph: OpGraph) -> str | None:
    """Why `graph`'s strategies must keep one mesh, beyond the model's
    own step (`runtime.own_step_reasons`), or None.

    - A shared layer's later calls: over several meshes each call's
      segment would update the layer's weights (`runtime.step`).
    - Layers of the user's own code (custom classes, `Lambda`): the
      probe (`runtime/probe.py`) runs them on one mesh with a split
      batch; what they do between segments of several meshes is not
      measured, and on one mesh a failure found when the step is first
      traced still hands the model to plain Keras before anything
      changed.
    - Layers run on the host before the step (`keras_graph.hosted_nodes`):
      their results reach the model's own step, which runs on one mesh
      (the layer-by-layer executor feeds only the model's inputs).
    - Inputs whose length changes from batch to batch
      (`TensorInfo.varying`): the model's own step traces one function
      for all lengths where DTensor allows (`varying_shapes`); the
      layer-by-layer executor's functions keep the graph's shapes.
    """
    varying = [t for t in graph.inputs if graph.tensors[t].varying]
    if varying:
        return (f"the length of inputs {varying} changes from batch to "
                "batch")
    hosted = sorted({graph.tensors[t].hosted_by for t in graph.hosted_inputs})
    if hosted:
        return f"ops {hosted} run on the host before the step"
    shared = [op.name for op in graph if op.shares_weights_with]
    if shared:
        return f"ops {shared} call a shared layer again"
    custom = [
        op.name for op in graph
        if op.type == "Lambda"
        or not type(op.layer).__module__.startswith("keras.")
    ]
    if custom:
        return f"ops {custom} run code of the script's own layers"
    return None


def _tables_split(
    graph: OpGraph, settings: Settings, machine: Any
) -> list[str]:
    """The Embedding ops whose tables the imported strategy splits."""
    from flexflow_keras import capabilities, strategy_files

    strategy = strategy_files.load_strategy(
        settings.import_strategy, graph, machine.num_devices
    )
    return [
        op.name for op in graph
        if op.type == "Embedding" and any(
            strategy[op.name].dims[d] > 1
            for d, kind in op.partitionable.items()
            if kind == capabilities.PARAMETER
        )
    ]


def _imported(
    graph: OpGraph, settings: Settings, machine: Any, parts: int | None
) -> Plan | None:
    """The imported strategy's plan; None when the model needs one mesh
    (`parts` devices) and the strategy uses several."""
    from flexflow_keras import search_space, strategy_files

    strategy = strategy_files.load_strategy(
        settings.import_strategy, graph, machine.num_devices
    )
    strategy, changed = search_space.tie_shared(graph, strategy)
    if changed:
        warnings.warn(
            f"{settings.import_strategy}: ops {changed} call a shared "
            "layer, whose calls run on its weights' devices: they take "
            "the config of the layer's first call instead of their "
            "own. Give every call of a shared layer the same config.",
            stacklevel=3,
        )
    if parts is not None and not search_space.is_one_mesh(
        strategy, machine.num_devices
    ):
        return None
    return Plan(graph, strategy, "import", machine=machine)


def per_op_ms(
    graph: OpGraph, strategy: Strategy, cost: Any
) -> dict[str, float]:
    """Forward + backward ms of each op's slowest part (for tables)."""
    return {
        op.name: max(
            sum(cost.op_cost(op, strategy[op.name], device))
            for device in strategy[op.name].device_ids
        )
        for op in graph
    }
