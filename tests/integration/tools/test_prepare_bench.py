"""The preparation benchmark runs end to end on a tiny corpus and prints its ratio lines; a bad
option is one line. Its integrity part in this process: tests/unit/tools/test_prepare_bench.py.

No timing is asserted: timings belong in the benchmark's output, never in pass/fail tests."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.fixtures.data import REPO_ROOT, child_env


def test_bench_prepare_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "prepare", "mb=0.3", "scale=2", "vocab=400", "sample_mb=0.2",
         f"keep={tmp_path}"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    assert re.search(r"^ratio prepare/single: \d+\.\d\dx \(end to end \d+\.\d\dx\)$", out, re.M), out
    assert re.search(r"^ratio memory 2x/1x: all processes \d+\.\d\d", out, re.M), out
    assert "(same as the baseline)" in out  # prepare wrote exactly the tokens the baseline counted
    rows = {line.split()[0]: line.split() for line in out.splitlines() if re.match(r"^[12]x ", line)}
    assert set(rows) == {"1x", "2x"} and float(rows["2x"][1]) > 1.5 * float(rows["1x"][1])  # corpus MB
    assert (tmp_path / "prepared_2x" / "manifest.json").is_file()


def test_bench_prepare_bad_option():
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "prepare", "size=3"],
        cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "tools.bench prepare: error: unknown option 'size'; valid options: "
        "mb, scale, vocab, workers, sample_mb, keep"
    ]
