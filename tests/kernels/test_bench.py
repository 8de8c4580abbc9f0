"""The benchmark CLI runs end to end (smoke grid; on CPU through the Triton interpreter).

No timing is asserted: timings belong in the benchmark's output, never in pass/fail tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke_runs_and_prints_ratios(tmp_path):
    csv_path = tmp_path / "bench.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.bench", "--smoke", "--csv", str(csv_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    header = next((line for line in out.splitlines() if line.startswith("op ")), None)
    assert header is not None and "ratio" in header.split(), out
    rows = [
        line.split()[0] for line in out.splitlines()[out.splitlines().index(header) + 2 :] if line.strip()
    ]
    assert "layer_norm" in rows, out
    if (REPO_ROOT / "kernels" / "bench_attention.py").exists():
        assert any("attention" in op for op in rows), out
    assert csv_path.read_text().splitlines()[0].split(",")[-1] == "ratio"
