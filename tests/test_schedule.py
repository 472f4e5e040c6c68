"""List scheduling over serial resources (schedule.py), on hand-made
pieces whose makespans are worked out here: serial resources, overlap,
dependencies, tasks holding several resources (links of a route), the
priority tie-break, and delta re-runs equal to runs from scratch."""

import random
import unittest
from unittest import mock

from flexflow_keras import schedule
from flexflow_keras.schedule import Compiled, Schedule
from flexflow_keras.taskgraph import SELF, Piece

DEVICES = 3


def piece(tasks, deps=()):
    """A piece from (ms, resources) per task; priority = task order."""
    return Piece(
        durations_ms=tuple(ms for ms, _ in tasks),
        resources=tuple(tuple(r) for _, r in tasks),
        priorities=tuple(range(len(tasks))),
        labels=tuple((0, "op", str(i)) for i in range(len(tasks))),
        deps=tuple((SELF, a, SELF, b) for a, b in deps),
    )


def run(*pieces, resources=DEVICES):
    g = Compiled.build(list(pieces), list(range(len(pieces))), DEVICES)
    return g, Schedule.run(g, resources)


def ends(g, s):
    """End time per live task, in task-id order."""
    return [s.end[t] for t in range(g.num_ids)
            if g.npred[t] != schedule.DEAD]


class ListSchedulingTest(unittest.TestCase):
    def test_one_resource_runs_its_tasks_one_after_another(self):
        g, s = run(piece([(2.0, [0]), (3.0, [0]), (1.0, [0])]))
        self.assertEqual(s.step_ms, 6.0)
        self.assertEqual(ends(g, s), [2.0, 5.0, 6.0])  # priority order

    def test_tasks_on_other_resources_overlap(self):
        _, s = run(piece([(2.0, [0]), (3.0, [1]), (1.0, [2])]))
        self.assertEqual(s.step_ms, 3.0)

    def test_a_task_waits_for_its_predecessors(self):
        g, s = run(piece([(2.0, [0]), (3.0, [1]), (1.0, [2])],
                         deps=[(0, 2), (1, 2)]))
        self.assertEqual(ends(g, s), [2.0, 3.0, 4.0])
        self.assertEqual(s.start(g, 2), 3.0)

    def test_a_task_on_several_resources_holds_them_all(self):
        # Task 1 (a route over resources 0 and 1) starts when task 0
        # frees resource 0 and holds resource 1 too; task 2 on resource
        # 1 comes after it in priority, so it waits for both, although
        # resource 1 was free at time 0 (no backfilling).
        g, s = run(piece([(2.0, [0]), (3.0, [0, 1]), (1.0, [1])]))
        self.assertEqual(ends(g, s), [2.0, 5.0, 6.0])
        self.assertEqual(s.start(g, 1), 2.0)

    def test_ready_ties_go_by_priority(self):
        swapped = Piece(durations_ms=(1.0, 1.0), resources=((0,), (0,)),
                        priorities=(1, 0), labels=((0, "a", ""),) * 2)
        _, s = run(swapped)
        self.assertEqual(list(s.order), [1, 0])
        _, s = run(piece([(1.0, [0]), (1.0, [0])]))
        self.assertEqual(list(s.order), [0, 1])

    def test_dependencies_across_pieces(self):
        a = piece([(2.0, [0])])
        b = Piece(durations_ms=(1.0,), resources=((1,),), priorities=(1,),
                  labels=((0, "b", ""),), deps=((0, 0, SELF, 0),))
        g, s = run(a, b)
        self.assertEqual(s.step_ms, 3.0)
        self.assertEqual(s.start(g, 1), 2.0)


def random_piece(rng, tasks, base_prio):
    deps = [(a, b) for b in range(tasks) for a in range(b)
            if rng.random() < 0.3]
    return Piece(
        durations_ms=tuple(rng.choice((0.5, 1.0, 2.0, 3.5))
                           for _ in range(tasks)),
        resources=tuple(
            tuple(rng.sample(range(DEVICES), rng.choice((1, 1, 2))))
            for _ in range(tasks)
        ),
        priorities=tuple(base_prio + i for i in range(tasks)),
        labels=tuple((0, "op", str(i)) for i in range(tasks)),
        deps=tuple((SELF, a, SELF, b) for a, b in deps),
    )


def chained(rng, sizes):
    """(pieces, op_slots): random op pieces of `sizes` tasks, and between
    consecutive ones a piece of no tasks whose one dependency puts the
    next op's first task after the op's last (as an edge piece does)."""
    pieces, op_slots = [], []
    for k, tasks in enumerate(sizes):
        if k:
            pieces.append(Piece(deps=((k - 1, sizes[k - 1] - 1, k, 0),)))
        op_slots.append(len(pieces))
        pieces.append(random_piece(rng, tasks, 100 * k))
    return pieces, op_slots


class DeltaRerunTest(unittest.TestCase):
    def test_rerun_after_replace_equals_a_run_from_scratch(self):
        rng = random.Random(0)
        kept_some = 0
        for trial in range(40):
            sizes = [rng.randint(1, 4) for _ in range(6)]
            pieces, slots = chained(rng, sizes)
            g = Compiled.build(pieces, slots, DEVICES)
            s = Schedule.run(g, DEVICES)
            # Another draw of one op's piece, as a delta simulation swaps
            # it, with the edge pieces beside it (they hold dependencies
            # on its tasks: the simulator's `touched` slots).
            k = slots[rng.randrange(len(sizes))]
            replaced = list(pieces)
            replaced[k] = chained(rng, sizes)[0][k]
            changed = tuple(j for j in (k - 1, k, k + 1)
                            if 0 <= j < len(pieces))
            new = g.replace(replaced, changed)
            delta = s.rerun(new)
            fresh = Compiled.build(replaced, slots, DEVICES)
            scratch = Schedule.run(fresh, DEVICES)
            with self.subTest(trial=trial, changed=k):
                self.assertEqual(delta.step_ms, scratch.step_ms)
                # Every task ends when it does in a run from scratch
                # (ids differ: a delta appends the new piece's tasks).
                self.assertEqual(sorted(ends(new, delta)),
                                 sorted(ends(fresh, scratch)))
            kept_some += delta.restart_pops > 0
        # Late changes keep the pops before them (the point of rerun).
        self.assertGreater(kept_some, 0)

    @unittest.skipIf(schedule._listsched is None,
                     "flexflow_keras._listsched is not built")
    def test_c_and_python_loops_make_the_same_schedule(self):
        rng = random.Random(1)
        for _ in range(20):
            pieces, slots = chained(rng, [rng.randint(1, 4)
                                          for _ in range(5)])
            g = Compiled.build(pieces, slots, DEVICES)
            in_c = Schedule.run(g, DEVICES)
            with mock.patch.object(schedule, "_listsched", None):
                in_python = Schedule.run(g, DEVICES)
            self.assertEqual(list(in_c.order), list(in_python.order))
            self.assertEqual(list(in_c.end), list(in_python.end))


if __name__ == "__main__":
    unittest.main()
