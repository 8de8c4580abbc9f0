"""`python -m tools.bench generate` in this process (tiny, short runs): both rows of each
comparison produce the same tokens, and each prints its ratio. No timing is asserted."""

from __future__ import annotations

import pytest

from tests.fixtures.exports import SMALL


def test_generate_benchmark_runs_both_ways_and_compares(capsys):
    """`python -m tools.bench generate` (tiny, a short run): the same tokens both ways in both rows
    (cache / no cache, one batch / one by one), and their ratios."""
    from tools.bench.__main__ import main

    assert main(["generate", "prompt_tokens=8", "new_tokens=24", "repeats=1", "threads=1", "batch=3"]) == 0
    out = capsys.readouterr().out
    assert "KV cache" in out and "no cache" in out and "one batch" in out and "3 single runs" in out
    assert out.count("(same tokens: yes)") == 2
    ratios = [float(part.split("x")[0]) for part in out.split("ratio")[1:]]
    assert len(ratios) == 2 and min(ratios) > 0


@pytest.mark.slow
def test_generate_benchmark_times_the_batch_compiled(capsys):
    """compile=true: a third row, the batch compiled with inductor (a prompt graph and a decode
    graph), the same tokens as the eager batch, and its ratio against it."""
    from tools.bench.__main__ import main

    # test_compile_cli.py's model and batch size: the same graphs, which inductor's cache then holds
    small = [f"set={o}" for o in SMALL]
    args = ["prompt_tokens=8", "new_tokens=16", "repeats=1", "threads=1", "batch=2", "compile=true", *small]
    assert main(["generate", *args]) == 0
    out = capsys.readouterr().out
    assert "the same batch compiled (torch.compile, inductor; static KV cache): 2 graph(s)" in out
    assert out.count("(same tokens: yes)") == 3
    assert float(out.split("ratio")[-1].split("x")[0]) > 0
