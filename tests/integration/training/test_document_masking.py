"""data.document_masking=true in real training runs (tests/integration/features.py's RunCache, the matrix's
shape): 2 ranks at ZeRO-2 and ZeRO-3 (activation checkpointing on) give the losses of 1 process,
which gives a plain PyTorch loop's (full logits, the loader's documents passed to the model), and
the masking changes what is learned (the losses differ from the unmasked run's)."""

from __future__ import annotations

import pytest

from tests.integration.training.reference import plain_losses
from tests.integration.training.test_matrix import assert_losses_close

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_two_ranks_give_the_losses_of_one_process(runs, stage):
    one = runs.get("1proc-documents").check().losses()
    run = runs.get(f"2proc-zero{stage}-documents").check()
    assert_losses_close(run.losses(), one)
    assert "activation checkpointing" in run.stdout


def test_one_process_matches_plain_pytorch(runs):
    run = runs.get("1proc-documents").check()
    losses = run.losses()
    assert_losses_close(losses, plain_losses(runs.overrides("1proc-documents")))
    unmasked = runs.get("1proc").check().losses()
    assert max(abs(losses[s] - unmasked[s]) for s in losses) > 1e-3, (losses, unmasked)
