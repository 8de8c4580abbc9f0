"""A rank that stops making progress ends the job, named, within trainer.hang_timeout_s + 30 s
(lmsys/training/watchdog.py, launch/stuck.py): real 2-rank ZeRO-2 runs through launch.torchrun,
one with the last rank frozen by SIGSTOP (it answers nothing), one with it asleep (its watchdog
thread answers); no process of either job is left, and the frozen one's run resumes. The verdict
itself: tests/unit/launch/test_stuck_rank.py."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from lmsys.core.config import compose
from lmsys.core.errors import EXIT_STUCK_RANK, ConfigError
from lmsys.engine.runlock import LOCK_FILE
from tests.integration.launch.conftest import MAX_STEPS, child_env, launcher, losses

pytestmark = pytest.mark.slow

HANG_S = 10
HANG_STEP = 4  # after the checkpoint of step 3 (trainer.save_interval=3)


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds `text` (the run directory is on every worker's)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry))
        except OSError:
            pass
    return found


def test_a_stuck_rank_ends_the_job_named_and_the_run_resumes(tiny, tmp_path):
    runs = {how: tmp_path / how for how in ("stop", "sleep")}
    started = {}
    for how, run_dir in runs.items():  # both at once: their start-up overlaps
        command = launcher(
            "--nproc", "2", "--", *tiny, f"trainer.run_dir={run_dir}", f"trainer.hang_timeout_s={HANG_S}",
            f"debug.hang_step={HANG_STEP}", f"debug.hang_how={how}",
        )  # fmt: skip
        started[how] = subprocess.Popen(
            command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    for how, proc in started.items():
        out, err = proc.communicate(timeout=400)
        ended = time.time()
        run_dir = runs[how]
        assert proc.returncode == EXIT_STUCK_RANK, out[-3000:] + err[-3000:]
        line = [ln for ln in err.splitlines() if ln.startswith("lmsys-launch: error:")]
        assert len(line) == 1, err
        state = "did not answer: stopped or dead" if how == "stop" else f"is at step {HANG_STEP}'s start"
        assert f"rank 1 did not reach step {HANG_STEP}'s " in line[0] and f"rank 1 {state}" in line[0], line
        assert f"within {HANG_S} s" in line[0] and "rank 0 waits there" in line[0], line
        assert "trainer.resume=auto continues from the checkpoint of step 3" in line[0], line
        diagnostics = run_dir / "diagnostics"
        assert (diagnostics / "hang.txt").read_text().strip() in line[0]
        # every rank that still ran wrote its stacks: rank 0 waits in a collective of the step
        assert "in all_reduce" in (diagnostics / "hang-rank-0.txt").read_text()
        frozen = not (diagnostics / "hang-rank-1.txt").exists()
        assert frozen == (how == "stop")
        if how == "sleep":
            assert "in before_step" in (diagnostics / "hang-rank-1.txt").read_text()  # faults.py's sleep
        assert sorted(losses(run_dir)) == list(range(1, HANG_STEP))
        assert (run_dir / LOCK_FILE).read_text() == ""  # rank 0 released its lock on the way out
        hung_since = (run_dir / "checkpoints" / "step_0000003").stat().st_mtime
        took = ended - hung_since
        assert took < HANG_S + 30, f"{how}: the job ended {took:.0f} s after the hang"
        time.sleep(0.5)
        assert processes_naming(f"trainer.run_dir={run_dir}") == [], f"{how}: processes left behind"

    # the frozen run goes on from its last checkpoint
    run_dir = runs["stop"]
    resumed = subprocess.run(
        launcher("--nproc", "2", "--", *tiny, f"trainer.run_dir={run_dir}"),
        env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "(step 3)" in resumed.stdout, resumed.stdout
    assert "took over the lock" not in resumed.stderr  # nothing was left to take over
    assert sorted(losses(run_dir)) == list(range(1, MAX_STEPS + 1))


def test_hang_timeout_must_be_below_the_collective_timeout(tiny):
    with pytest.raises(ConfigError, match="hang_timeout_s=200 must be below trainer.dist_timeout_s=120"):
        compose([*tiny, "trainer.hang_timeout_s=200"])
    assert compose([*tiny, "trainer.hang_timeout_s=0"]).trainer.hang_timeout_s == 0  # off
