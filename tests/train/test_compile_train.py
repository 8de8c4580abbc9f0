"""trainer.compile=true (#14): a real 2-rank torchrun run at ZeRO-2 compiled with inductor trains
with the eager run's losses (1e-4 relative), reports its compilation once, and compiles no graph
after the first step but evaluation's own (no gradients)."""

from __future__ import annotations

import re

import pytest

from tests.train.conftest import MAX_STEPS

pytestmark = pytest.mark.slow


def test_compiled_training_matches_eager(runs):
    compiled = runs.get("2proc-zero2-compiled").check()
    eager = runs.get("2proc-zero2").check().losses()
    got = compiled.losses()
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    for step, loss in eager.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), (step, got, eager)
    first = [
        line for line in compiled.stdout.splitlines() if "torch.compile: 1 graph(s), 0 graph break(s)" in line
    ]
    assert len(first) == 1 and re.search(r"compiled in [\d.]+ s \(the first step took [\d.]+ s\)", first[0])
    # rank 0's process: the training step's graph and evaluation's, nothing per step after that
    assert "torch.compile: 2 graph(s) in all" in compiled.stdout, compiled.stdout
