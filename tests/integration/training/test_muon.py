"""optim=muon (DeepSpeed's MuonWithAuxAdam, lmsys/engine/muon.py) with real runs from the matrix:

- at ZeRO 0, 1, 2 and 3 on 2 ranks, and at ZeRO-3 with optimizer and parameters offloaded on 1,
  the losses are the 1-process ZeRO-2 run's within 1e-5 relative;
- it is Muon (the optimizer named, losses unlike AdamW's, it learns), and its state is in the
  checkpoint: Muon's momentum for the blocks' matrices, Adam's moments and step for the rest;
- resume: the step-4 checkpoint continued at its own layout gives steps 5-6 bit for bit, and so
  does the same command after kill -9 of the whole job once that checkpoint is complete; continued
  on another world size and ZeRO stage (lmsys/engine/reshard.py), within 1e-5;
- the weights DeepSpeed consolidates (what lmsys-export reads) are the saved master weights.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from lmsys.core.config import compose
from lmsys.engine import checkpoint as ckpt
from lmsys.engine.muon import split_parameters
from lmsys.engine.reshard import MOMENTS, MUON_MOMENTS, SavedState, trainable_in_optimizer_order
from lmsys.engine.zero import LossModule, consolidated_state_dict, lr_at
from lmsys.model.transformer import Transformer
from tests.integration.features import MAX_STEPS, copy_run, kill9_after_checkpoint, run_train
from tests.integration.training.test_matrix import assert_losses_close

pytestmark = pytest.mark.slow

STAGES = [0, 1, 2, 3]


@pytest.mark.parametrize("stage", STAGES, ids=[f"zero{s}" for s in STAGES])
def test_muon_on_two_ranks_matches_one_process(runs, stage):
    reference = runs.get("1proc-muon-zero2").check().losses()
    assert_losses_close(runs.get(f"2proc-zero{stage}-muon").check().losses(), reference)


def test_muon_with_offload_matches(runs):
    run = runs.get("1proc-muon-zero3").check()
    engine = run.stats()["engine"]
    assert engine["stage"] == 3 and engine["offload_optimizer"] and engine["offload_param"]
    assert_losses_close(run.losses(), runs.get("1proc-muon-zero2").check().losses())


def test_muon_is_muon_and_learns(runs):
    run = runs.get("1proc-muon-zero2").check()
    assert run.stats()["engine"]["optimizer"] == "DeepSpeed Muon + AdamW"
    optim = compose(
        ["optim=muon", "optim.lr=3e-3", "optim.warmup_steps=2", "optim.schedule=wsd", "optim.decay_frac=0.5"]
    ).optim
    for r in run.records("train"):  # the warmup-stable-decay curve, end to end
        assert r["lr"] == pytest.approx(lr_at(r["step"], optim, MAX_STEPS), rel=1e-12)
    assert [r["lr"] for r in run.records("train")][1:3] == pytest.approx([3e-3] * 2)  # stable
    muon, adamw = run.losses(), runs.get("1proc").check().losses()
    assert muon[1] == pytest.approx(adamw[1], rel=1e-6)  # same model, same batch
    assert all(abs(muon[s] - adamw[s]) > 1e-3 for s in range(3, MAX_STEPS + 1)), (muon, adamw)
    assert muon[MAX_STEPS] < muon[1] - 0.05, muon


@pytest.mark.parametrize("case", ["2proc-zero0-muon", "2proc-zero2-muon", "2proc-zero3-muon"])
def test_muon_state_is_in_the_checkpoint(runs, case):
    """Every parameter's saved state, as resharding reads it: the blocks' matrices carry Muon's
    momentum, everything else Adam's moments and 6 steps; the masters are what DeepSpeed
    consolidates (lmsys-export's read)."""
    found = ckpt.find_latest(runs.get(case).check().run_dir, pytest.fail)
    reference = consolidated_state_dict(found.tag_dir, found.state.zero_stage)
    model = LossModule(Transformer(found.state.model_config(found.tag_dir)))
    muon, _, _ = split_parameters(model)  # tags the parameters: the optimizer's order
    names = [name for name, _ in trainable_in_optimizer_order(model)]
    saved = SavedState(found.tag_dir, found.state.zero_stage, found.state.world_size, names)
    hidden = {id(p) for p in muon}
    assert len(hidden) == 8  # w_qkv, w_o and the MLP's two matrices, in 2 blocks
    for name, p in model.named_parameters():
        state = saved.param(name, reference[name].shape)
        assert torch.equal(state.master, reference[name].float()), name
        if id(p) in hidden:
            assert sorted(state.moments) == list(MUON_MOMENTS) and ".blocks." in name, name
            assert state.moments["momentum_buffer"].abs().sum() > 0
        else:
            assert sorted(state.moments) == sorted(MOMENTS) and state.step == 6.0, name


@pytest.mark.parametrize(
    "source, stage, nproc, exact",
    [("2proc-zero2-muon", 2, 2, True), ("2proc-zero0-muon", 3, 1, False)],
    ids=["zero2-same-layout", "zero0-2ranks-to-zero3-1rank"],
)
def test_muon_resumes(runs, tmp_path, source, stage, nproc, exact):
    run_dir = copy_run(runs.get(source).check(), tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints" / "step_0000006")
    overrides = [*runs.overrides(source), f"deepspeed=zero{stage}", f"trainer.micro_batch_size={8 // nproc}"]
    run = run_train("continued", nproc, [*overrides, "logger=none"], run_dir, cwd=tmp_path).check()
    assert "(step 4" in run.stdout and ("resharded" in run.stdout) != exact, run.stdout
    want = runs.get(source if exact else "1proc-muon-zero2").check().losses()
    if exact:
        assert {s: run.losses()[s] for s in (5, 6)} == {s: want[s] for s in (5, 6)}  # bit for bit
    else:
        for s in (5, 6):
            assert run.losses()[s] == pytest.approx(want[s], rel=1e-5), (run.losses(), want)


def test_muon_resume_after_kill9_is_exact(runs, tmp_path):
    overrides = [*runs.overrides("2proc-zero2-muon"), "logger=none"]
    run_dir, steps, survivors = kill9_after_checkpoint(overrides, tmp_path)
    assert 4 <= max(steps) < MAX_STEPS and survivors == [], (steps, survivors)
    run = run_train("resumed", 2, overrides, run_dir, cwd=tmp_path).check()
    assert "resumed from" in run.stdout and "step_0000004 (step 4)" in run.stdout, run.stdout
    assert run.losses() == runs.get("2proc-zero2-muon").check().losses()  # bit for bit, steps 1-6
