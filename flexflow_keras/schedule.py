"""List scheduling of a compiled task graph over serial resources.

`Compiled` lays the pieces of `taskgraph` out in flat lists with stable
task ids: replacing a piece kills its ids and appends new ones, touching
only the dependencies of the replaced pieces (copy on write), so a delta
costs what it changes, not what the graph holds.

`Schedule.run` is event-driven list scheduling: the ready task with the
earliest ready time (ties: lowest canonical priority) starts when all
its resources (a device, or the links of a route or ring) are free, and
holds them until it ends. A task is pushed when its last predecessor
ends, with a ready time no earlier than that predecessor's, so tasks
leave the queue in non-decreasing ready time. Hence `rerun` may keep the
old run's first k pops when each has a ready time below every changed
task's earliest possible one (see `_restart_pops`), rebuild the state
after them, and go on with the same loop: the result is bit for bit the
one a run from scratch gives.

Riders (`Piece.riders`): tasks that would pop right after a leader and
wake nothing take no queue entry of their own; `_ride` runs them with it.

The loop runs in C (`_listsched.c`, built by setup.py where a compiler
is) over typed arrays, making the same schedule bit for bit (tested);
without it, `_python_schedule` runs over lists, about 4x slower on an
InceptionV3 search walk.
"""

import bisect
import gc
import heapq
from array import array
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from flexflow_keras.taskgraph import SELF, Piece

try:  # the same loop compiled, built by setup.py where a C compiler is
    from flexflow_keras import _listsched
except ImportError:
    _listsched = None

DEAD = 1 << 60  # predecessor count of a killed task: never ready
RIDER = 1 << 59  # predecessor count of a rider: run with its leader
INF = float("inf")


