"""The multi-host launcher: environments, output, exit status, stopping.

Scripts here are plain Python (no TensorFlow), so these run in seconds;
tests/test_multihost.py trains models across launched hosts.
"""

import os
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest
from unittest import mock

from flexflow_keras import launch, settings


def _launch(script: str, *args: str, hosts: int = 2, timeout: int = 120):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(script))
    try:
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "flexflow_keras.launch", "--hosts",
             str(hosts), "--devices-per-host", "2", f.name, *args],
            capture_output=True, text=True, timeout=timeout,
        )
        return done, time.monotonic() - start
    finally:
        os.unlink(f.name)


class LaunchTest(unittest.TestCase):
    def test_each_host_gets_its_client_environment(self):
        done, _ = _launch(
            """
            import os, sys
            keys = ("DTENSOR_CLIENT_ID", "DTENSOR_NUM_CLIENTS",
                    "DTENSOR_JOB_NAME", "FLEXFLOW_KERAS_CPU_DEVICES",
                    "FLEXFLOW_KERAS_SEARCH_BUDGET")
            print(*(os.environ.get(k) for k in keys), sys.argv[1:])
            print("jobs", os.environ["DTENSOR_JOBS"])
            """,
            "--budget", "7", "--mine", "x", hosts=3,
        )
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        lines = [l for l in done.stdout.splitlines()
                 if l.startswith("[host")]
        for k in range(3):
            self.assertIn(
                f"[host {k}] {k} 3 worker 2 7 ['--mine', 'x']", lines
            )
        jobs = {l.split("jobs ")[1] for l in lines if " jobs " in l}
        self.assertEqual(len(jobs), 1)  # every host sees the same list
        ports = [j.split(":")[1] for j in jobs.pop().split(",")]
        self.assertEqual(len(set(ports)), 3)

    def test_first_failure_stops_the_others_and_is_the_status(self):
        done, seconds = _launch(
            """
            import os, sys, time
            if os.environ["DTENSOR_CLIENT_ID"] == "1":
                print("failing", flush=True)
                sys.exit(3)
            time.sleep(300)
            """
        )
        self.assertEqual(done.returncode, 3)
        self.assertIn("[host 1] failing", done.stdout)
        self.assertIn("host 1 exited with status 3", done.stdout)
        self.assertLess(seconds, 60)

    def test_a_host_ignoring_sigterm_is_killed(self):
        done, seconds = _launch(
            """
            import os, signal, sys, time
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if os.environ["DTENSOR_CLIENT_ID"] == "0":
                sys.exit(5)
            time.sleep(300)
            """
        )
        self.assertEqual(done.returncode, 5)
        self.assertLess(seconds, 60)

    def test_missing_script_is_a_clear_error(self):
        done = subprocess.run(
            [sys.executable, "-m", "flexflow_keras.launch", "--hosts", "2",
             "--devices-per-host", "2", "no_such_script.py"],
            capture_output=True, text=True, timeout=120,
        )
        self.assertEqual(done.returncode, 2)
        self.assertIn("No such script: 'no_such_script.py'", done.stderr)

    def test_host_environments_on_gpus(self):
        envs = launch.host_environments(2, 2, [5000, 5001], {}, gpus=4)
        self.assertEqual([e["CUDA_VISIBLE_DEVICES"] for e in envs],
                         ["0,1", "2,3"])
        self.assertNotIn("FLEXFLOW_KERAS_CPU_DEVICES", envs[0])
        self.assertEqual(envs[1]["DTENSOR_JOBS"],
                         "localhost:5000,localhost:5001")


class HostOutputTest(unittest.TestCase):
    """Only client 0 prints and writes files, unless all hosts are asked
    to (`--all-hosts-output 1`)."""

    def test_other_clients_train_silently(self):
        import keras

        from flexflow_keras.runtime import clients

        checkpoint = keras.callbacks.ModelCheckpoint("m.keras")
        logger = keras.callbacks.CSVLogger("log.csv")
        own = keras.callbacks.LambdaCallback()
        given = [checkpoint, own, logger]
        with mock.patch.object(clients.devices, "client_id",
                               return_value=1):
            self.assertEqual(clients.host_fit_arguments(2, given),
                             (0, [own]))
            self.assertEqual(clients.host_fit_arguments(2, given, True),
                             (2, given))
        with mock.patch.object(clients.devices, "client_id",
                               return_value=0):
            self.assertEqual(clients.host_fit_arguments("auto", given),
                             ("auto", given))

    def test_setting_parses(self):
        self.assertTrue(settings.resolve(
            command_line={}, environ={
                "FLEXFLOW_KERAS_ALL_HOSTS_OUTPUT": "yes"}
        ).all_hosts_output)
        with self.assertRaisesRegex(ValueError, "Received: 'maybe'"):
            settings.resolve(command_line={}, environ={
                "FLEXFLOW_KERAS_ALL_HOSTS_OUTPUT": "maybe"})


class ClientsSettingTest(unittest.TestCase):
    def test_reads_the_dtensor_variables(self):
        self.assertIsNone(settings.dtensor_clients({}))
        self.assertIsNone(settings.dtensor_clients(
            {"DTENSOR_JOBS": "localhost:1"}
        ))
        clients = settings.dtensor_clients({
            "DTENSOR_JOBS": "h0:1,h1:1", "DTENSOR_CLIENT_ID": "1",
            "DTENSOR_NUM_CLIENTS": "2", "DTENSOR_JOB_NAME": "trainer",
        })
        self.assertEqual(clients, settings.Clients(1, 2, "trainer"))

    def test_join_timeout(self):
        self.assertEqual(settings.join_timeout_s({}),
                         settings.DEFAULT_JOIN_TIMEOUT_S)
        self.assertEqual(settings.join_timeout_s(
            {"FLEXFLOW_KERAS_JOIN_TIMEOUT_S": "7.5"}), 7.5)
        with self.assertRaisesRegex(ValueError, "> 0. Received: '0'"):
            settings.join_timeout_s({"FLEXFLOW_KERAS_JOIN_TIMEOUT_S": "0"})

    def test_rejects_inconsistent_variables(self):
        with self.assertRaisesRegex(ValueError, "0..1.*Received: '2'"):
            settings.dtensor_clients(
                {"DTENSOR_JOBS": "h0:1,h1:1", "DTENSOR_CLIENT_ID": "2"}
            )
        with self.assertRaisesRegex(ValueError, "NUM_CLIENTS=3"):
            settings.dtensor_clients({
                "DTENSOR_JOBS": "h0:1,h1:1", "DTENSOR_CLIENT_ID": "0",
                "DTENSOR_NUM_CLIENTS": "3",
            })


if __name__ == "__main__":
    unittest.main()
