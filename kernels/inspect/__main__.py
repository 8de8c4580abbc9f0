"""`python -m kernels.inspect`: see kernels/inspect/inspector.py for the options and the report."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and os.environ.get("TRITON_INTERPRET", "0").lower() not in (
    "",
    "0",
    "false",
    "off",
):
    # Compiling for a GPU needs the real @triton.jit functions, which the interpreter replaces
    # when TRITON_INTERPRET is set at import: start again without it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "kernels.inspect", *sys.argv[1:]], env)

from kernels.inspect.inspector import main  # noqa: E402  (imports triton: after the check above)

if __name__ == "__main__":
    sys.exit(main())
