"""`python -m tools.bench plan predict=true`: the GPU prediction table, no runs. The grid against
real runs: tests/integration/tools/test_plan_bench.py."""

from __future__ import annotations

from tools.bench.plan.grid import main


def test_the_gpu_prediction_table_has_a_row_per_cell(capsys):
    """predict=true: gpt2_124m..1558m x ZeRO 0-3 x 1/8/64 GPUs x two devices, no runs."""
    assert main(["predict=true"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| gpt2_")]
    assert len(table) == 4 * 4 * 3 * 2
    assert all(line.split(" | ")[5] != "none" for line in table), "every GPT-2 size fits somewhere at micro 1"
