"""`python -m tools.bench [NAME] [options]`: the benchmarks (tools/bench/__init__.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import torch

from kernels import runtime
from lmsys.cli import run_cli
from lmsys.core.errors import UsageError

PROG = "tools.bench"
# name -> (module, arguments put before the user's)
COMMANDS: dict[str, tuple[str, list[str]]] = {
    "kernels": ("tools.bench.kernel_table", []),
    "attention": ("tools.bench.kernel_table", ["--only", "attention"]),
    "layer_norm": ("tools.bench.kernel_table", ["--only", "layer_norm"]),
    "ce": ("tools.bench.ce", []),
    "train": ("tools.bench.train", []),
    "prepare": ("tools.bench.prepare", []),
    "generate": ("tools.bench.generate", []),
    "plan": ("tools.bench.plan.grid", []),
    "ttl": ("tools.bench.ttl", []),
    "checkpoint": ("tools.bench.checkpoint", []),
    "integrity": ("tools.bench.integrity", []),
}
# What `python -m tools.bench` alone runs (make bench), each in a process of its own: the kernel
# table runs the kernels in Triton's interpreter on a CPU, which must not carry over to training.
DEFAULT = (["kernels"], ["train"])
# The benchmarks that run Triton kernels in this process.
KERNEL_COMMANDS = ("kernels", "attention", "layer_norm")
USAGE = f"usage: python -m {PROG} [{{{','.join(COMMANDS)}}}] [options]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if argv[:1] in (["-h"], ["--help"]):
            print(USAGE)
            print("each benchmark prints a ratio against a baseline measured in the same run;")
            print(f"without NAME: {' then '.join(name for (name,) in DEFAULT)} (make bench);")
            print(f"`python -m {PROG} NAME --help` for a benchmark's options and examples")
            return 0
        if not argv:
            runs = [subprocess.run([sys.executable, "-m", PROG, *command]) for command in DEFAULT]
            return max(run.returncode for run in runs)
        if argv[0] not in COMMANDS:
            raise UsageError(f"unknown benchmark {argv[0]!r}; {USAGE}")
        if argv[0] in KERNEL_COMMANDS and not torch.cuda.is_available():
            # Without CUDA the kernels run in the interpreter, chosen before triton is imported
            # (nothing in this process has imported it yet: the benchmark's module will).
            runtime.request_interpreter()
        module, before = COMMANDS[argv[0]]
        # Only the chosen benchmark is imported: each pulls in what it measures (DeepSpeed, ...).
        return int(importlib.import_module(module).main([*before, *argv[1:]]) or 0)

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
