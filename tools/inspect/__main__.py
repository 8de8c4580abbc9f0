"""`python -m tools.inspect`: see tools/inspect/inspector.py for the options and the report."""

from __future__ import annotations

import os
import sys

from kernels import runtime

if __name__ == "__main__" and runtime.interpreter_requested():
    # Compiling for a GPU needs the real @triton.jit functions, which the interpreter replaces
    # when it is requested at triton's import: start again without the request.
    sys.stdout.flush()
    os.execve(
        sys.executable, [sys.executable, "-m", "tools.inspect", *sys.argv[1:]], runtime.compiler_environment()
    )

from tools.inspect.inspector import main  # noqa: E402  (imports triton: after the check above)

if __name__ == "__main__":
    sys.exit(main())
