"""`python -m tools.bench` runs one kernel's benchmark alone. The command's names and errors:
tests/unit/tools/test_bench_command.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_one_kernel_alone(tmp_path):
    """`layer_norm` runs the layer-norm rows without the attention's (smoke grid, CPU interpreter
    chosen by the command before triton's import)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "layer_norm", "--smoke"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ops = {
        line.split("  ")[0]
        for line in proc.stdout.splitlines()
        if line.startswith(("layer_norm", "attention"))
    }
    assert ops == {"layer_norm fwd", "layer_norm fwd+bwd"}, proc.stdout
