"""The kernel benchmarks run end to end (`python -m tools.bench kernels`, `ce`: smoke grids; on CPU
through the Triton interpreter). The pieces a reader relies on to check the targets:
tests/unit/tools/test_kernel_bench.py.

No timing is asserted: timings belong in the benchmark's output, never in pass/fail tests."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`python -m tools.bench kernels --smoke --csv`, once for the tests that read it."""
    csv_path = tmp_path_factory.mktemp("bench") / "bench.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "kernels", "--smoke", "--csv", str(csv_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, csv_path


def test_bench_smoke_runs_and_prints_ratios(smoke_run):
    proc, csv_path = smoke_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    header = next((line for line in out.splitlines() if line.startswith("op ")), None)
    assert header is not None and "ratio" in header.split() and "ours_pct_peak_hbm" in header.split(), out
    assert "targets (the kernel grid" in out and "attention bwd vs sdpa-flash" in out, out

    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames is not None and reader.fieldnames[-1] == "ratio"
        rows = list(reader)
    ops = {row["op"] for row in rows}
    assert {"layer_norm fwd", "layer_norm fwd+bwd"} <= ops, out
    assert {"attention fwd", "attention bwd", "attention fwd+bwd"} <= ops, out
    for row in rows:
        assert math.isfinite(float(row["ratio"])), row
        if row["op"].startswith("attention"):
            assert row["ours_pct_peak_hbm"] == "-", row
        elif torch.cuda.is_available():
            assert row["ours_pct_peak_hbm"] != "-", row
        else:  # the peak bandwidth of a CPU is unknown: n/a, not a made-up percentage
            assert row["ours_pct_peak_hbm"] == "n/a", row


LLAMA_OPS = {
    "rms_norm fwd", "rms_norm fwd+bwd", "rotary fwd+bwd", "swiglu fwd+bwd", "attention gqa fwd+bwd",
    "attention docs fwd+bwd",
}  # fmt: skip


def test_llama_family_rows(smoke_run):
    """The Llama family's kernels have their rows, each against its torch path (the packed
    documents also against our kernel over the same rows as one document)."""
    proc, csv_path = smoke_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    with csv_path.open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["op"] in LLAMA_OPS]
    assert {row["op"] for row in rows} == LLAMA_OPS
    baselines = {(row["op"], row["baseline"]) for row in rows}
    assert ("attention docs fwd+bwd", "ours, one document") in baselines, baselines
    assert ("rms_norm fwd+bwd", "rms_norm_reference") in baselines, baselines
    for row in rows:
        assert math.isfinite(float(row["ratio"])), row
    docs = next(row for row in rows if row["op"] == "attention docs fwd+bwd")
    assert "docs=4x32" in docs["shape"], docs


def test_bench_ce_runs_each_variant_in_its_own_process():
    """`python -m tools.bench ce` at small shapes: full and chunked (fused too on CUDA) and torch's
    F.linear_cross_entropy with each chunking option give the same loss, each with its peak
    memory, time and ratios against full, and the target line."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench",
            "ce",
            "--n",
            "700",
            "--d",
            "48",
            "--v",
            "3001",
            "--repeat",
            "1",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {
        line.split()[0]: line.split()
        for line in proc.stdout.splitlines()
        if line.split()[:1] in (["full"], ["chunked"], ["fused"])
        or line.startswith("torch ")
        or line.startswith("torch-")
    }
    ours = {"full", "chunked", "fused"} if torch.cuda.is_available() else {"full", "chunked"}
    expected = ours | {"torch", "torch-auto", "torch-ar1", "torch-ar2", "torch-b1024"}
    assert set(rows) == expected, proc.stdout
    losses = {name: float(row[3]) for name, row in rows.items()}
    assert len(set(losses.values())) == 1, losses  # the same loss, to the 4 decimals printed
    assert rows["full"][4:] == ["1.0x", "1.00x"]
    assert float(rows["chunked"][1]) > 0  # a measured peak above the inputs
    assert "target (" in proc.stdout and "less peak memory" in proc.stdout
    assert "torch's fastest (torch" in proc.stdout  # whichever of its rows ran fastest
