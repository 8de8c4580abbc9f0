"""`python -m tools.bench plan`: the plan of a Llama-family model with packed documents against a
real training run's measured CPU tensors (one row of the smoke grid). The GPU prediction table:
tests/unit/tools/test_plan_bench.py."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.integration.features import REPO_ROOT
from tools.bench.plan.grid import PROG


def test_a_llama_with_packed_documents_is_planned_as_its_real_run_measures():
    """llama_tiny (rotary, RMS norm, SwiGLU, grouped-query heads) on packed documents, ZeRO-2, one
    rank: its traced tensors' peak is the plan's to within 0.5%. The documents' masks are about 0.9%
    of this row, so a plan that traced the step without them would miss."""
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "plan", "smoke=true", "only=docs"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith(f"{PROG}: {{")]
    rows = [json.loads(line[len(PROG) + 2 :]) for line in lines]
    assert [r["row"] for r in rows] == ["llama_tiny-w1-z2-mb4-T64-chunked-docs"], proc.stdout
    row = rows[0]
    assert "error" not in row, row
    # a block freed on a thread the profiler does not follow (now and then on one rank too) leaves
    # the peak bracketed: [measured - unseen, measured]
    low, high = row["measured_bytes"] - row["unseen_bytes"], row["measured_bytes"]
    assert low * 0.995 <= row["predicted_bytes"] <= high * 1.005, row
