"""Long subprocess work that depends on nothing else in the session, started as soon as collection
ends. In one process at the lowest CPU priority (nice 19): it runs on the cores the tests leave
idle (a test waiting on its children, one rank importing torch while the other waits), and the
fixture that needs it waits only for what is left. Under xdist at normal priority (below).

A test module declares its jobs as `BACKGROUND_JOBS = {fixture name: command factory}`; a job
starts when collection ends if a collected test of that module uses the fixture (tests/conftest.py).
A factory takes the job's output directory and returns (argv, environment). Output goes to files,
since nothing reads a pipe until the fixture runs.

Under pytest-xdist every worker collects every test, so each would start the job: the first to
create the job's directory in the session's directory (made by the controlling process,
LMSYS_TESTS_BACKGROUND) starts it, and the worker that runs the waiting test, whichever it is,
reads its exit status from a file. The module that waits is scheduled last, so no worker sits
idle while the job runs (it did for 10 minutes of a 28-minute suite, 2026-11-28). The controlling
process ends what still runs and removes the directory when the session ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.sharing import xdist_worker

REPO_ROOT = Path(__file__).resolve().parents[1]
SESSION_DIR_VARIABLE = "LMSYS_TESTS_BACKGROUND"

CommandFactory = Callable[[Path], tuple[list[str], dict[str, str]]]

EXIT_STATUS = "exit_status"  # written by the job's shell when the command ends
STARTED = "started"  # time.time() at the start
GROUP = "process_group"  # the job's process group, for the controlling process to end it


@dataclass
class Result:
    proc: subprocess.CompletedProcess
    out: Path
    seconds: float  # wall time from start to exit, beside the other tests


def open_session() -> None:
    """In the controlling process (or the only one), before any worker starts: the directory
    every process of the session shares for its jobs."""
    if SESSION_DIR_VARIABLE not in os.environ:
        os.environ[SESSION_DIR_VARIABLE] = tempfile.mkdtemp(prefix="lmsys-tests-background-")


def _job_dir(name: str) -> Path:
    return Path(os.environ[SESSION_DIR_VARIABLE]) / name


def _lowest_priority() -> None:
    os.nice(19)


def start(name: str, factory: CommandFactory) -> None:
    """Start the job unless a process of this session already has (creating its directory is the
    claim)."""
    out = _job_dir(name)
    try:
        out.mkdir()
    except FileExistsError:
        return
    argv, env = factory(out)
    status = out / EXIT_STATUS
    record_exit = '"$@"; echo $? > "$0.tmp" && mv "$0.tmp" "$0"'
    (out / STARTED).write_text(repr(time.time()))
    with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(
            ["sh", "-c", record_exit, str(status), *argv], cwd=REPO_ROOT, env=env, stdout=stdout,
            stderr=stderr, text=True,
            # Its own process group (close_session() ends its workers too) but not its own
            # session: with the kernel's autogroup scheduling a new session would be a new group
            # with a fair share of the CPU, whatever its nice value. Beside xdist's workers, which
            # keep the cores busy, at normal priority: at nice 19 it got little CPU until they
            # were done, and the suite ended waiting 95 s for it alone (2026-11-28).
            preexec_fn=None if xdist_worker() else _lowest_priority, process_group=0,
        )  # fmt: skip
    (out / GROUP).write_text(str(proc.pid))
    _STARTED_HERE[name] = proc


# the jobs this process started, reaped here once they end (their status is read from its file)
_STARTED_HERE: dict[str, subprocess.Popen] = {}


def result(name: str, factory: CommandFactory, timeout: float) -> Result:
    """The job's outcome (exit status, stdout, stderr), starting it now if nobody has; waits at
    most `timeout` seconds from now."""
    start(name, factory)
    out = _job_dir(name)
    status, deadline = out / EXIT_STATUS, time.monotonic() + timeout
    # Polled on every path, whoever started it: the deadline below ends the job before raising.
    while not status.exists():
        if time.monotonic() > deadline:
            _end(out)
            raise TimeoutError(f"background job {name} did not end within {timeout:.0f} s")
        time.sleep(1)
    if name in _STARTED_HERE:
        _STARTED_HERE.pop(name).wait()  # the shell exits right after writing the status
    completed = subprocess.CompletedProcess(
        [name],
        int(status.read_text()),
        (out / "stdout.txt").read_text(),
        (out / "stderr.txt").read_text(),
    )
    seconds = status.stat().st_mtime - float((out / STARTED).read_text())
    return Result(completed, out, seconds)


def _end(out: Path) -> None:
    group = out / GROUP
    if group.exists() and not (out / EXIT_STATUS).exists():
        try:
            os.killpg(int(group.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def close_session() -> None:
    """In the controlling process, after every worker: end whatever still runs (an interrupted
    session) and remove the jobs' directories."""
    root = os.environ.pop(SESSION_DIR_VARIABLE, None)
    if root is None:
        return
    for out in Path(root).iterdir():
        _end(out)
    for proc in _STARTED_HERE.values():
        if proc.poll() is None:
            proc.wait()
    _STARTED_HERE.clear()
    shutil.rmtree(root, ignore_errors=True)
