"""Checkpoints and resume under faults, with real runs:

- kill -9 of the whole torchrun process group right after a checkpoint appears, then resume:
  the losses are identical to the uninterrupted run's;
- a corrupted (truncated) newest checkpoint, a partial one (no completion marker) and a leftover
  temporary directory: resume falls back to the previous complete checkpoint with a warning;
- a rank that dies brings the job down, and torchrun --max_restarts with resume=auto continues
  from the last checkpoint (in the default runs/<model>-<timestamp> directory, found again);
- a resume with a different model is refused with one clear line, nothing on disk touched.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from lmsys.engine import checkpoint as ckpt
from tests.integration.features import (
    MAX_STEPS,
    child_env,
    copy_run,
    kill9_after_checkpoint,
    run_train,
    train_command,
)
from tests.integration.training.reference import plain_losses

pytestmark = pytest.mark.slow


def snapshot(directory):
    """Every file's size and mtime, but run.lock's: a refused launch took and released the lock
    (lmsys.engine.runlock), which leaves the file empty as it was, with a new mtime."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "run.lock"
    }


WANDB = ["logger=wandb_offline", "logger.log_interval=1"]


@pytest.fixture(scope="module")
def killed_run(runs, tmp_path_factory):
    """The 2-process ZeRO-2 run, killed (SIGKILL) once step_0000004 is complete (kill9_after_checkpoint)."""
    return kill9_after_checkpoint([*runs.overrides("2proc-zero2"), *WANDB], tmp_path_factory.mktemp("killed"))


@pytest.fixture(scope="module")
def resumed_run(runs, killed_run):
    run_dir, _, _ = killed_run
    return run_train("resumed", 2, [*runs.overrides("2proc-zero2"), *WANDB], run_dir, cwd=run_dir.parent)


def test_kill9_leaves_a_run_mid_way(killed_run):
    run_dir, steps, survivors = killed_run
    assert 4 <= max(steps) < MAX_STEPS, steps
    assert survivors == [], "workers outlived the killed torchrun launcher"
    assert ckpt.find_latest(run_dir, lambda m: None).tag_dir.name == "step_0000004"


def test_resume_after_kill9_reproduces_the_losses_exactly(runs, resumed_run):
    run = resumed_run.check()
    assert "resumed from" in run.stdout and "step_0000004 (step 4)" in run.stdout
    assert run.losses() == runs.get("2proc-zero2").check().losses()  # bit for bit
    assert [r["step"] for r in run.records("eval")] == [3, 6]  # no duplicated records
    tags = sorted(p.name for p in (run.run_dir / ckpt.CHECKPOINTS).iterdir())
    assert tags == [
        "latest",
        "step_0000002",
        "step_0000004",
        "step_0000006",
        "zero_to_fp32.py",
        "zero_to_torch.py",
    ]
    assert (run.run_dir / ckpt.CHECKPOINTS / "latest").read_text() == "step_0000006"


def test_resumed_wandb_run_holds_the_whole_history(resumed_run):
    """The killed attempt's W&B file lost what was not flushed; the resumed attempt's file (same
    run id) holds every step: the earlier ones replayed from metrics.jsonl, then its own."""
    from tests.wandb_files import wandb_files, wandb_history

    run = resumed_run.check()
    files = wandb_files(run.run_dir)
    assert len(files) == 2 and files[0].name.split("-")[-1] == files[1].name.split("-")[-1]  # one id
    history = wandb_history(run.run_dir, attempt=-1)
    losses = {row["step"]: row["train/loss"] for row in history if "train/loss" in row}
    assert losses == pytest.approx(run.losses(), rel=1e-12)  # logger.log_interval=1: every step
    evals = [row["step"] for row in history if "eval/loss" in row]
    assert evals == [r["step"] for r in run.records("eval")] == [3, 6]


