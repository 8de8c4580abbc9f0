"""What a training run prints, from the real CLI with its output captured through pipes (the cached
1-process run): plain progress lines in a log file and no bar frames, the schedule a resume with a
larger max_steps keeps, and the header of each sweep job. The Console itself:
tests/unit/core/test_console.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmsys.core.config import OptimConfig
from lmsys.engine.zero import lr_at
from tests.integration.features import MAX_STEPS, copy_run, run_train
from tests.unit.core.test_console import STEP_LINE


def test_log_file_gets_plain_lines_and_no_bar_frames(runs):
    run = runs.get("1proc").check()  # stdout and stderr are pipes: not a terminal
    out = run.stdout.splitlines()
    assert "\r" not in run.stdout + run.stderr
    steps = [int(m.group(1)) for line in out if (m := STEP_LINE.match(line))]
    # logger.console_interval=10 (the default) and 6 steps: the launch's first and last step
    assert steps == [1, MAX_STEPS], run.stdout
    assert "ETA" in next(line for line in out if STEP_LINE.match(line))
    assert out[0].startswith("lmsys-train: starting: process group, model, DeepSpeed engine")
    saved = [line for line in out if line.startswith("lmsys-train: saved checkpoint ")]
    assert [Path(line.split()[3]).name for line in saved] == ["step_0000002", "step_0000004", "step_0000006"]
    assert all(Path(line.split()[3]).is_dir() for line in saved)
    # trainer.eval_batches=2 micro-batches of 8 on 1 rank: 16 of the split's sequences, said so
    banner = next(line for line in out if line.startswith("lmsys-train: validation every 3 steps on "))
    assert re.search(r"on 16 of \d+ val sequences \(trainer.eval_batches=0 for the whole split\)$", banner)
    evals = [line for line in out if " val loss " in line and line.startswith("lmsys-train: step ")]
    assert len(evals) == 2 and all("(16 of " in e and "| lr " in e and "grad norm" in e for e in evals)
    wandb_lines = [line for line in out if line.startswith("lmsys-train: W&B: offline run in ")]
    assert len(wandb_lines) == 2  # at the start and at the end
    sync_dir = Path(wandb_lines[-1].rsplit("wandb sync ", 1)[1])
    assert sync_dir.is_dir() and sync_dir.parent == run.run_dir / "wandb"
    assert list(sync_dir.glob("*.wandb"))


@pytest.mark.slow
def test_extending_max_steps_keeps_the_schedule(runs, tmp_path):
    """The finished 6-step run resumed with trainer.max_steps=9: it says so, and steps 7-9 get the
    learning rate of the 6-step schedule (its floor), not a cosine re-planned over 9 steps."""
    reference = runs.get("1proc").check()
    run_dir = copy_run(reference, tmp_path / "run")
    overrides = [o for o in runs.overrides("1proc") if not o.startswith("logger")] + ["logger=none"]
    extended = run_train("extended", 1, [*overrides, "trainer.max_steps=9"], run_dir, cwd=tmp_path).check()
    assert "trainer.max_steps extended from 6 to 9; the learning rate keeps its schedule" in extended.stdout
    optim = OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=6)
    lrs = {r["step"]: r["lr"] for r in extended.records()}
    assert [lrs[s] for s in (7, 8, 9)] == pytest.approx([lr_at(s, optim, 9) for s in (7, 8, 9)], rel=1e-12)
    assert lrs[9] == pytest.approx(3e-3 * OptimConfig().min_lr_ratio)
    assert "decay_steps: 6" in (run_dir / "config.yaml").read_text()

    again = run_train("again", 1, [*overrides, "trainer.max_steps=9"], run_dir, cwd=tmp_path).check()
    assert "no steps to run: the checkpoint is at step 9 (trainer.max_steps=9)" in again.stdout
    assert "steps 10..9" not in again.stdout


def test_sweep_jobs_get_a_header(runs):
    run = runs.get("2proc-zero0").check()  # one `-m deepspeed=zero0,zero1,zero2,zero3` launch
    headers = [line for line in run.stdout.splitlines() if line.startswith("lmsys-train: sweep job ")]
    assert len(headers) == 4, run.stdout  # rank 0 only
    for number, line in enumerate(headers):
        assert line.startswith(f"lmsys-train: sweep job {number}: ")
        assert f"deepspeed=zero{number}" in line and line.endswith(f"/2proc-zero{number}")
