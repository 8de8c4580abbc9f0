"""trainer.compile=true: real 2-rank torchrun runs compiled with inductor, at ZeRO-2 (the loss
module compiled) and ZeRO-3 (each block compiled, the blocks ZeRO-3 leaf modules), as one Hydra
sweep in one process per rank. Each trains with its eager run's losses (1e-4 relative), reports
its own compilation once (dynamo's counters are process-wide; each job counts from its start),
and compiles no graph after the first step but evaluation's own (no gradients)."""

from __future__ import annotations

import re

import pytest

from tests.integration.features import MAX_STEPS

pytestmark = pytest.mark.slow

HEADER = "lmsys-train: sweep job "


def _job_output(stdout: str, number: int) -> str:
    """The lines the sweep's job `number` printed (from its header to the next)."""
    jobs = re.split(rf"^(?={re.escape(HEADER)})", stdout, flags=re.M)[1:]
    assert len(jobs) == 2 and jobs[number].startswith(f"{HEADER}{number}: "), stdout
    return jobs[number]


@pytest.mark.parametrize("job,stage", [(0, 2), (1, 3)])
def test_compiled_training_matches_eager(runs, job, stage):
    compiled = runs.get(f"2proc-zero{stage}-compiled").check()
    eager = runs.get(f"2proc-zero{stage}").check().losses()
    got = compiled.losses()
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    for step, loss in eager.items():
        assert got[step] == pytest.approx(loss, rel=1e-4), (step, got, eager)
    output = _job_output(compiled.stdout, job)
    first = [line for line in output.splitlines() if "torch.compile: 1 graph(s), 0 graph break(s)" in line]
    assert len(first) == 1 and re.search(r"compiled in [\d.]+ s \(the first step took [\d.]+ s\)", first[0])
    # rank 0's process: the training step's graph and evaluation's, nothing per step after that
    assert "torch.compile: 2 graph(s) in all" in output, output
    assert "warning" not in output
