"""Stopping on a signal (lmsys/training/stopping.py), with real runs:

- Ctrl-C (SIGINT to the terminal's process group), in one process and under launch.torchrun:
  one line "interrupted: saving step N ...", a complete checkpoint of the last step, exit 130, no
  traceback; the run resumed from it has the uninterrupted run's losses;
- a second SIGTERM / SIGUSR1 while the checkpoint is being written changes nothing: the save
  completes, exit 75;
- a second Ctrl-C during the save stops at once: the half-written checkpoint never becomes
  visible, the previous one stays the newest, intact.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from lmsys.engine import checkpoint as ckpt
from tests.integration.features import run_train, start_job, train_command

pytestmark = pytest.mark.slow


class Running:
    """A training command started in a session of its own, as a terminal's foreground job."""

    def __init__(self, command: list[str], run_dir: Path, cwd: Path) -> None:
        self.run_dir = run_dir
        self.proc = start_job(command, cwd)

    def steps(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return []
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r["step"] for r in records if r.get("kind") == "train"]

    def wait_for(self, what: str, ready, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                pytest.fail(f"the run ended before {what}:\n{out}\n{err}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"no {what} within {timeout_s} s")
            time.sleep(0.02)

    def signal_group(self, sig: int) -> None:
        """What a terminal does on Ctrl-C: the signal to the foreground process group."""
        os.killpg(self.proc.pid, sig)

    def finish(self) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=240)
        return self.proc.returncode, out, err

    def saving(self) -> bool:
        return any((self.run_dir / "checkpoints").glob(".tmp-step_*"))


def one_stop_line(err: str, word: str) -> str:
    lines = [line for line in err.splitlines() if word in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


class Watched(Running):
    """A Running job whose stderr is read line by line as it comes (`lines`), with the steps in
    metrics.jsonl at the moment each line arrived (`steps_at`)."""

    def __init__(self, command: list[str], run_dir: Path, cwd: Path) -> None:
        super().__init__(command, run_dir, cwd)
        self.lines: list[str] = []
        self.steps_at: list[list[int]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.steps_at.append(self.steps())
            self.lines.append(line.rstrip("\n"))

    def finish(self) -> tuple[int, str, str]:
        out = self.proc.stdout.read()
        self.proc.wait(timeout=240)
        self._reader.join(timeout=60)
        return self.proc.returncode, out, "\n".join(self.lines)


def continued(prefix: list[str], overrides: list[str], run_dir: Path) -> str:
    """The command the stop line names: the launch's own, with trainer.run_dir last."""
    return shlex.join(
        [
            *prefix,
            *[o for o in overrides if not o.startswith("trainer.run_dir=")],
            f"trainer.run_dir={run_dir}",
        ]
    )


@pytest.mark.parametrize("nproc", [1, 2], ids=["python", "launch.torchrun"])
def test_ctrl_c_saves_the_step_in_one_line_and_exits_130(runs, tmp_path, nproc):
    """Ctrl-C is acknowledged at once (before the step it names has finished), then the step is
    saved in one line that names the command that continues the run."""
    case = "1proc" if nproc == 1 else "2proc-zero2"
    run_dir = tmp_path / "run"
    delay = 2 if nproc == 1 else 0.5  # 1 process: time to see the step still under way
    overrides = [*runs.overrides(case), "logger=none", f"debug.step_delay_s={delay}"]
    overrides.append(f"trainer.run_dir={run_dir}")
    if nproc == 1:
        command = train_command(1, overrides)
        prefix = ["python", "-m", "lmsys.train"]
    else:
        command = [sys.executable, "-m", "launch.torchrun", "--nproc", "2", "--", *overrides]
        prefix = ["python", "-m", "launch.torchrun", "--nproc", "2", "--"]
    job = Watched(command, run_dir, tmp_path)
    job.wait_for("step 2", lambda: 2 in job.steps())
    job.signal_group(signal.SIGINT)
    code, out, err = job.finish()
    assert code == 130, out + err
    line = one_stop_line(err, "interrupted")
    step = job.steps()[-1]
    assert step in (2, 3, 4), job.steps()  # the step under way when Ctrl-C came, or the one after
    acks = [i for i, text in enumerate(job.lines) if "Ctrl-C:" in text]
    assert len(acks) == 1, err
    ack = r"lmsys-train: Ctrl-C: stopping after step (\d+), then saving it; Ctrl-C again abandons the save"
    acked = int(re.fullmatch(ack, job.lines[acks[0]]).group(1))
    assert acked == step if nproc == 1 else acked in (step, step + 1), err
    if nproc == 1:
        assert step not in job.steps_at[acks[0]], (
            job.steps_at[acks[0]],
            err,
        )  # at once, not at the step's end
    tag = run_dir / ckpt.CHECKPOINTS / ckpt.tag_for(step)
    want = f"lmsys-train: interrupted: saving step {step} ... saved {tag}; continue with: "
    assert line == want + continued(prefix, overrides, run_dir)
    assert ckpt.find_latest(run_dir, pytest.fail).tag_dir == tag
    if nproc == 1:  # resumed: the uninterrupted run's losses (the 2-rank case: tests/integration/launch)
        overrides = [o for o in overrides if not o.startswith("trainer.debug")]
        resumed = run_train("resumed", 1, overrides, run_dir, cwd=tmp_path).check()
        assert f"(step {step})" in resumed.stdout
        assert resumed.losses() == pytest.approx(runs.get(case).check().losses(), rel=1e-5)


def test_a_second_sigterm_during_the_save_changes_nothing(runs, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*runs.overrides("1proc"), "logger=none", "debug.step_delay_s=0.5"]
    overrides += ["trainer.save_interval=100", "debug.save_delay_s=2", f"trainer.run_dir={run_dir}"]
    job = Running(train_command(1, overrides), run_dir, tmp_path)
    job.wait_for("step 2", lambda: 2 in job.steps())
    job.proc.send_signal(signal.SIGTERM)
    job.wait_for("the checkpoint being written", job.saving)
    job.proc.send_signal(signal.SIGTERM)
    job.proc.send_signal(signal.SIGUSR1)
    code, out, err = job.finish()
    assert code == 75, out + err
    step = job.steps()[-1]
    line = one_stop_line(err, "preempted")
    assert line.startswith(f"lmsys-train: preempted (SIGTERM): saving step {step} ... saved ")
    again = continued(["python", "-m", "lmsys.train"], overrides, run_dir)
    assert line.endswith(f"; exit 75: requeue the job, or continue with: {again}"), line
    found = ckpt.find_latest(run_dir, pytest.fail)
    assert found.step == step and ckpt.verify(found.tag_dir)["state"]["step"] == step
    assert not job.saving()


def test_a_second_ctrl_c_during_the_save_abandons_it_and_damages_nothing(runs, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*runs.overrides("1proc"), "logger=none", "debug.step_delay_s=0.5"]
    overrides += ["debug.save_delay_s=2", f"trainer.run_dir={run_dir}"]
    job = Watched(train_command(1, overrides), run_dir, tmp_path)
    job.wait_for("checkpoint 2", lambda: (run_dir / "checkpoints" / "step_0000002" / ckpt.MARKER).exists())
    job.signal_group(signal.SIGINT)
    # Two signals that reach the process while its main thread is inside one C call reach Python
    # as one: send the second only after the first was acknowledged, during the stop's own save
    # (not a periodic save still in flight).
    job.wait_for("the Ctrl-C acknowledgement", lambda: any("Ctrl-C:" in line for line in job.lines))
    acked = int(re.search(r"stopping after step (\d+)", next(x for x in job.lines if "Ctrl-C:" in x))[1])
    stop_save = run_dir / ckpt.CHECKPOINTS / f"{ckpt.TMP_PREFIX}{ckpt.tag_for(acked)}"
    job.wait_for(f"the stop's checkpoint (step {acked}) being written", stop_save.exists)
    job.signal_group(signal.SIGINT)
    code, out, err = job.finish()
    assert code == 130, out + err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "lmsys-train: interrupted", err
    # the abandoned save is not visible, half-written or not; the newest is one committed before
    # it (2, or a periodic save of step 4 the background writer committed first), intact
    visible = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpt.tag_for(acked) not in visible and "step_0000002" in visible, visible
    found = ckpt.find_latest(run_dir, pytest.fail)
    assert found.step < acked and ckpt.verify(found.tag_dir)["state"]["step"] == found.step
    for name in visible:
        assert ckpt.verify(run_dir / "checkpoints" / name)["state"]["step"] == int(name[-7:])
