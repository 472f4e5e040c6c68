"""Simulated timeline as Chrome trace-event JSON (Perfetto, chrome://tracing).

One process for devices and one for links; one track (thread) per device
and per link. Each task is a complete event (`"ph": "X"`) on every
resource it holds, times in microseconds as the format wants.
"""

import json
from typing import Any

from flexflow_keras.machine import MachineModel
from flexflow_keras.schedule import Compiled, Schedule
from flexflow_keras.taskgraph import KIND_NAMES, detail_text

DEVICES_PID, LINKS_PID = 0, 1


def chrome_trace(
    machine: MachineModel, compiled: Compiled, schedule: Schedule
) -> dict[str, Any]:
    """The trace-event JSON object (`{"traceEvents": [...]}`)."""
    n = machine.num_devices
    events: list[dict[str, Any]] = [
        _meta("process_name", DEVICES_PID, 0, "devices"),
        _meta("process_name", LINKS_PID, 0, "links"),
    ]
    for d, spec in enumerate(machine.devices):
        events.append(_meta(
            "thread_name", DEVICES_PID, d, f"device {d} ({spec.kind}, "
            f"node {spec.node})"
        ))
    for k, link in enumerate(machine.links):
        events.append(_meta("thread_name", LINKS_PID, k, link.name))
    for t, (kind, op, detail) in compiled.labels().items():
        start_us = schedule.start(compiled, t) * 1e3
        dur_us = compiled.dur[t] * 1e3
        for r in compiled.resm[t]:
            pid, tid = (DEVICES_PID, r) if r < n else (LINKS_PID, r - n)
            events.append({
                "name": f"{KIND_NAMES[kind]} {op}",
                "cat": KIND_NAMES[kind],
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": start_us,
                "dur": dur_us,
                "args": {"op": op, "detail": detail_text(detail)},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str, trace: dict[str, Any]) -> None:
    """Writes a trace made by `chrome_trace` (or `Simulator.timeline`)."""
    with open(path, "w") as f:
        json.dump(trace, f)


def _meta(name: str, pid: int, tid: int, value: str) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid,
            "args": {"name": value}}
