"""One launch per run directory (lmsys/engine/runlock.py), with real launches:

- a second launch into the directory of a running one is refused with one line naming the holder
  (host, pid, since when), exit 2, by the trainer and by launch.torchrun before any worker starts;
  the first run goes on undisturbed;
- the lock of a launch killed with kill -9 is taken over by the next launch, which says so and
  resumes.

A requeued SLURM job's takeover: tests/unit/engine/test_runlock.py."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest

from lmsys.engine import checkpoint as ckpt
from lmsys.engine.runlock import LOCK_FILE, holder_of
from tests.integration.features import REPO_ROOT, child_env, run_train, train_command
from tests.integration.training.test_stopping import Running

pytestmark = pytest.mark.slow


def only_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_a_second_launch_is_refused_and_a_killed_holders_lock_is_taken_over(runs, tmp_path):
    run_dir = tmp_path / "run"
    # the first run goes on (slowly) until it is killed, however long the second one takes to start
    overrides = [*runs.overrides("1proc"), "logger=none", "debug.step_delay_s=0.5"]
    overrides += ["trainer.max_steps=1000", f"trainer.run_dir={run_dir}"]
    first = Running(train_command(1, overrides), run_dir, tmp_path)
    first.wait_for("step 1", lambda: 1 in first.steps())
    lock = json.loads((run_dir / LOCK_FILE).read_text())
    assert lock["pid"] == first.proc.pid and lock["host"] == socket.gethostname()

    second = subprocess.run(
        train_command(1, overrides),
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 2, second.stdout + second.stderr
    line = only_error_line(second.stderr)
    holder = f"pid {first.proc.pid} on {socket.gethostname()} (since {lock['since']})"
    assert line.startswith(
        f"lmsys-train: error: trainer.run_dir={run_dir} is in use by another launch: {holder}"
    )
    launcher = subprocess.run(
        [sys.executable, "-m", "launch.torchrun", "--nproc", "2", "--dry-run", "--", *overrides],
        cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert launcher.returncode == 2, launcher.stdout + launcher.stderr
    assert only_error_line(launcher.stderr).startswith(
        f"lmsys-launch: error: trainer.run_dir={run_dir} is in use"
    )
    assert first.proc.poll() is None  # the first run goes on

    first.wait_for("a checkpoint", lambda: any((run_dir / "checkpoints").glob(f"step_*/{ckpt.MARKER}")))
    first.proc.send_signal(signal.SIGKILL)  # no clean-up: the lock file still names it
    first.proc.communicate()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == first.proc.pid
    saved = ckpt.find_latest(run_dir, pytest.fail).step
    again = [o for o in overrides if "debug" not in o and "max_steps" not in o] + [
        f"trainer.max_steps={saved + 1}"
    ]
    resumed = run_train("after-kill", 1, again, run_dir, cwd=tmp_path)
    resumed.check()
    assert f"warning: took over the lock of {run_dir} from {holder}: it is gone" in resumed.stderr
    assert "resumed from" in resumed.stdout
    assert (run_dir / LOCK_FILE).read_text() == ""  # released at the end
    assert holder_of(run_dir) is None
