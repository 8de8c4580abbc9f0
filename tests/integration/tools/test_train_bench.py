"""Smoke test of `python -m tools.bench train`: tiny settings, real DeepSpeed and real plain loop;
checks the report (not the timings) and that the benchmark leaves nothing behind; a bad option is
one line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.integration.features import child_env

pytestmark = pytest.mark.slow

TINY = [
    "model.vocab_size=512",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.max_seq_len=32",
    "model.ffn.d_ff=64",
    "trainer.global_batch_tokens=256",
    "trainer.micro_batch_size=4",
    "logger=none",
]


def test_bench_train_prints_the_ratio(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "train", "steps=3", "warmup=1", *TINY],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "256 tokens per step = micro 4 x seq 32 x world 1 x accumulation 2" in out, out
    for name in ("plain PyTorch loop", "lmsys (DeepSpeed)"):
        assert re.search(rf"{re.escape(name)} +[0-9.]+ ms/step \( *[0-9.]+\) +[0-9,]+ tokens/s", out), out
    ratio = r"ratio lmsys/plain ([0-9.]+) \(framework overhead ([+-][0-9.]+)%; best steps: ([0-9.]+)\)"
    match = re.search(ratio, out)
    assert match, out
    assert float(match.group(1)) > 0 and float(match.group(3)) > 0
    assert "torch.compile" not in out  # compiled=auto: only on CUDA
    assert list(tmp_path.iterdir()) == []  # synthetic data and the run live in a temporary dir


def test_bench_train_bad_option_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "train", "steps=1", *TINY],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "tools.bench train: error: steps=1 must be >= 2"
