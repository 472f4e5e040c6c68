"""Run one script as several DTensor clients ("hosts") on this machine.

    python -m flexflow_keras.launch --hosts N --devices-per-host M \\
        [--port P] SCRIPT [ARGS...]

Starts the unmodified script N times, as DTensor's multi-client mode
expects one process per host: each with `DTENSOR_CLIENT_ID` (0..N-1),
`DTENSOR_NUM_CLIENTS`, `DTENSOR_JOB_NAME` and `DTENSOR_JOBS` (loopback
addresses, ports P..P+N-1, free ones when no `--port`), and M virtual CPU
devices (or, with GPUs, GPUs k*M..k*M+M-1 through
`CUDA_VISIBLE_DEVICES`). On a real cluster the scheduler sets the same
variables (docs/MULTIHOST.md). TensorFlow's own coordination service and
collectives carry the traffic; nothing here is a transport.

Output is streamed line by line with a `[host k]` prefix. The launcher
exits with the first non-zero status a host returns, after stopping the
others (SIGTERM, then SIGKILL after `STOP_GRACE_S`: TensorFlow catches
SIGTERM and a DTensor client keeps running through it); 0 when all
succeed. The package's own flags (`--budget`, `--seed`, ...) anywhere on
the command line reach every host as `FLEXFLOW_KERAS_*` variables.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from flexflow_keras import settings as settings_lib

JOB_NAME = "worker"
STOP_GRACE_S = 2.0
POLL_S = 0.1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flexflow_keras.launch",
        description="Run SCRIPT once per host as DTensor clients on "
        "loopback.",
    )
    parser.add_argument("--hosts", type=int, required=True,
                        help="Processes (DTensor clients) to start.")
    parser.add_argument("--devices-per-host", type=int, required=True,
                        help="Devices each host owns: virtual CPUs, or "
                        "GPUs when the machine has them.")
    parser.add_argument("--port", type=int, default=None,
                        help="First of the hosts' ports (P..P+N-1); "
                        "default: free ports.")
    parser.add_argument("script", help="The training script.")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="The script's own arguments.")
    return parser


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def host_environments(
    hosts: int, devices_per_host: int, ports: Sequence[int],
    base: dict[str, str], gpus: int = 0,
) -> list[dict[str, str]]:
    """Each host's environment: the DTensor client variables, its devices
    and the package's flags taken from the launcher's command line."""
    jobs = ",".join(f"localhost:{port}" for port in ports)
    flags = {
        settings_lib.ENV_PREFIX + field.upper(): str(value)
        for field, value in settings_lib.command_line().items()
    }
    envs = []
    for k in range(hosts):
        env = dict(base)
        env.update(flags)
        env.update({
            "DTENSOR_CLIENT_ID": str(k),
            "DTENSOR_NUM_CLIENTS": str(hosts),
            "DTENSOR_JOB_NAME": JOB_NAME,
            "DTENSOR_JOBS": jobs,
            "PYTHONUNBUFFERED": "1",
        })
        if gpus:
            first = k * devices_per_host
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(g) for g in range(first, first + devices_per_host)
            )
        else:
            env[settings_lib.ENV_PREFIX + "CPU_DEVICES"] = str(
                devices_per_host
            )
        envs.append(env)
    return envs


def _stream(k: int, pipe, lock: threading.Lock) -> None:
    for line in iter(pipe.readline, ""):
        with lock:
            sys.stdout.write(f"[host {k}] {line}")
            if not line.endswith("\n"):
                sys.stdout.write("\n")
            sys.stdout.flush()
    pipe.close()


def _stop(processes: list[subprocess.Popen]) -> None:
    live = [p for p in processes if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in live:
        try:
            p.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(
    script: str, args: Sequence[str], hosts: int, devices_per_host: int,
    port: int | None = None,
) -> int:
    """Starts the hosts, streams their output, returns the exit status."""
    if hosts < 1 or devices_per_host < 1:
        raise ValueError(
            "`--hosts` and `--devices-per-host` must be >= 1. Received: "
            f"hosts={hosts}, devices_per_host={devices_per_host}"
        )
    if not os.path.exists(script):
        raise ValueError(
            f"No such script: {script!r}. Give the path of a Python "
            "training script."
        )
    ports = (list(range(port, port + hosts)) if port is not None
             else free_ports(hosts))
    gpus = _gpu_count()
    if gpus and gpus < hosts * devices_per_host:
        raise ValueError(
            f"{hosts} hosts x {devices_per_host} devices need "
            f"{hosts * devices_per_host} GPUs; this machine has {gpus}. "
            "Use fewer hosts or devices per host."
        )
    envs = host_environments(hosts, devices_per_host, ports,
                             dict(os.environ), gpus)
    lock = threading.Lock()
    processes, threads = [], []
    for k, env in enumerate(envs):
        p = subprocess.Popen(
            [sys.executable, script, *args], env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1,
        )
        processes.append(p)
        t = threading.Thread(target=_stream, args=(k, p.stdout, lock),
                             daemon=True)
        t.start()
        threads.append(t)
    status = 0
    try:
        while status == 0 and any(p.poll() is None for p in processes):
            for k, p in enumerate(processes):
                code = p.poll()
                if code:
                    status = code if code > 0 else 128 - code
                    with lock:
                        print(f"[launch] host {k} exited with status "
                              f"{code}; stopping the other hosts.",
                              flush=True)
                    break
            time.sleep(POLL_S)
        if status == 0:
            for k, p in enumerate(processes):
                if p.returncode:
                    status = p.returncode
                    break
    except KeyboardInterrupt:
        status = 130
    finally:
        _stop(processes)
        for t in threads:
            t.join(timeout=STOP_GRACE_S)
    return status


def _gpu_count() -> int:
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args.script, args.args, args.hosts,
                   args.devices_per_host, args.port)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
