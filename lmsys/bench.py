"""Benchmarks: `python -m lmsys.bench {train,prepare,generate} [args]`. Each prints a ratio against a
baseline measured in the same run, never a pass/fail timing."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "train": "lmsys.bench_train",
        "prepare": "lmsys.bench_prepare",
        "generate": "lmsys.bench_generate",
    }
    if not argv or argv[0] not in commands:
        print(f"usage: python -m lmsys.bench {{{','.join(commands)}}} [args]", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(commands[argv[0]])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
