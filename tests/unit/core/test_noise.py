"""A library's warning, printed while a command runs, carries that command's prefix. The warning
about oversubscribed cores and DeepSpeed's noise in real runs: tests/integration/training/."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.integration.features import REPO_ROOT


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
