"""Runs the test files of a long run in two processes, as pytest hooks.

Why: a test here spends its time tracing Keras steps and waiting for
DTensor's SPMD expansion, Python work on one core. The default suite ran
39 minutes on a 2-core machine while using 1.05 cores (`time`: user 39m49s,
real 38m). Two processes use both cores: 18.7 minutes for the same suite
less twelve tests marked slow (about 7 of the 39 minutes in one process).

How: the first process starts a second `pytest` with the same arguments.
Both walk the same collected test files, the first from the front and the
second from the back. Each claims a file (an exclusive create in a shared
folder) before it runs that file's tests, so every file runs once, in one
process, with its tests in order, and the two meet wherever the files'
durations put them. The first process waits for the second at the end,
prints the second's summary under its own and fails the run if the second
failed. Nothing is needed beyond pytest.

When: only for a run of at least `MIN_FILES` files on a machine of two or
more cores. A run of one file, `--pdb`, `-x`/`--maxfail`, `--collect-only`,
a run with collection errors and `FLEXFLOW_KERAS_TEST_PROCESSES=1` run in
one process as usual.
"""

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

#: The hooks `tests/conftest.py` takes (`from two_processes import *`).
__all__ = ["pytest_runtestloop", "pytest_sessionfinish",
           "pytest_terminal_summary", "pytest_unconfigure"]

#: Set in the second process: the folder both processes claim files in.
CLAIMS_ENV = "FLEXFLOW_KERAS_TEST_CLAIMS"
#: "1" keeps every run in one process.
PROCESSES_ENV = "FLEXFLOW_KERAS_TEST_PROCESSES"
MIN_FILES = 8

#: The second process's exit codes that leave the run passing.
PASSED = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)

_second = {}  # the first process's handle on the second: process, log, claims


def _claim(folder, path):
    """True if this process is the first to ask for `path`'s file."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(path))
    try:
        os.close(os.open(os.path.join(folder, name),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _splits(session):
    config = session.config
    if session.testsfailed and not config.option.continue_on_collection_errors:
        return False  # pytest's own loop stops on the collection errors
    if os.environ.get(CLAIMS_ENV):
        return True
    files = {item.path for item in session.items}
    return (os.environ.get(PROCESSES_ENV, "") != "1"
            and (os.cpu_count() or 1) >= 2
            and len(files) >= MIN_FILES
            and not config.option.collectonly
            and not config.option.usepdb
            and not config.option.maxfail)


def _start_second(config):
    folder = tempfile.mkdtemp(prefix="flexflow_keras_tests_")
    log = open(os.path.join(folder, "second-process.log"), "w+")
    env = dict(os.environ, **{CLAIMS_ENV: folder})
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", *config.invocation_params.args],
        cwd=str(config.invocation_params.dir), env=env,
        stdout=log, stderr=subprocess.STDOUT)
    atexit.register(lambda: process.poll() is None and process.kill())
    _second.update(process=process, log=log, folder=folder)
    return folder


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """The default loop, over the files this process claims."""
    if not _splits(session):
        return None
    folder = os.environ.get(CLAIMS_ENV) or _start_second(session.config)
    by_file = {}
    for item in session.items:
        by_file.setdefault(item.path, []).append(item)
    order = list(by_file)
    if os.environ.get(CLAIMS_ENV):
        order.reverse()
    for path in order:
        if not _claim(folder, path):
            continue
        items = by_file[path]
        for i, item in enumerate(items):
            nextitem = items[i + 1] if i + 1 < len(items) else None
            item.config.hook.pytest_runtest_protocol(item=item,
                                                     nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Waits for the second process; its failure fails the run."""
    process = _second.get("process")
    if process is None:
        return
    code = process.wait()
    _second["code"] = code
    if code not in PASSED and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = code


def pytest_terminal_summary(terminalreporter):
    """The second process's report: what came after its progress lines
    (warnings, durations, failures), or all of it when it failed; its
    summary line is in the heading, beside the first process's own."""
    log = _second.get("log")
    if log is None:
        return
    log.seek(0)
    lines = log.read().splitlines()
    progress = [i for i, line in enumerate(lines)
                if re.search(r"\[\s*\d+%\]$", line)]
    after = progress[-1] + 1 if progress else 0
    failed = _second.get("code") not in PASSED
    report = lines if failed else lines[after:]
    summary = next((line.strip("= ") for line in reversed(lines)
                    if re.match(r"=+ .* in [\d.]+s", line)), "no summary")
    terminalreporter.write_sep(
        "=", f"the second process (exit {_second.get('code')}): {summary}")
    for line in report:
        terminalreporter.write_line(line)


def pytest_unconfigure(config):
    """The claims and the second process's log go with the run."""
    if _second.get("folder"):
        _second["log"].close()
        shutil.rmtree(_second["folder"], ignore_errors=True)