@contextmanager
def no_gc() -> Iterator[None]:
    """Pauses the cyclic GC: our lists hold no cycles, and collections
    triggered by their allocation would double the run time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _rows(piece: Piece, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """(busy ms, memory bytes) per device of one piece, memoized on it."""
    rows = piece.derived.get("rows")
    if rows is None:
        busy = np.zeros(num_devices)
        memory = np.zeros(num_devices)
        for device, ms in piece.busy_ms:
            busy[device] += ms
        for device, num_bytes in piece.memory_bytes:
            memory[device] += num_bytes
        rows = (busy, memory)
        piece.derived["rows"] = rows
    return rows


def _res1_npred(piece: Piece) -> tuple[list[int], list[int]]:
    """Per task of a piece: its one resource (-1: several; a rider
    leader: `-2 - riders`) and initial predecessor count (riders: RIDER,
    never woken). Memoized on the piece."""
    found = piece.derived.get("res1_npred")
    if found is None:
        res1 = [r[0] if len(r) == 1 else -1 for r in piece.resources]
        npred = [0] * len(res1)
        for lead, count in piece.riders:
            res1[lead] = -2 - count
            npred[lead + 1:lead + 1 + count] = [RIDER] * count
        found = (res1, npred)
        piece.derived["res1_npred"] = found
    return found


def _resolved(
    deps: tuple[tuple[int, int, int, int], ...], base: int,
    op_base: list[int],
) -> list[tuple[int, int]]:
    """(source id, destination id) of each of a piece's dependencies
    (`Piece.deps`), the piece's first task at id `base` and op i's piece
    at `op_base[i]` (`Compiled._op_base`). A list made in one
    comprehension: through a generator, NMT on k80x64's delta
    simulations (tens of thousands of transfers' dependencies) spent a
    fifth of its search resuming it, and a full simulation of
    InceptionV3 was ~12% slower."""
    return [
        ((base if so == SELF else op_base[so]) + sl,
         (base if do == SELF else op_base[do]) + dl)
        for so, sl, do, dl in deps
    ]


class Compiled:
    """A task graph in flat lists indexed by stable task ids."""

    def __init__(self):
        self.pieces: list[Piece] = []
        self.op_slots: list[int] = []
        self.slot_base: list[int] = []
        # Per task id: typed arrays (the compiled loop reads them in
        # place) and lists of tuples/lists.
        self.dur = array("d")
        self.res1 = array("q")  # the one resource; -1: several (resm)
        self.resm: list[tuple[int, ...]] = []
        self.prio = array("q")
        self.succ: list[list[int]] = []
        self.npred = array("q")
        self.num_live = 0
        self.bare = False  # some task holds no resource
        self.busy: np.ndarray | None = None  # (slots, devices)
        self.memory: np.ndarray | None = None
        self.comm: np.ndarray | None = None  # (slots,)
        # Filled by `replace`, read by `Schedule.rerun`:
        self.killed: list[int] = []
        self.touched: set[int] = set()
        self.first_new = 0
        self.new_deps: list[tuple[int, int]] = []
        self.sources: list[int] = []  # live tasks without predecessors

    @classmethod
    def build(
        cls, pieces: list[Piece], op_slots: list[int], num_devices: int
    ) -> "Compiled":
        g = cls()
        g.pieces, g.op_slots = list(pieces), op_slots
        g.slot_base = [0] * len(pieces)
        for k, p in enumerate(pieces):
            g._append(k, p)
        succ, npred = g.succ, g.npred
        op_base = g._op_base()
        for base, p in zip(g.slot_base, pieces):
            for s, d in _resolved(p.deps, base, op_base):
                succ[s].append(d)
                npred[d] += 1
        g.num_live = len(g.dur)
        rows = [_rows(p, num_devices) for p in pieces]
        g.busy = np.array([r[0] for r in rows]).reshape(-1, num_devices)
        g.memory = np.array([r[1] for r in rows]).reshape(-1, num_devices)
        g.comm = np.array([p.comm_bytes for p in pieces])
        g.first_new = len(g.dur)
        g.sources = [t for t in range(len(g.dur)) if npred[t] == 0]
        return g

    @property
    def num_tasks(self) -> int:
        return self.num_live

    @property
    def num_ids(self) -> int:
        return len(self.dur)

    @property
    def comm_bytes(self) -> float:
        return float(self.comm.sum())

    def busy_ms(self) -> np.ndarray:
        return self.busy.sum(axis=0)

    def memory_bytes(self) -> np.ndarray:
        return self.memory.sum(axis=0)

    def labels(self) -> dict[int, tuple[int, str, str | tuple]]:
        """Task id -> label, live tasks only."""
        return {
            self.slot_base[k] + i: label
            for k, p in enumerate(self.pieces)
            for i, label in enumerate(p.labels)
        }

    def _append(self, k: int, p: Piece) -> None:
        self.slot_base[k] = len(self.dur)
        n = len(p.durations_ms)
        self.dur.extend(p.durations_ms)
        self.prio.extend(p.priorities)
        self.resm += p.resources
        res1, npred = _res1_npred(p)
        if not self.bare and () in p.resources:
            self.bare = True
        self.res1.extend(res1)
        self.succ += [[] for _ in range(n)]
        self.npred.extend(npred)

    def _op_base(self) -> list[int]:
        """Per op index, the first task id of its op piece (what a
        piece's dependencies on other ops are relative to)."""
        return [self.slot_base[k] for k in self.op_slots]

    def replace(
        self, pieces: list[Piece], changed: tuple[int, ...]
    ) -> "Compiled":
        """A copy with the pieces of slots `changed` swapped for `pieces`'s.

        Copies the flat lists (cheap) and only the successor lists it
        edits; records killed ids, touched tasks (live, with changed
        predecessors) and the first new id for `Schedule.rerun`.
        """
        g = Compiled()
        g.pieces, g.op_slots = list(pieces), self.op_slots
        g.bare = self.bare
        g.slot_base = list(self.slot_base)
        g.dur, g.res1, g.resm = self.dur[:], self.res1[:], list(self.resm)
        g.prio, g.npred = self.prio[:], self.npred[:]
        g.succ = list(self.succ)
        g.first_new = len(g.dur)
        killed = set()
        for k in changed:
            base = self.slot_base[k]
            killed.update(range(base, base + len(self.pieces[k].durations_ms)))
        copied: set[int] = set()
        touched = self._unlink(g, changed, killed, copied)
        for t in killed:
            g.npred[t] = DEAD
            g.succ[t] = []
        for k in changed:
            g._append(k, pieces[k])
        new_deps = []
        op_base = g._op_base()
        for k in changed:
            for s, d in _resolved(pieces[k].deps, g.slot_base[k], op_base):
                new_deps.append((s, d))
                if s < g.first_new and s not in copied:
                    g.succ[s] = list(g.succ[s])
                    copied.add(s)
                g.succ[s].append(d)
                g.npred[d] += 1
                if d < g.first_new:
                    touched.add(d)
        g.killed = sorted(killed)
        g.touched = touched - killed
        npred = g.npred
        candidates = set(self.sources) | g.touched
        candidates.update(range(g.first_new, len(g.dur)))
        g.sources = [t for t in candidates if npred[t] == 0]
        g.new_deps = new_deps
        g.num_live = self.num_live - len(killed) + len(g.dur) - g.first_new
        g.busy, g.memory, g.comm = (
            self.busy.copy(), self.memory.copy(), self.comm.copy()
        )
        num_devices = g.busy.shape[1]
        for k in changed:
            g.busy[k], g.memory[k] = _rows(pieces[k], num_devices)
            g.comm[k] = pieces[k].comm_bytes
        return g

    def _unlink(
        self, g: "Compiled", changed: tuple[int, ...], killed: set[int],
        copied: set[int],
    ) -> set[int]:
        """Removes the old pieces' dependencies from `g`; returns the live
        tasks that lost a predecessor."""
        touched: set[int] = set()
        op_base = self._op_base()
        for k in changed:
            for s, d in _resolved(self.pieces[k].deps, self.slot_base[k],
                                  op_base):
                if d not in killed:
                    g.npred[d] -= 1
                    touched.add(d)
                if s not in killed:
                    if s not in copied:
                        g.succ[s] = list(g.succ[s])
                        copied.add(s)
                    g.succ[s].remove(d)
        return touched


class Schedule:
    """End times (ms) per task id, the pop order, and the makespan.

    Per-task state is in arrays for the C loop, lists for the Python one
    (see `_zeros`); either reads the same by index.
    """

    def __init__(self):
        self.end: array | list = _zeros("d", 0)
        self.order: array | list = _zeros("q", 0)  # task ids, pop order
        self.ready: array | list = _zeros("d", 0)  # ready time per id
        self.step_ms = 0.0
        self.num_resources = 0
        self.restart_pops = 0  # pops kept from the previous run

    def start(self, g: Compiled, t: int) -> float:
        """Start of task `t` (for traces; end minus duration)."""
        return self.end[t] - g.dur[t]

    @classmethod
    def run(cls, g: Compiled, num_resources: int) -> "Schedule":
        """Schedules `g` from scratch."""
        n = g.num_ids
        out = cls()
        out.num_resources = num_resources
        out.end, out.ready = _zeros("d", n), _zeros("d", n)
        out.order = _zeros("q", g.num_live)
        _schedule(g, out, 0)
        return out

    def rerun(self, g: Compiled) -> "Schedule":
        """Schedule of `g`, made by `replace` from the graph self is of.

        Keeps the first k pops of self (they are the same in `g`),
        rebuilds the queue, counts and resource times after them, and
        runs the same loop over the rest.
        """
        k = self._restart_pops(g)
        n, old_n = g.num_ids, len(self.end)
        out = Schedule()
        out.num_resources, out.restart_pops = self.num_resources, k
        out.end = self.end + _zeros("d", n - old_n)
        for t in g.killed:
            out.end[t] = 0.0  # so the makespan is max(end)
        out.ready = _zeros("d", n)
        out.order = _zeros("q", g.num_live)
        out.order[:k] = self.order[:k]
        _schedule(g, out, k)
        return out

    def _restart_pops(self, g: Compiled) -> int:
        """How many of self's pops a run of `g` makes identically.

        A changed task (new, or old with changed predecessors) cannot be
        ready before every old predecessor it has in the new graph ends;
        one with no predecessor may be ready at 0; one whose listed
        predecessors are all new waits for them. The kept pops must have
        ready times below all these bounds and include no killed or
        changed task. Pops leave in non-decreasing ready time, so the
        first k pops are the tasks readied below the bound: a killed or
        changed task (all were popped) is among them iff its ready time
        is, and no set of the k pops need be built.
        """
        end, first_new = self.end, g.first_new
        bound: dict[int, float] = {}
        for s, d in g.new_deps:
            if s < first_new:
                e = end[s]
                if e > bound.get(d, -1.0):
                    bound[d] = e
            elif d not in bound:
                bound[d] = INF
        lowest = min(bound.values(), default=INF)
        for t in g.touched:
            if t not in bound:
                lowest = 0.0  # only lost predecessors: no bound known
        npred = g.npred
        for t in range(first_new, g.num_ids):
            if npred[t] == 0:
                lowest = 0.0
                break
        k = bisect.bisect_left(
            self.order, lowest, key=self.ready.__getitem__
        )
        ready = self.ready
        hits = [t for t in g.killed if ready[t] < lowest]
        hits += [t for t in g.touched if ready[t] < lowest]
        if hits:
            k = min(self.order.index(t, 0, k) for t in hits)
        return k


def _zeros(typecode: str, n: int) -> array | list:
    """Zeros for the schedule's per-task state: an array the C loop
    writes in place, or a list for the Python loop (CPython indexes
    lists faster: ~30% of a small graph's delta simulation)."""
    if _listsched is None:
        return [0.0] * n if typecode == "d" else [0] * n
    return array(typecode, bytes(8 * n))


def _schedule(g: Compiled, out: Schedule, kept: int) -> None:
    """Replays `out.order[:kept]`, then pops tasks until none is left.

    Fills `out.end`, `out.ready`, `out.order` and `out.step_ms`. Runs
    `_listsched.schedule` (C, the same steps) when it was built, else
    `_python_schedule`.
    """
    if _listsched is not None:
        out.step_ms = _listsched.schedule(
            g.dur, g.res1, g.resm, g.prio, g.succ, g.npred, g.sources,
            out.end, out.ready, out.order, kept, out.num_resources, g.bare,
        )
        return
    order = out.order[:kept]
    out.step_ms = _python_schedule(
        g, out.end, out.ready, order, out.num_resources
    )
    if len(order) != g.num_live:
        raise ValueError(
            f"The task graph has a cycle: {len(order)} of {g.num_live} "
            "tasks could be scheduled."
        )
    out.order = order


def _python_schedule(
    g: Compiled, end: list, ready: list, order: list, num_resources: int
) -> float:
    """`_schedule` in Python over lists, in place (`order` grows from
    the kept pops): the reference the compiled one must equal. Returns
    the makespan."""
    count = g.npred.tolist()
    free = [0.0] * num_resources
    # Lists, not the arrays, for the reason in `_zeros`; once per run.
    dur, res1, prio = g.dur.tolist(), g.res1.tolist(), g.prio.tolist()
    resm, succ = g.resm, g.succ
    woken = list(g.sources)
    for t in order:
        e = end[t]
        count[t] = -1  # popped: not queued again below
        r = res1[t]
        if r >= 0:
            free[r] = e
        else:
            if r < -1:  # riders (next pops) share the leader's ready
                ready[t + 1:t - 1 - r] = [ready[t]] * (-2 - r)
            for r in resm[t]:
                free[r] = e
        for u in succ[t]:
            if e > ready[u]:
                ready[u] = e
            c = count[u] - 1
            count[u] = c
            if c == 0:
                woken.append(u)
    # No task is woken twice; the popped ones were marked above.
    heap = [(ready[u], prio[u], u) for u in woken if count[u] == 0]
    heapq.heapify(heap)
    _python_loop(dur, res1, resm, prio, succ, end, order, heap, count,
                 ready, free)
    if g.bare:
        return max(end, default=0.0)  # dead ids end at 0
    # Each task ends no earlier than its resources were free and leaves
    # them free at its end: the last end per resource is the latest of
    # all, found in far fewer reads than there are ids.
    return max(free, default=0.0)


def _python_loop(
    dur: list[float],
    res1: list[int],
    resm: list[tuple[int, ...]],
    prio: list[int],
    succ: list[list[int]],
    end: list[float],
    order: list[int],
    heap: list,
    count: list[int],
    ready: list[float],
    free: list[float],
) -> None:
    """Pops tasks until none is left.

    The popped task stays at the heap's root while it is scheduled; its
    first woken successor replaces it (one sift instead of a pop and a
    push). Keys are unique, so the pop sequence is the same.
    """
    add_order = order.append
    pop, push = heapq.heappop, heapq.heappush
    replace = heapq.heapreplace
    while heap:
        s, _, t = heap[0]
        r = res1[t]
        if r >= 0:
            f = free[r]
            e = (f if f > s else s) + dur[t]
            free[r] = e
        elif r == -1:
            rs = resm[t]
            for r in rs:
                if free[r] > s:
                    s = free[r]
            e = s + dur[t]
            for r in rs:
                free[r] = e
        else:
            _ride(t, -2 - r, s, dur, resm, end, order, ready, free)
            pop(heap)
            continue
        end[t] = e
        add_order(t)
        wake = replace  # then push
        for u in succ[t]:
            if e > ready[u]:
                ready[u] = e
            c = count[u] - 1
            count[u] = c
            if not c:
                wake(heap, (ready[u], prio[u], u))
                wake = push
        if wake is replace:
            pop(heap)


def _ride(
    t: int, riders: int, s: float, dur: list[float], resm: list[tuple],
    end: list[float], order: list[int], ready: list[float],
    free: list[float],
) -> None:
    """Runs leader `t` (ready at `s`) and its riders, one device each.

    They would pop one after another: same ready time, next priorities
    (no other task's key falls between), and none wakes a task; on
    distinct devices, each starts when its own device is free.
    """
    add_order = order.append
    for v in range(t, t + 1 + riders):
        r = resm[v][0]
        f = free[r]
        e = (f if f > s else s) + dur[v]
        free[r] = e
        end[v] = e
        ready[v] = s
        add_order(v)
