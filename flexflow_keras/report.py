"""What the planner says: the search's report and the strategy table.

Kept apart from `search.py` (which runs the search) so that printing a
plan (`Model.summary`, `python -m flexflow_keras show`) does not import
the search. Pure Python.
"""

import math
from collections.abc import Mapping
from typing import Any

from flexflow_keras.graph import OpGraph
from flexflow_keras.strategy import Strategy


def search_report(result: Any) -> str:
    """FlexFlow's "Best Discovered Strategy" block and the speed-up of a
    `search.SearchResult`."""
    if math.isinf(result.best_ms):
        summary = (
            "No strategy found fits in device memory (data parallelism "
            "included): use more devices, a smaller batch or a larger "
            "search budget."
        )
    else:
        summary = _against_data_parallel(
            "Best simulated step time", result.best_ms,
            result.data_parallel_ms,
            result.batch_split)
    lines = [
        "=========== Best Discovered Strategy ==========",
        result.strategy.to_text().rstrip("\n"),
        "============= MCMC Search Finished ============",
        f"{summary} after {result.iterations} iterations in "
        f"{result.wall_s:.1f} s.",
    ]
    if result.one_device_ms < result.best_ms:
        lines.append(
            f"On one device the simulator finds {result.one_device_ms:.3f}"
            " ms: these devices cannot speed the step up (virtual CPU "
            "devices share the host's cores). The search keeps to "
            "strategies over several devices; `--cpu-devices 1` trains "
            "on one."
        )
    return "\n".join(lines)


def _against_data_parallel(
    label: str, ms: float, data_parallel_ms: float,
    batch_split: tuple[int, int, int] | None = None,
) -> str:
    """`label`'s simulated step time `ms` (finite) against data
    parallelism's, as the search's and the import's reports say it.

    `batch_split` is (batch, parts, devices) of that data parallelism:
    where the batch splits fewer ways than there are devices (a batch of
    1 on 4 devices), the baseline splits other dims for the rest
    (`strategy.data_parallel_config`), and the line says so, so that a
    large speed-up is not read as one over splitting the batch."""
    if math.isinf(data_parallel_ms):
        return (f"{label}: {ms:.3f} ms; data parallelism does not fit in "
                "device memory.")
    speedup = data_parallel_ms / ms if ms > 0 else float("nan")
    baseline = f"data parallelism: {data_parallel_ms:.3f} ms"
    if batch_split is not None and batch_split[1] < batch_split[2]:
        batch, parts, devices = batch_split
        baseline += (
            f", where a batch of {batch} splits {parts} way"
            f"{'s' if parts > 1 else ''} over {devices} devices and other "
            "dims take the rest"
        )
    return (f"{label}: {ms:.3f} ms ({baseline}); simulated speed-up over "
            f"data parallelism: {speedup:.2f}x")


def batch_split(
    batch_size: int, data_parallel: Strategy, num_devices: int
) -> tuple[int, int, int]:
    """(batch, parts, devices) of a data-parallel baseline: how many ways
    its ops split the batch (the most any op does) over how many devices,
    for `_against_data_parallel`'s words."""
    parts = max((c.dims[0] for c in data_parallel.values()), default=1)
    return batch_size, parts, num_devices


def imported_report(
    path: str, strategy: Strategy, step_ms: float, data_parallel_ms: float,
    batch_split: tuple[int, int, int] | None = None,
) -> str:
    """What a plan from `--import-strategy` says in place of the search's
    report (it searched nothing): the strategy, where it came from, and
    its simulated step time against data parallelism's (`batch_split`
    as `search_report`'s)."""
    if math.isinf(step_ms):
        summary = ("Its simulated step does not fit in device memory; it "
                   "is used as imported.")
    else:
        summary = _against_data_parallel(
            "Simulated step time", step_ms, data_parallel_ms, batch_split)
        summary = summary.rstrip(".") + "."
    return "\n".join([
        "=========== Imported Strategy ==========",
        strategy.to_text().rstrip("\n"),
        "========================================",
        f"Strategy imported from {path} (no search). {summary}",
    ])


def strategy_table(
    graph: OpGraph,
    strategy: Strategy,
    per_op_ms: Mapping[str, float] | None = None,
    line_length: int = 98,
) -> str:
    """A `model.summary()`-style table of each op's parallel config.

    Args:
        graph: The model's `OpGraph`.
        strategy: A strategy for it.
        per_op_ms: Optional op name -> simulated time (ms) column.
        line_length: Total width of the table.

    Returns:
        The table as a string, one op a row, in graph order, after a row
        for each layer call run on the host before the step (a lookup on
        a raw feature: `TensorInfo.hosted_by`).
    """
    headers = ["Op (type)", "Output shape", "Split dims", "Devices"]
    rows = []
    for name in graph.hosted_inputs:
        info = graph.tensors[name]
        rows.append([f"{info.hosted_by} (before the step)",
                     str(info.shape), "none", "host"]
                    + [""] * (per_op_ms is not None))
    for op in graph:
        config = strategy[op.name]
        split = _split_text(op, config.dims)
        row = [
            f"{op.name} ({op.type})",
            str(op.output_shape),
            split,
            _ids_text(config.device_ids),
        ]
        if per_op_ms is not None:
            ms = per_op_ms.get(op.name)
            row.append("" if ms is None else f"{ms:.3f}")
        rows.append(row)
    if per_op_ms is not None:
        headers.append("Time (ms)")
    return _format_table(headers, rows, line_length)


def _split_text(op: Any, dims: tuple[int, ...]) -> str:
    parts = [
        f"{op.partitionable.get(dim, 'dim ' + str(dim))}={degree}"
        for dim, degree in enumerate(dims)
        if degree > 1
    ]
    return ", ".join(parts) or "none"


def _ids_text(ids: tuple[int, ...]) -> str:
    if len(ids) > 2 and ids == tuple(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def _format_table(
    headers: list[str], rows: list[list[str]], line_length: int
) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    total = sum(widths) + 2 * (len(widths) - 1)
    if total > line_length:
        # Shrink the first (name) column; names are cut with "…".
        widths[0] = max(12, widths[0] - (total - line_length))

    def fit(cell: str, width: int) -> str:
        return cell if len(cell) <= width else cell[: width - 1] + "…"

    def line(cells: list[str]) -> str:
        return "  ".join(
            fit(c, w).ljust(w) for c, w in zip(cells, widths)
        ).rstrip()

    rule = "─" * min(line_length, sum(widths) + 2 * (len(widths) - 1))
    body = [line(r) for r in rows]
    return "\n".join([rule, line(headers), rule, *body, rule])
