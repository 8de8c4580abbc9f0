"""`python -m lmsys.bench {train,prepare,generate,checkpoint} [key=value ...]`: the system benchmarks."""

from __future__ import annotations

import importlib
import sys

from lmsys.cli import run_cli
from lmsys.core.errors import UsageError

COMMANDS = {
    "train": "lmsys.bench.train",
    "prepare": "lmsys.bench.prepare",
    "generate": "lmsys.bench.generate",
    "checkpoint": "lmsys.bench.checkpoint",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if not argv or argv[0] not in COMMANDS:
            raise UsageError(f"usage: python -m lmsys.bench {{{','.join(COMMANDS)}}} [key=value ...]")
        # Only the chosen benchmark is imported: each pulls in what it measures (DeepSpeed, ...).
        return int(importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0)

    return run_cli("lmsys-bench", body)


if __name__ == "__main__":
    sys.exit(main())
