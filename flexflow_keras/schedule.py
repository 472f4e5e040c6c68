"""List scheduling of a compiled task graph over serial resources.

`compile_pieces` lays the pieces of `taskgraph` out in flat lists (the
hot loop touches only lists of floats and ints). `Schedule.run` is
event-driven list scheduling: the ready task with the earliest ready
time (ties: lowest canonical priority) starts when all its resources
(a device, or the links of a route or ring) are free, and holds them all
until it ends. Durations are positive, so tasks leave the queue in
increasing (ready time, priority) order; that order is what a delta
re-run replays.
"""

import heapq

from flexflow_keras.taskgraph import SELF, Piece


class Compiled:
    """A task graph in flat lists.

    Args:
        pieces: The pieces, in slot order.
        op_slots: Per op index, the slot of its op piece.
    """

    def __init__(self, pieces: list[Piece], op_slots: list[int]):
        self.pieces = pieces
        self.op_slots = op_slots
        dur: list[float] = []
        res: list[tuple[int, ...]] = []
        prio: list[int] = []
        bases: list[int] = []
        for p in pieces:
            bases.append(len(dur))
            dur += p.durations_ms
            res += p.resources
            prio += p.priorities
        n = len(dur)
        op_base = [bases[s] for s in op_slots]
        succ: list[list[int]] = [[] for _ in range(n)]
        npred = [0] * n
        for p, base in zip(pieces, bases):
            for so, sl, do, dl in p.deps:
                s = (base if so == SELF else op_base[so]) + sl
                d = (base if do == SELF else op_base[do]) + dl
                succ[s].append(d)
                npred[d] += 1
        self.dur, self.res, self.prio = dur, res, prio
        self.succ, self.npred, self.bases = succ, npred, bases
        self.busy_ms = [x for p in pieces for x in p.busy_ms]
        self.memory_bytes = [x for p in pieces for x in p.memory_bytes]
        self.comm_bytes = sum(p.comm_bytes for p in pieces)

    @property
    def num_tasks(self) -> int:
        return len(self.dur)

    def labels(self) -> list[tuple[int, str, str]]:
        return [label for p in self.pieces for label in p.labels]

    def replace(
        self, pieces: list[Piece], changed: tuple[int, ...]
    ) -> "Compiled":
        """The graph with `pieces` (slots `changed` differ from self's)."""
        del changed
        return Compiled(pieces, self.op_slots)


def compile_pieces(pieces: list[Piece], op_slots: list[int]) -> Compiled:
    return Compiled(pieces, op_slots)


class Schedule:
    """Start and end times (ms) of every task; `step_ms` the makespan."""

    def __init__(self, start: list[float], end: list[float]):
        self.start, self.end = start, end
        self.step_ms = max(end) if end else 0.0

    @classmethod
    def run(cls, g: Compiled, num_resources: int) -> "Schedule":
        n = g.num_tasks
        dur, res, prio, succ = g.dur, g.res, g.prio, g.succ
        count = list(g.npred)
        ready = [0.0] * n
        start = [0.0] * n
        end = [0.0] * n
        free = [0.0] * num_resources
        heap = [(0.0, prio[t], t) for t in range(n) if count[t] == 0]
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        done = 0
        while heap:
            s, _, t = pop(heap)
            rs = res[t]
            for r in rs:
                if free[r] > s:
                    s = free[r]
            e = s + dur[t]
            for r in rs:
                free[r] = e
            start[t] = s
            end[t] = e
            done += 1
            for u in succ[t]:
                if e > ready[u]:
                    ready[u] = e
                c = count[u] - 1
                count[u] = c
                if c == 0:
                    push(heap, (ready[u], prio[u], u))
        assert done == n, "task graph has a cycle"
        out = cls(start, end)
        out.num_resources = num_resources
        return out

    def rerun(self, g: Compiled, old: Compiled) -> "Schedule":
        """Schedule of `g`, a small change of `old` (scheduled by self)."""
        del old
        return Schedule.run(g, self.num_resources)
