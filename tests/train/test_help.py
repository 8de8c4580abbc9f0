"""lmsys-train's own help and its one-line mistakes, through the real command (no training)."""

from __future__ import annotations

import subprocess
import sys

from tests.train.conftest import child_env


def lmsys_train(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmsys.train", *args],
        cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_help_lists_groups_keys_and_examples(tmp_path):
    proc = lmsys_train("--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    out = proc.stdout
    assert out.startswith("usage: lmsys-train")
    assert "  model           gpt2_124m," in out, out
    assert "  deepspeed       zero0, zero1, zero2*, zero3, zero3_offload" in out, out
    assert "trainer.max_steps" in out and "examples:" in out and "torchrun" in out
    assert list(tmp_path.iterdir()) == []  # help writes nothing


def test_help_shows_the_values_the_overrides_give(tmp_path):
    out = lmsys_train("model=gpt2_124m", "optim.lr=0.25", "-h", cwd=tmp_path).stdout
    assert any(ln.startswith("  data.seq_len") and ln.endswith("[1024]") for ln in out.splitlines()), out
    assert any(ln.startswith("  optim.lr ") and ln.endswith("[0.25]") for ln in out.splitlines()), out


def test_a_misspelled_key_is_one_line_with_the_nearest_one(tmp_path):
    proc = lmsys_train("optim.lrr=1", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "lmsys-train: error: Key 'lrr' not in 'OptimConfig' (key: optim.lrr); did you mean optim.lr?"
    ]
