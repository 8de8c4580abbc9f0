"""User mistakes and training faults: one clear line, a non-zero exit, nothing half-created.

NaN/inf losses are injected with debug.nan_steps: the step is skipped with a warning
(its update discarded exactly: the next loss equals a plain loop's that never took the step)
up to trainer.max_nan_skips times, then training stops with a clear error.
"""

from __future__ import annotations

import pytest

from tests.integration.features import run_train
from tests.integration.training.reference import plain_losses

pytestmark = pytest.mark.slow


def test_nan_steps_are_skipped_then_training_stops(runs, tmp_path):
    overrides = [
        *runs.overrides("1proc"),
        "logger=none",
        "deepspeed=zero0",  # without ZeRO the skip is lmsys's own (ZeRO-2's: test_resume)
        "debug.nan_steps=[2,4]",
        "trainer.max_nan_skips=1",
        "trainer.save_interval=100",  # it stops before its first checkpoint
    ]
    run = run_train("nan", 1, overrides, tmp_path / "run", cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    err = run.stderr.strip().splitlines()
    assert any(
        "warning: step 2: loss is nan; skipped the update (1 of trainer.max_nan_skips=1)" in e for e in err
    )
    assert err[-1].startswith(
        "lmsys-train: error: loss was NaN/inf or diverged at 2 steps, more than trainer.max_nan_skips=1"
    )
    assert "stopping at step 4" in err[-1]
    # no checkpoint was saved: the line points at none (it pointed at a checkpoints/ never made)
    assert "no checkpoint was saved (trainer.save_interval=100)" in err[-1]
    assert "checkpoints in" not in err[-1]
    assert "Traceback" not in run.stderr
    records = {r["step"]: r for r in run.records("train")}
    assert sorted(records) == [1, 2, 3, 4]
    assert records[2]["skipped"] is True and records[2]["loss"] is None and records[4]["skipped"] is True
    want = plain_losses(overrides, skip_steps={2, 4})
    assert records[1]["loss"] == pytest.approx(want[1], rel=1e-5)
    assert records[3]["loss"] == pytest.approx(want[3], rel=1e-5)


BAD = {
    "typo": (["trainer.max_stepz=3"], "max_stepz"),
    "bad-stage": (["deepspeed.stage=5"], "deepspeed.stage=5"),
    "no-such-group": (["deepspeed=zero9"], "zero9"),
    "not-a-multiple": (["trainer.global_batch_tokens=1000"], "not a multiple of data.seq_len=32"),
    "indivisible": (
        ["trainer.micro_batch_size=3"],
        "8 sequences per step (256 / data.seq_len=32), which does not divide by trainer.micro_batch_size=3",
    ),
    "missing-data": (["data.dir={tmp}/no-such-data"], "no-such-data"),
    "vocab-mismatch": (["model.vocab_size=1024"], "vocab"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_config_is_one_line_and_creates_nothing(runs, tmp_path, case):
    extra, needle = BAD[case]
    extra = [e.replace("{tmp}", str(tmp_path)) for e in extra]
    overrides = [*runs.overrides("1proc"), "logger=none", *extra]
    run = run_train(case, 1, overrides, tmp_path / "run", cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("lmsys-train: error: "), run.stderr
    assert needle in lines[0], lines[0]
    assert not (tmp_path / "run").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no runs/, outputs/, .hydra


def test_a_split_shorter_than_one_sequence_is_refused_before_anything_is_written(runs, tmp_path):
    """Sequences that fit the train split but not the val split: refused before the first step,
    not at the first evaluation after checkpoints exist."""
    import json

    splits = json.loads((runs.data_dir / "manifest.json").read_text())["splits"]
    seq = splits["val"]["tokens"]  # seq + 1 tokens per sample: one more than the val split holds
    assert splits["train"]["tokens"] > seq + 1
    extra = [
        f"model.max_seq_len={seq}",
        f"data.seq_len={seq}",
        "trainer.micro_batch_size=1",
        f"trainer.global_batch_tokens={seq}",
    ]
    overrides = [*runs.overrides("1proc"), "logger=none", *extra]
    run = run_train("short-val", 1, overrides, tmp_path / "run", cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("lmsys-train: error: the val split of "), run.stderr
    assert f"fewer than one sequence of {seq + 1}" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
