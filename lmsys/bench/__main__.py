"""`python -m lmsys.bench {train,prepare,generate,plan,ttl,checkpoint,integrity} [key=value ...]`:
benchmarks."""

from __future__ import annotations

import importlib
import sys

from lmsys.cli import run_cli
from lmsys.core.errors import UsageError

COMMANDS = {
    "train": "lmsys.bench.train",
    "prepare": "lmsys.bench.prepare",
    "generate": "lmsys.bench.generate",
    "plan": "lmsys.bench.plan",
    "ttl": "lmsys.bench.ttl",
    "checkpoint": "lmsys.bench.checkpoint",
    "integrity": "lmsys.bench.integrity",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if argv[:1] in (["-h"], ["--help"]):  # the benchmarks; each has its own --help with examples
            print(f"usage: python -m lmsys.bench {{{','.join(COMMANDS)}}} [key=value ...]")
            print("each benchmark prints a ratio against a baseline measured in the same run;")
            print("`python -m lmsys.bench train --help` (or prepare, generate) for its options and examples")
            return 0
        if not argv or argv[0] not in COMMANDS:
            raise UsageError(f"usage: python -m lmsys.bench {{{','.join(COMMANDS)}}} [key=value ...]")
        # Only the chosen benchmark is imported: each pulls in what it measures (DeepSpeed, ...).
        return int(importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0)

    return run_cli("lmsys-bench", body)


if __name__ == "__main__":
    sys.exit(main())
