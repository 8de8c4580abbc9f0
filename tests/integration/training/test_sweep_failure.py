"""A sweep job that fails at runtime under `lmsys-train -m` (a real Hydra multirun, jobs in one
process): one error line naming the job, no Hydra "Error executing job" or traceback, the other
jobs still run, the sweep exits with the failed job's status, and the summary's row for it is
complete: status "failed (1)", its wall time, no column beyond the swept key's.

The same output has none of DeepSpeed's noise: no `... built successfully` line, no
`OVERFLOW! Skipping step` beside lmsys's own NaN warning (ZeRO-2), and no promise of DeepSpeed
ops to build (a CPU launch builds none: tests/unit/engine/test_sweep_failure.py)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from tests.integration.features import child_env

pytestmark = pytest.mark.slow


def test_a_failed_sweep_job_is_one_line_and_a_complete_summary_row(runs, tmp_path):
    sweep_dir = tmp_path / "sweep"
    overrides = [o for o in runs.overrides("1proc") if not o.startswith("trainer.max_steps")]
    overrides += ["logger=none", "deepspeed=zero2", "trainer.max_steps=2", "debug.nan_steps=[1]"]
    command = [sys.executable, "-m", "lmsys.train", "-m", *overrides, "trainer.max_nan_skips=0,5"]
    proc = subprocess.run(
        [*command, f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    assert "OVERFLOW" not in output and "built successfully" not in output, output
    assert "builds DeepSpeed's ops" not in output, output  # nothing to build on CPU (below)
    nan_warnings = [line for line in proc.stderr.splitlines() if "loss is nan" in line]
    # lmsys's own, for job 1 (max_nan_skips=5); job 0's NaN is its error line (max_nan_skips=0)
    assert len(nan_warnings) == 1, proc.stderr
    assert "Error executing job" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 2, proc.stderr
    assert errors[0].startswith(
        "lmsys-train: error: sweep job 0 failed (exit 1): loss was NaN/inf or diverged at 1 steps"
    )
    assert errors[1].startswith("lmsys-train: error: 1 sweep job(s) failed: job 0")
    outcomes = [json.loads(line) for line in (sweep_dir / "jobs.jsonl").read_text().splitlines()]
    assert [(o["num"], o["status"], o["returncode"]) for o in outcomes] == [
        (0, "failed", 1),
        (1, "completed", 0),
    ]

    with open(sweep_dir / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    columns = list(rows[0])
    assert columns[:3] == ["job", "trainer.max_nan_skips", "status"], columns  # the swept key only
    assert [r["status"] for r in rows] == ["failed (1)", "completed"], rows
    assert all(float(r["wall_seconds"]) > 0 for r in rows), rows
    assert rows[1]["steps"] == "2" and rows[1]["final_val_loss"], rows
