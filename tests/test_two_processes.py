"""The suite's two-process runner (`two_processes.py`) runs every file once
and fails the run when a file that the second process ran fails."""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

import two_processes

FILES = two_processes.MIN_FILES + 2


def _run(folder, failing=None, processes=None, pause=0.0):
    for i in range(FILES):
        body = textwrap.dedent(f"""
            import os
            import time

            def test_a():
                time.sleep({pause})
                with open(os.path.join({folder!r}, "ran"), "a") as f:
                    f.write("{i} %d\\n" % os.getpid())

            def test_b():
                assert {i} != {failing!r}
            """)
        with open(os.path.join(folder, f"test_f{i:02d}.py"), "w") as f:
            f.write(body)
    with open(os.path.join(folder, "conftest.py"), "w") as f:
        f.write("from two_processes import *\n")
    env = {k: v for k, v in os.environ.items()
           if k not in (two_processes.CLAIMS_ENV, two_processes.PROCESSES_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")])
    if processes:
        env[two_processes.PROCESSES_ENV] = processes
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", folder],
        cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    with open(os.path.join(folder, "ran")) as f:
        ran = [line.split() for line in f]
    return result, ran


class TwoProcessesTest(unittest.TestCase):
    def test_each_file_runs_once_and_a_failure_in_either_fails_the_run(self):
        if (os.cpu_count() or 1) < 2:
            self.skipTest("one core: the run stays in one process")
        # The last file is the first the second process claims; a second
        # a file gives it time to start before the first process is done.
        with tempfile.TemporaryDirectory() as folder:
            result, ran = _run(folder, failing=FILES - 1, pause=1.0)
        out = result.stdout + result.stderr
        self.assertEqual(result.returncode, 1, out)
        self.assertEqual(sorted(int(i) for i, _ in ran), list(range(FILES)),
                         out)
        self.assertEqual(len({pid for _, pid in ran}), 2, out)
        self.assertIn(f"FAILED test_f{FILES - 1:02d}.py::test_b", out)
        self.assertIn("the second process (exit 1)", out)

    def test_a_passing_run_passes_and_one_process_can_be_asked_for(self):
        with tempfile.TemporaryDirectory() as folder:
            result, ran = _run(folder)
        self.assertEqual(result.returncode, 0, result.stdout)
        self.assertEqual(len(ran), FILES)
        with tempfile.TemporaryDirectory() as folder:
            result, ran = _run(folder, failing=0, processes="1")
        self.assertEqual(result.returncode, 1, result.stdout)
        self.assertEqual(len({pid for _, pid in ran}), 1, result.stdout)
        self.assertNotIn("the second process", result.stdout)
