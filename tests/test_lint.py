"""The code is ruff-clean and ruff-formatted (pyproject.toml's [tool.ruff]): checked by the suite,
so CI catches what `make lint` would."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff(command):
    assert RUFF is not None, "ruff is not installed (it is in the dev extra)"
    proc = subprocess.run([RUFF, *command], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
