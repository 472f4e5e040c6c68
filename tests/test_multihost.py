"""Training across hosts: 2 DTensor clients x 2 virtual CPU devices on
loopback (`flexflow_keras.launch`) compute what one process with 4
devices computes, under data parallelism and under a strategy whose
meshes span both hosts (also a model running its own step on a 2 x 2
mesh); a lost host stops the other within 60 s."""

import os
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "multihost_train.py")

# Splits on the one mesh of all 4 devices, so every op's weights or
# batch are spread over both hosts.
STRATEGIES = {
    "mlp": (
        "[d0] num_dims(2) dims[1,4] device_ids[0,1,2,3]\n"
        "[d1] num_dims(2) dims[4,1] device_ids[0,1,2,3]\n"
        "[d2] num_dims(2) dims[1,4] device_ids[0,1,2,3]\n"
    ),
    "two_input": (
        "[da] num_dims(2) dims[1,4] device_ids[0,1,2,3]\n"
        "[db] num_dims(2) dims[4,1] device_ids[0,1,2,3]\n"
        "[cat] num_dims(2) dims[4,1] device_ids[0,1,2,3]\n"
        "[out] num_dims(2) dims[1,4] device_ids[0,1,2,3]\n"
    ),
    # Blocks of a 2 x 2 mesh, axis 0 across the hosts (devices 0, 2),
    # axis 1 within each (0, 1): batch x channels, channels across the
    # hosts, batch within them.
    "own_step": (
        "[d0] num_dims(2) dims[2,2] device_ids[0,1,2,3]\n"
        "[d1] num_dims(2) dims[1,2] device_ids[0,2]\n"
        "[d2] num_dims(2) dims[2,1] device_ids[0,1]\n"
    ),
}


def _run(command, timeout=240):
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    return done, time.monotonic() - start


def _solo(kind, out, *flags):
    return _run([sys.executable, SCRIPT, kind, out, "--cpu-devices", "4",
                 *flags])


def _launched(kind, out, *flags):
    return _run([sys.executable, "-m", "flexflow_keras.launch", "--hosts",
                 "2", "--devices-per-host", "2", SCRIPT, kind, out, *flags])


class MultiHostTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()

    def _compare(self, kind, *flags):
        solo_dir = os.path.join(self.dir, "solo")
        hosts_dir = os.path.join(self.dir, "hosts")
        os.makedirs(solo_dir)
        os.makedirs(hosts_dir)
        done, _ = _solo(kind, solo_dir, *flags)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        done, _ = _launched(kind, hosts_dir, *flags)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        solo = np.load(os.path.join(solo_dir, "solo.npz"))
        for client in ("0", "1"):
            got = np.load(os.path.join(hosts_dir, f"{client}.npz"))
            self.assertEqual(sorted(got.files), sorted(solo.files))
            for key in solo.files:
                np.testing.assert_allclose(
                    got[key], solo[key], rtol=1e-5, atol=1e-7,
                    err_msg=f"client {client}, {key}",
                )
        return done.stdout

    # Data parallelism is the searched strategies' special case (the
    # tests below); about 20 s each.
    @pytest.mark.slow
    def test_mlp_data_parallel(self):
        self._compare("mlp", "--budget", "0")

    @pytest.mark.slow
    def test_two_input_data_parallel(self):
        self._compare("two_input", "--budget", "0")

    # Slow: hosts feeding their own rows: the multi-host runs below feed
    # arrays; ~60 s
    @pytest.mark.slow
    def test_dataset_and_generator_inputs(self):
        """Each host feeds its own rows of every global batch, whatever
        fit() reads: the result is one process's."""
        for kind in ("dataset", "generator"):
            with self.subTest(kind):
                self.dir = tempfile.mkdtemp()
                self._compare("two_input", "--budget", "0", "--input", kind)

    def _strategy_file(self, kind):
        path = os.path.join(self.dir, f"{kind}.txt")
        with open(path, "w") as f:
            f.write(STRATEGIES[kind])
        return path

    # Slow: test_own_step_model_on_two_mesh_axes_across_hosts runs a split
    # strategy across hosts by default
    @pytest.mark.slow
    def test_mlp_strategy_across_hosts(self):
        out = self._compare("mlp", "--import",
                            self._strategy_file("mlp"))
        for client in (0, 1):
            self.assertIn(f"[host {client}] strategy: [d0] num_dims(2) "
                          "dims[1,4] device_ids[0,1,2,3]", out)

    # Slow: as above
    @pytest.mark.slow
    def test_two_input_strategy_across_hosts(self):
        self._compare("two_input", "--import",
                      self._strategy_file("two_input"))

    def test_own_step_model_on_two_mesh_axes_across_hosts(self):
        """A model that runs its own step (a `train_step` override and
        L2 regularizers) under a strategy on a 2 x 2 mesh whose outer
        axis crosses the hosts (issue 22)."""
        out = self._compare("own_step", "--import",
                            self._strategy_file("own_step"))
        for client in (0, 1):
            self.assertIn(f"[host {client}] executor: ModelStepExecutor "
                          "mesh: 2x2", out)

    def test_hosts_train_under_client_0s_search(self):
        out_dir = os.path.join(self.dir, "search")
        os.makedirs(out_dir)
        done, _ = _launched("mlp", out_dir, "--budget", "100")
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        lines = done.stdout.splitlines()
        # Only client 0 searches (and prints the search's report).
        self.assertTrue(any(l.startswith("[host 0] Best simulated")
                            for l in lines))
        self.assertFalse(any(l.startswith("[host 1] Best simulated")
                             for l in lines))
        found = {l.split("] ", 1)[0]: l.split("strategy: ", 1)[1]
                 for l in lines if "strategy: " in l}
        self.assertEqual(set(found), {"[host 0", "[host 1"})
        self.assertEqual(found["[host 0"], found["[host 1"])

    # Slow: the refusal before training; test_lost_host_stops_the_other keeps
    # a host-failure check by default
    @pytest.mark.slow
    def test_hosts_with_different_weights_stop_before_training(self):
        out_dir = os.path.join(self.dir, "differ")
        os.makedirs(out_dir)
        done, seconds = _launched("mlp", out_dir, "--budget", "0",
                                  "--differ")
        self.assertNotEqual(done.returncode, 0)
        self.assertLess(seconds, 60)
        self.assertRegex(
            done.stdout, r"\[host 1\] .*ClientsDisagree: DTensor clients "
            r"built different initial weight values: client 1's "
            r"\(fingerprint \w+\) is unlike client 0's"
        )
        self.assertEqual(os.listdir(out_dir), [])

    def test_lost_host_stops_the_other(self):
        out_dir = os.path.join(self.dir, "lost")
        os.makedirs(out_dir)
        done, seconds = _launched("mlp", out_dir, "--budget", "0",
                                  "--die-at-batch", "1")
        self.assertNotEqual(done.returncode, 0)
        self.assertLess(seconds, 60)
        self.assertIn("[host 1] client 1 dies now", done.stdout)
        self.assertIn("[launch] host 1 exited with status -9", done.stdout)
        self.assertFalse(os.path.exists(os.path.join(out_dir, "0.npz")))

    # Slow: as above
    @pytest.mark.slow
    def test_a_host_that_never_joins_stops_the_others(self):
        """Client 0 alone: it gives up after the join timeout instead of
        waiting for client 1 for ever."""
        from flexflow_keras import launch

        env = launch.host_environments(2, 2, launch.free_ports(2),
                                       dict(os.environ))[0]
        env["FLEXFLOW_KERAS_JOIN_TIMEOUT_S"] = "5"
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, SCRIPT, "mlp", self.dir, "--budget", "0"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertLess(time.monotonic() - start, 60)
        self.assertIn("Timeout (0:00:05)!", done.stderr)
        self.assertIn("in _join_all_clients", done.stderr)

    def test_survivor_names_the_lost_host_without_the_launcher(self):
        """As on a cluster, where no launcher stops the others: client 0
        finds out by itself."""
        from flexflow_keras import launch

        out_dir = os.path.join(self.dir, "alone")
        os.makedirs(out_dir)
        envs = launch.host_environments(2, 2, launch.free_ports(2),
                                        dict(os.environ))
        procs = [
            subprocess.Popen(
                [sys.executable, SCRIPT, "mlp", out_dir, "--budget", "0",
                 "--die-at-batch", "1"],
                env=env, cwd=ROOT, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True,
            )
            for env in envs
        ]
        try:
            out1, _ = procs[1].communicate(timeout=180)
            died = time.monotonic()
            out0, _ = procs[0].communicate(timeout=60)
            seconds = time.monotonic() - died
        finally:
            for p in procs:
                p.kill()
        self.assertEqual(procs[1].returncode, -9, out1)
        self.assertNotEqual(procs[0].returncode, 0, out0)
        self.assertLess(seconds, 60)
        self.assertIn("DTensor client 0 lost contact with host 1", out0)


if __name__ == "__main__":
    unittest.main()
