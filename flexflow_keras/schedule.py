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
import itertools
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
# A new task's successor list until `_link` makes it.
_NO_SUCCESSORS: list[int] = []


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


def _dep_array(piece: Piece) -> np.ndarray:
    """A piece's dependencies (`Piece.deps`) as an (n, 4) int64 array,
    memoized on it."""
    deps = piece.derived.get("deps")
    if deps is None:
        deps = np.fromiter(  # twice as fast as np.array on tuples
            itertools.chain.from_iterable(piece.deps), np.int64,
            4 * len(piece.deps),
        ).reshape(-1, 4)
        piece.derived["deps"] = deps
    return deps


def _resolved(
    pieces: list[Piece], bases: list[int], op_base: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(source ids, destination ids) of the dependencies of `pieces`
    (`Piece.deps`), in order, piece i's first task at id `bases[i]` and
    op j's piece at `op_base[j]` (`Compiled._op_base`). In arrays, all
    pieces at once: NMT on k80x64's delta simulations link tens of
    thousands of transfers' dependencies per proposal (resolved one by
    one in Python, a third of its search), and DLRM's change ten small
    pieces at a time."""
    arrays = [_dep_array(p) for p in pieces]
    if not arrays:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    deps = np.concatenate(arrays)
    base = np.repeat(np.asarray(bases, np.int64), [len(x) for x in arrays])
    so, sl, do, dl = deps.T
    src = np.where(so == SELF, base, op_base[so]) + sl
    dst = np.where(do == SELF, base, op_base[do]) + dl
    return src, dst


def _npred_view(g: "Compiled") -> np.ndarray:
    """`g.npred` as a writable int64 array over the same memory. Drop it
    before `g.npred` grows (an exported array cannot be resized)."""
    return np.frombuffer(g.npred, np.int64)


def _as_array(values, dtype) -> np.ndarray:
    """A schedule's per-task state (an array the C loop fills, or a list
    for the Python one, `_zeros`) as a NumPy array: a view of an array,
    a copy of a list (so write through it only where it is an array)."""
    if isinstance(values, array):
        return np.frombuffer(values, dtype)
    return np.asarray(values, dtype)


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
        self.killed = np.zeros(0, np.int64)
        self.touched: set[int] = set()
        self.first_new = 0
        # The new pieces' dependencies: (source ids, destination ids).
        self.new_deps = (np.zeros(0, np.int64), np.zeros(0, np.int64))
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
        g._link(*_resolved(pieces, g.slot_base, g._op_base()))
        g.num_live = len(g.dur)
        rows = [_rows(p, num_devices) for p in pieces]
        g.busy = np.array([r[0] for r in rows]).reshape(-1, num_devices)
        g.memory = np.array([r[1] for r in rows]).reshape(-1, num_devices)
        g.comm = np.array([p.comm_bytes for p in pieces])
        g.first_new = len(g.dur)
        npred = g.npred
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
        self.succ += [_NO_SUCCESSORS] * n  # made by `_link`
        self.npred.extend(npred)

    def _op_base(self) -> np.ndarray:
        """Per op index, the first task id of its op piece (what a
        piece's dependencies on other ops are relative to)."""
        slot_base = self.slot_base
        return np.array([slot_base[k] for k in self.op_slots], np.int64)

    def _link(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Adds dependencies `src[i]` -> `dst[i]`, in that order:
        successor lists and predecessor counts.

        An old task's list (id below `first_new`) is replaced by a longer
        one, never extended in place: the graph this one was made from
        shares it. The new tasks' lists are made whole, in one pass (NMT
        on k80x64 links ~3,000 dependencies a proposal, most from new
        transfers with one successor each)."""
        succ, first_new = self.succ, self.first_new
        order = np.argsort(src, kind="stable")
        src, targets = src[order], dst[order].tolist()
        cut = int(np.searchsorted(src, first_new))
        heads, starts = np.unique(src[:cut], return_index=True)
        bounds = starts.tolist() + [cut]
        for s, a, b in zip(heads.tolist(), bounds, bounds[1:]):
            succ[s] = succ[s] + targets[a:b]
        bounds = np.searchsorted(
            src, np.arange(first_new, len(succ) + 1)
        ).tolist()
        succ[first_new:] = [targets[a:b]
                            for a, b in zip(bounds, bounds[1:])]
        np.add.at(_npred_view(self), dst, 1)

    def replace(
        self, pieces: list[Piece], changed: tuple[int, ...]
    ) -> "Compiled":
        """A copy with the pieces of slots `changed` swapped for `pieces`'s.

        Copies the flat lists (cheap) and only the successor lists that
        gain entries; records killed ids, touched tasks (live, with
        changed predecessors) and the first new id for `Schedule.rerun`.

        A killed task stays in its live predecessors' successor lists:
        its count is `DEAD`, so no run readies it whatever it is woken
        by, and dropping it would cost a copy and a search of each list
        (`accept` lays the graph out afresh when killed ids pile up).
        """
        g = Compiled()
        g.pieces, g.op_slots = list(pieces), self.op_slots
        g.bare = self.bare
        g.slot_base = list(self.slot_base)
        g.dur, g.res1, g.resm = self.dur[:], self.res1[:], list(self.resm)
        g.prio, g.npred = self.prio[:], self.npred[:]
        g.succ = list(self.succ)
        g.first_new = first_new = len(g.dur)
        spans = [(self.slot_base[k], len(self.pieces[k].durations_ms))
                 for k in changed]
        killed = np.sort(np.concatenate(
            [np.arange(b, b + n, dtype=np.int64) for b, n in spans]
            or [np.zeros(0, np.int64)]
        ))
        lost = self._lost(changed, killed)
        for k in changed:
            g._append(k, pieces[k])
        src, dst = _resolved([pieces[k] for k in changed],
                             [g.slot_base[k] for k in changed], g._op_base())
        g._link(src, dst)
        npred = _npred_view(g)
        np.subtract.at(npred, lost, 1)
        for b, n in spans:
            npred[b:b + n] = DEAD
        g.killed = killed
        # New dependencies reach no killed task: they resolve against the
        # new graph's pieces.
        touched = set(lost.tolist())
        touched.update(dst[dst < first_new].tolist())
        g.touched = touched
        candidates = set(self.sources) | touched
        candidates.update(range(first_new, len(g.dur)))
        ids = np.fromiter(candidates, np.int64, len(candidates))
        g.sources = ids[npred[ids] == 0].tolist()
        del npred
        g.new_deps = (src, dst)
        g.num_live = self.num_live - len(killed) + len(g.dur) - first_new
        g.busy, g.memory, g.comm = (
            self.busy.copy(), self.memory.copy(), self.comm.copy()
        )
        num_devices = g.busy.shape[1]
        for k in changed:
            g.busy[k], g.memory[k] = _rows(pieces[k], num_devices)
            g.comm[k] = pieces[k].comm_bytes
        return g

    def _lost(self, changed: tuple[int, ...], killed: np.ndarray
              ) -> np.ndarray:
        """The live tasks that lose a predecessor when the pieces of
        slots `changed` (task ids `killed`) go, once per lost one."""
        dead = np.zeros(len(self.dur), bool)
        dead[killed] = True
        _, lost = _resolved([self.pieces[k] for k in changed],
                            [self.slot_base[k] for k in changed],
                            self._op_base())
        return lost[~dead[lost]]


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
        # So the makespan is max(end):
        if isinstance(out.end, array):
            np.frombuffer(out.end, np.float64)[g.killed] = 0.0
        else:
            for t in g.killed.tolist():
                out.end[t] = 0.0
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
        first_new = g.first_new
        src, dst = g.new_deps
        lowest, bounded = INF, dst
        if len(dst):
            # Per destination: the latest end of its old predecessors,
            # or INF where its first listed predecessor is new (it waits
            # for that one, whose own bound is among the rest). In
            # arrays: NMT on k80x64 bounds ~3,000 dependencies a proposal.
            old = src < first_new
            ends = np.where(
                old, _as_array(self.end, np.float64)[np.where(old, src, 0)],
                INF,
            )
            bounded, first, which = np.unique(
                dst, return_index=True, return_inverse=True
            )
            latest = np.full(len(bounded), -1.0)
            np.maximum.at(latest, which[old], ends[old])
            lowest = float(np.where(old[first], latest, INF).min())
        if not g.touched.issubset(bounded.tolist()):
            lowest = 0.0  # only lost predecessors: no bound known
        if 0 in g.npred[first_new:]:
            lowest = 0.0  # a new task with no predecessor: ready at 0
        k = bisect.bisect_left(
            self.order, lowest, key=self.ready.__getitem__
        )
        ready = _as_array(self.ready, np.float64)
        hits = np.concatenate([
            g.killed[ready[g.killed] < lowest],
            np.array([t for t in g.touched if ready[t] < lowest], np.int64),
        ])
        if len(hits):
            kept = _as_array(self.order, np.int64)[:k]
            k = int(np.flatnonzero(np.isin(kept, hits))[0])
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
