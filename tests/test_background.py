"""tests/background.py on real shell jobs: the outcome read from the status file, and a job that
overruns its timeout ended (its whole process group) before the error is raised."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests import background


@pytest.fixture
def session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(background.SESSION_DIR_VARIABLE, str(tmp_path))
    return tmp_path


def test_result_reads_status_and_output(session: Path) -> None:
    def factory(out: Path) -> tuple[list[str], dict[str, str]]:
        return ["sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 3"], dict(os.environ)

    background.start("ends", factory)
    outcome = background.result("ends", factory, timeout=30)
    assert outcome.proc.returncode == 3
    assert outcome.proc.stdout == "to-stdout\n" and outcome.proc.stderr == "to-stderr\n"
    assert 0 <= outcome.seconds < 30 and "ends" not in background._STARTED_HERE


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is gone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_overrun_is_ended_before_the_error(session: Path) -> None:
    # The job's shell starts a child in its process group: ending only the shell would leave it.
    def factory(out: Path) -> tuple[list[str], dict[str, str]]:
        return ["sh", "-c", f"sleep 600 & echo $! > {out}/child_pid; wait"], dict(os.environ)

    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not end within 2 s"):
        background.result("overruns", factory, timeout=2)
    assert time.monotonic() - started < 30
    background._STARTED_HERE.pop("overruns").wait(timeout=10)  # the job's own shell has ended
    child = int((session / "overruns" / "child_pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
