"""`python -m lmsys.sweep summarize SWEEP_DIR [--no-plot]`: the summary of a sweep again."""

from __future__ import annotations

import sys

from lmsys.cli import run_cli
from lmsys.core.errors import UsageError
from lmsys.sweep.summary import CSV_FILE, PLOT_FILE, PROG, summarize

USAGE = f"""usage: python -m lmsys.sweep summarize SWEEP_DIR [--no-plot]

Compare the jobs of a sweep directory: a table here, {CSV_FILE} and {PLOT_FILE} in SWEEP_DIR."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2

    def body() -> int:
        command, rest = argv[0], argv[1:]
        if command != "summarize":
            raise UsageError(f"unknown command {command!r}; the command is: summarize")
        no_plot = "--no-plot" in rest
        dirs = [a for a in rest if a != "--no-plot"]
        if len(dirs) != 1 or dirs[0].startswith("-"):
            raise UsageError(f"summarize takes one sweep directory; {USAGE.splitlines()[0]}")
        summarize(dirs[0], plot_png=not no_plot)
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
