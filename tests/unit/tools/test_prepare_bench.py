"""The data-integrity benchmark (`python -m tools.bench prepare`'s integrity part) on a tiny input, in
this process. The command end to end: tests/integration/tools/test_prepare_bench.py.

No timing is asserted: timings belong in the benchmark's output, never in pass/fail tests."""

from __future__ import annotations

import re


def test_the_integrity_benchmark_runs_small(capsys):
    """`python -m tools.bench integrity`, 4 MB: every check timed, and the id check's ratio."""
    from tools.bench.integrity import main

    assert main(["mb=4"]) == 0
    out = capsys.readouterr().out
    for check in ("full check (sha256 + ids)", "id check", "sample"):
        assert re.search(rf"{re.escape(check)} +warm: +[\d.]+ s +\d+ MB/s", out), out
    assert re.search(r"id check / full check \(warm\): [\d.]+x the time", out), out
