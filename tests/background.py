"""Long subprocess work that depends on nothing else in the session, started as soon as collection
ends at the lowest CPU priority (nice 19). It runs on the cores the tests leave idle (a test
waiting on its children, one rank importing torch while the other waits), and the fixture that
needs it waits only for what is left.

A test module declares its jobs as `BACKGROUND_JOBS = {fixture name: command factory}`; a job
starts when a collected test of that module uses the fixture (tests/conftest.py). A factory takes
the job's private output directory and returns (argv, environment). Output goes to files, since
nothing reads a pipe until the fixture runs.
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

CommandFactory = Callable[[Path], tuple[list[str], dict[str, str]]]


@dataclass
class Job:
    proc: subprocess.Popen
    out: Path  # the job's directory: its files, stdout.txt and stderr.txt
    started: float


@dataclass
class Result:
    proc: subprocess.CompletedProcess
    out: Path
    seconds: float  # wall time from start to exit, beside the other tests


_JOBS: dict[str, Job] = {}


def _lowest_priority() -> None:
    os.nice(19)


def start(name: str, factory: CommandFactory) -> None:
    if name in _JOBS:
        return
    out = Path(tempfile.mkdtemp(prefix=f"lmsys-tests-{name}-"))
    argv, env = factory(out)
    with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(
            argv, cwd=REPO_ROOT, env=env, stdout=stdout, stderr=stderr, text=True,
            # Its own process group (stop() ends its workers too) but not its own session: with the
            # kernel's autogroup scheduling a new session would be a new group with a fair share of
            # the CPU, whatever its nice value.
            preexec_fn=None if xdist_worker() else _lowest_priority, process_group=0,
        )  # fmt: skip
    _JOBS[name] = Job(proc, out, time.perf_counter())


def result(name: str, factory: CommandFactory, timeout: float) -> Result:
    """The job's outcome, starting it now if collection did not (its exit status, stdout, stderr)."""
    start(name, factory)
    job = _JOBS[name]
    try:
        job.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(job)
        raise
    seconds = time.perf_counter() - job.started
    completed = subprocess.CompletedProcess(
        job.proc.args,
        job.proc.returncode,
        (job.out / "stdout.txt").read_text(),
        (job.out / "stderr.txt").read_text(),
    )
    return Result(completed, job.out, seconds)


def _kill(job: Job) -> None:
    if job.proc.poll() is None:
        try:
            os.killpg(job.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.proc.wait()


def stop_all() -> None:
    """End whatever still runs (an interrupted session) and remove every job's directory."""
    for job in _JOBS.values():
        _kill(job)
        shutil.rmtree(job.out, ignore_errors=True)
    _JOBS.clear()