@pytest.fixture(scope="module")
def fallback_run(runs, tmp_path_factory):
    """The 1-process run's directory with its newest checkpoint (6) truncated, a partial step 8
    (no marker) and a leftover temporary directory; resumed with the same config."""
    reference = runs.get("1proc").check()
    run_dir = copy_run(reference, tmp_path_factory.mktemp("fallback") / "run")
    root = run_dir / ckpt.CHECKPOINTS
    victim = next((root / "step_0000006").glob("*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    shutil.copytree(root / "step_0000004", root / "step_0000008")
    (root / "step_0000008" / ckpt.MARKER).unlink()
    shutil.copytree(root / "step_0000002", root / ".tmp-step_0000007")
    overrides = [o for o in runs.overrides("1proc") if not o.startswith("logger")] + ["logger=none"]
    return run_train("fallback", 1, overrides, run_dir, cwd=run_dir.parent)


def test_corrupt_and_partial_checkpoints_fall_back(runs, fallback_run):
    run = fallback_run.check()
    warnings = [line for line in run.stderr.splitlines() if "warning" in line]
    assert any("step_0000008" in w and "lmsys_checkpoint.json" in w for w in warnings), run.stderr
    assert any("step_0000006" in w and "truncated" in w for w in warnings), run.stderr
    assert "step_0000004 (step 4)" in run.stdout
    assert run.losses() == runs.get("1proc").losses()
    root = run.run_dir / ckpt.CHECKPOINTS
    assert ckpt.verify(root / "step_0000006")["state"]["step"] == 6  # written again, whole
    assert not list(root.glob(".tmp-*"))
    # the damaged ones were moved aside, not deleted, and say so
    assert sorted(p.name for p in (root / ckpt.DAMAGED).iterdir()) == ["step_0000006", "step_0000008"]
    for tag in ("step_0000006", "step_0000008"):
        moved = f"moved the damaged checkpoint {tag} to {root / ckpt.DAMAGED / tag}"
        assert any(moved in w for w in warnings), warnings


def test_keep_last_counts_only_intact_checkpoints_and_moves_damaged_ones_aside(runs, tmp_path):
    """The 1-process run's checkpoints 2, 4, 6 with the newest (6) and the oldest (2) truncated,
    resumed with trainer.keep_last=1 and stopped by a preemption after step 5. Resume falls back to
    4 and moves 6 aside; the save of 5 prunes 4 (5 is newer and complete) and moves the damaged 2
    aside: only step 5 is left, not a corrupt checkpoint counted as the one to keep. Continued, the
    run ends with the uninterrupted losses and its one newest checkpoint."""
    reference = runs.get("1proc").check()
    run_dir = copy_run(reference, tmp_path / "run")
    root = run_dir / ckpt.CHECKPOINTS
    for tag in ("step_0000006", "step_0000002"):
        victim = next((root / tag).glob("*optim_states.pt"))
        victim.write_bytes(victim.read_bytes()[:1000])
    overrides = [o for o in runs.overrides("1proc") if not o.startswith("logger")] + ["logger=none"]
    overrides.append("trainer.keep_last=1")
    stopped = run_train("stopped", 1, [*overrides, "debug.signal_at_step=5"], run_dir, cwd=tmp_path)
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    assert "step_0000004 (step 4)" in stopped.stdout
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000005"]
    assert sorted(p.name for p in (root / ckpt.DAMAGED).iterdir()) == ["step_0000002", "step_0000006"]
    warnings = [line for line in stopped.stderr.splitlines() if "warning" in line]
    assert any(
        "checkpoint step_0000002 is damaged" in w and "truncated" in w and "not counted in keep_last" in w
        for w in warnings
    ), stopped.stderr
    finished = run_train("finished", 1, overrides, run_dir, cwd=tmp_path).check()
    assert "step_0000005 (step 5)" in finished.stdout
    assert finished.losses() == pytest.approx(reference.losses(), rel=1e-5)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000006"]
    assert ckpt.resolve(run_dir).step == 6  # what export, generate and eval pick


def test_resume_with_another_model_is_refused(runs, fallback_run, tmp_path):
    run_dir = fallback_run.check().run_dir
    before = snapshot(run_dir)
    overrides = [o for o in runs.overrides("1proc") if not o.startswith("logger")] + ["logger=none"]
    run = run_train("other-model", 1, [*overrides, "model.d_model=48"], run_dir, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("lmsys-train: error: cannot resume: the model differs"), run.stderr
    assert "model.d_model=48 (checkpoint: 32)" in lines[-1]
    assert "Traceback" not in run.stderr
    assert snapshot(run_dir) == before
    assert not (tmp_path / "runs").exists()


def test_resume_with_another_optimizer_is_refused(runs, fallback_run, tmp_path):
    """An AdamW checkpoint resumed with optim=muon: AdamW's moments cannot continue as Muon's
    momentum, so the resume is one line naming both optimizers and the way to switch."""
    run_dir = fallback_run.check().run_dir
    before = snapshot(run_dir)
    overrides = [o for o in runs.overrides("1proc") if not o.startswith("logger")] + ["logger=none"]
    run = run_train("other-optimizer", 1, [*overrides, "optim=muon"], run_dir, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "lmsys-train: error: cannot resume: the checkpoint was trained with optim=adamw, this run "
        "asks for optim=muon"
    ), run.stderr
    assert "resume with optim=adamw" in line and "model.init_from=" in line
    assert "Traceback" not in run.stderr
    assert snapshot(run_dir) == before


def test_resume_with_another_batch_is_refused_and_leaves_the_run_as_it_was(runs, fallback_run, tmp_path):
    """The loader's saved position is in sequences of the old global batch: continuing with another
    batch would not reproduce the run. Refused once the checkpoint is read, before the run
    directory's config.yaml, run.json or deepspeed.json change."""
    run_dir = fallback_run.check().run_dir
    before = snapshot(run_dir)
    overrides = [o for o in runs.overrides("1proc") if not o.startswith("logger")] + ["logger=none"]
    batch = [o for o in overrides if o.startswith("trainer.global_batch_tokens=")]
    assert batch, overrides
    doubled = f"trainer.global_batch_tokens={2 * int(batch[-1].split('=')[1])}"
    run = run_train("other-batch", 1, [*overrides, doubled], run_dir, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("lmsys-train: error: cannot resume the loader: its saved"), run.stderr
    assert "Traceback" not in run.stderr
    assert snapshot(run_dir) == before


def test_dead_rank_ends_the_attempt_and_max_restarts_resumes(runs, tmp_path):
    """Rank 1 exits at step 3 on the first attempt (after checkpoint 2); torchrun restarts both
    ranks, which find the same default run directory and resume from step 2. Step 5 is made NaN
    on purpose: ZeRO-2 discards it (a skip), so the losses are those of a plain loop without it.
    Document boundaries are masked, so the ranks' loss-weight sums differ and the step's weighted
    mean needs the all-reduced total (without masking lmsys knows it without communicating)."""
    masked = [*runs.overrides("2proc-zero2"), "data.mask_doc_boundaries=true"]
    overrides = [*masked, "debug.crash_at_step=3", "debug.nan_steps=[5]"]
    cmd = train_command(2, overrides, max_restarts=1)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - start < 300  # the survivor did not sit out a collective timeout
    assert "rank 1 exits at step 3" in proc.stdout
    assert "step_0000002 (step 2)" in proc.stdout
    run_dirs = [p for p in (tmp_path / "runs").iterdir()]
    assert len(run_dirs) == 1 and run_dirs[0].name.startswith("tiny-"), run_dirs
    from lmsys.core.rundir import read_metrics

    records = {r["step"]: r for r in read_metrics(run_dirs[0], "train")}
    assert sorted(records) == list(range(1, MAX_STEPS + 1))
    assert records[5]["skipped"] is True and records[5]["loss"] is None
    assert "step 5: loss is nan; skipped the update" in proc.stderr
    want = plain_losses(masked, skip_steps={5})
    for step, loss in want.items():
        assert records[step]["loss"] == pytest.approx(loss, rel=1e-5), (step, records, want)


def test_resume_with_another_tokenizer_is_refused(runs, fallback_run, tmp_path):
    """Same shards, but a tokenizer.model with other bytes (its sha256 recorded in the manifest):
    the checkpoint's token ids would mean other pieces, so resuming is refused."""
    import hashlib
    import json

    run_dir = fallback_run.check().run_dir
    before = snapshot(run_dir)
    data = tmp_path / "data"
    shutil.copytree(runs.data_dir, data)
    tokenizer = data / "tokenizer.model"
    tokenizer.write_bytes(tokenizer.read_bytes() + b"\0")
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    (data / "manifest.json").write_text(json.dumps(manifest))
    overrides = [o for o in runs.overrides("1proc") if not o.startswith(("logger", "data.dir"))]
    run = run_train(
        "other-tokenizer", 1, [*overrides, "logger=none", f"data.dir={data}"], run_dir, cwd=tmp_path
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("lmsys-train: error: cannot resume: the data's tokenizer"), run.stderr
    assert "Traceback" not in run.stderr
    assert snapshot(run_dir) == before
