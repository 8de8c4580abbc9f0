"""`python -m lmsys.sweep summarize SWEEP_DIR [--no-plot] [--baseline KEY=VALUE]`: the summary of
a sweep again, with per-seed comparisons against a baseline configuration (lmsys/sweep/stats.py)."""

from __future__ import annotations

import sys

from lmsys.cli import run_cli
from lmsys.core.errors import UsageError
from lmsys.sweep.summary import CSV_FILE, GROUPS_FILE, PLOT_FILE, PROG, summarize

USAGE = f"""usage: python -m lmsys.sweep summarize SWEEP_DIR [--no-plot] [--baseline KEY=VALUE]

Compare the jobs of a sweep directory: tables here, {CSV_FILE}, {GROUPS_FILE} and {PLOT_FILE} in
SWEEP_DIR. Jobs equal in everything but trainer.seed are one configuration ({GROUPS_FILE}: n,
mean, std, ci95). --baseline optim=adamw: every other configuration's per-seed differences from
the baseline's runs (mean, ci95, paired t-test p-value)."""


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
        baseline = None
        if "--baseline" in rest:
            at = rest.index("--baseline")
            if at + 1 >= len(rest):
                raise UsageError("--baseline needs KEY=VALUE (e.g. --baseline optim=adamw)")
            baseline = rest[at + 1]
            rest = rest[:at] + rest[at + 2 :]
        dirs = [a for a in rest if a != "--no-plot"]
        if len(dirs) != 1 or dirs[0].startswith("-"):
            raise UsageError(f"summarize takes one sweep directory; {USAGE.splitlines()[0]}")
        summarize(dirs[0], plot_png=not no_plot, baseline=baseline)
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
