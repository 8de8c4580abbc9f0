"""What a command prints beside its own lines: a warning when this machine's cores are
oversubscribed by torch threads and lmsys training processes, and one prefix per command.
DeepSpeed's noise in a real run's output: tests/train/test_sweep_failure.py."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import torch

from lmsys.core.runtime import oversubscription
from tests.train.conftest import REPO_ROOT


def test_two_runs_on_the_cores_get_a_warning():
    """The trial's case: another training process (a real one, named like lmsys.train) beside a
    run whose torch threads take every core."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "lmsys.train"])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        message = oversubscription(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
        other.kill()
        other.wait()
    assert message is not None and "other lmsys training process(es) on " in message, message
    assert "steps will be many times slower; set OMP_NUM_THREADS=" in message
    assert oversubscription(torch.device("meta")) is None  # only CPU threads compete for the cores


def test_library_warnings_carry_the_commands_prefix():
    """No library line says `lmsys: warning:` while the command's own say `lmsys-train:`: library
    code warns with the running command's name (lmsys.core.console.command)."""
    fixed = []
    for path in sorted((REPO_ROOT / "lmsys").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("warn", "report_error"):
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and first.value == "lmsys":
                    fixed.append(f"{Path(path).relative_to(REPO_ROOT)}:{node.lineno}")
    assert fixed == []
