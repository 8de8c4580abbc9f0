"""Resuming on another world size and ZeRO stage (lmsys/engine/reshard.py), with real runs:

- 12 steps on 2 ranks at ZeRO-3, uninterrupted, against the same run stopped after step 6 (a
  SIGTERM to one rank: debug.signal_at_step) and continued on 1 rank at ZeRO-2, and
  against one stopped after step 6 on 1 rank at ZeRO-1 and continued on 2 ranks at ZeRO-3: the
  losses of steps 7-12 are the uninterrupted run's to 1e-5 relative;
- ZeRO-0 state continued at ZeRO-3 and ZeRO-3 state at ZeRO-0, fp32 state in bf16 (the matrix's
  step-4 checkpoints);
- what resharding reads back is what DeepSpeed's own consolidation reads (every stage), with
  Adam's moments and step count;
- a resume whose global batch does not split for the new world size is one error line naming
  what fits, with nothing written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from lmsys.engine import checkpoint as ckpt
from lmsys.engine.reshard import MOMENTS, SavedState, trainable_in_optimizer_order
from lmsys.engine.zero import LossModule, consolidated_state_dict
from lmsys.model.transformer import Transformer
from tests.integration.features import child_env, copy_run, run_train

pytestmark = pytest.mark.slow

RTOL = 1e-5
LONG = ["trainer.max_steps=12", "trainer.save_interval=3", "logger=none"]


def assert_losses_close(got: dict[int, float], want: dict[int, float], steps: range) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=RTOL), f"step {step}: {got} vs {want}"


def layout(stage: int, nproc: int) -> list[str]:
    """Overrides of a ZeRO stage on nproc ranks (the global batch of 8 sequences stays)."""
    return [f"deepspeed=zero{stage}", f"trainer.micro_batch_size={8 // nproc}"]


@pytest.fixture(scope="module")
def uninterrupted(runs, tmp_path_factory):
    """12 steps on 2 ranks at ZeRO-3."""
    root = tmp_path_factory.mktemp("reshard")
    overrides = [*runs.overrides("2proc-zero3"), *LONG, *layout(3, 2)]
    return run_train("12-steps", 2, overrides, root / "run", cwd=root).check()


def stopped_then_continued(runs, tmp_path, before: tuple[int, int], after: tuple[int, int]):
    """A run stopped by a SIGTERM to its last rank during step 6 on `before` = (stage, ranks),
    through launch.torchrun, then continued with trainer.resume=auto on `after`."""
    (s1, n1), (s2, n2) = before, after
    run_dir = tmp_path / "run"
    base = [*runs.overrides("2proc-zero3"), *LONG, f"trainer.run_dir={run_dir}"]
    command = [sys.executable, "-m", "launch.torchrun", "--nproc", str(n1), "--"]
    command += [*base, *layout(s1, n1), "debug.signal_at_step=6"]
    first = subprocess.run(
        command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 75, first.stdout + first.stderr  # EXIT_REQUEUE
    reason = "SIGTERM" if n1 == 1 else "a signal to another rank"  # rank 0 learns of it by the all-reduce
    assert f"preempted ({reason}): saving step 6 ... saved {run_dir}" in first.stderr, first.stderr
    assert ckpt.find_latest(run_dir, pytest.fail).step == 6
    second = run_train("continued", n2, [*base, *layout(s2, n2)], run_dir, cwd=tmp_path).check()
    return first, second


def test_zero3_on_two_ranks_continues_at_zero2_on_one(runs, uninterrupted, tmp_path):
    _, run = stopped_then_continued(runs, tmp_path, before=(3, 2), after=(2, 1))
    assert "(step 6; resharded from ZeRO-3 on 2 rank(s), fp32, to ZeRO-2 on 1, fp32)" in run.stdout
    assert sorted(run.losses()) == list(range(1, 13))
    assert_losses_close(run.losses(), uninterrupted.losses(), range(1, 13))
    launches = json.loads((run.run_dir / "run.json").read_text())["launches"]
    assert [launch["world_size"] for launch in launches] == [2, 1]


def test_zero1_on_one_rank_continues_at_zero3_on_two(runs, uninterrupted, tmp_path):
    _, run = stopped_then_continued(runs, tmp_path, before=(1, 1), after=(3, 2))
    assert "(step 6; resharded from ZeRO-1 on 1 rank(s), fp32, to ZeRO-3 on 2, fp32)" in run.stdout
    assert_losses_close(run.losses(), uninterrupted.losses(), range(1, 13))


@pytest.mark.parametrize(
    "source, stage, nproc",
    [("2proc-zero0", 3, 1), ("2proc-zero3", 0, 2)],
    ids=["zero0-2ranks-to-zero3-1rank", "zero3-2ranks-to-zero0-2ranks"],
)
def test_zero0_and_zero3_continue_each_other(runs, tmp_path, source, stage, nproc):
    """The matrix run's step-4 checkpoint (its newer one removed) continued on another layout:
    steps 5 and 6 are the 1-process reference's."""
    run_dir = copy_run(runs.get(source).check(), tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints" / "step_0000006")
    overrides = [*runs.overrides(source), *layout(stage, nproc), "logger=none"]
    run = run_train("continued", nproc, overrides, run_dir, cwd=tmp_path).check()
    assert "(step 4; resharded from ZeRO-" in run.stdout
    assert_losses_close(run.losses(), runs.get("1proc").check().losses(), range(5, 7))


def test_fp32_state_continues_in_bf16(runs, tmp_path):
    """The precision may change too: the matrix's fp32 ZeRO-2 step-4 checkpoint continued in bf16
    at ZeRO-1 on 1 rank (DeepSpeed's bf16 optimizer: fp32 master weights, bf16 compute). The
    losses are the fp32 run's up to bf16 rounding."""
    run_dir = copy_run(runs.get("2proc-zero2").check(), tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints" / "step_0000006")
    overrides = [*runs.overrides("2proc-zero2"), *layout(1, 1), "deepspeed.precision=bf16", "logger=none"]
    run = run_train("bf16", 1, overrides, run_dir, cwd=tmp_path).check()
    assert "(step 4; resharded from ZeRO-2 on 2 rank(s), fp32, to ZeRO-1 on 1, bf16)" in run.stdout
    want = runs.get("1proc").check().losses()
    for step in (5, 6):
        assert run.losses()[step] == pytest.approx(want[step], rel=1e-3)


@pytest.mark.parametrize("case", ["2proc-zero0", "1proc", "2proc-zero1", "2proc-zero2", "2proc-zero3"])
def test_what_resharding_reads_is_what_deepspeed_consolidates(runs, case):
    """Every parameter's fp32 master weights as DeepSpeed's zero_to_fp32 (or, at stage 0, the
    module) has them, with Adam's moments of the same shape and the step count of 6 steps."""
    run = runs.get(case).check()
    found = ckpt.find_latest(run.run_dir, pytest.fail)
    assert found.step == 6
    reference = consolidated_state_dict(found.tag_dir, found.state.zero_stage)
    model = LossModule(Transformer(found.state.model_config(found.tag_dir)))
    names = [name for name, _ in trainable_in_optimizer_order(model)]  # stage 0 indexes by this order
    assert len(names) == len(reference) - 1  # the tied unembedding is one parameter
    saved = SavedState(found.tag_dir, found.state.zero_stage, found.state.world_size, names)
    for name in names:
        state = saved.param(name, reference[name].shape)
        assert torch.equal(state.master, reference[name].float()), name
        assert sorted(state.moments) == sorted(MOMENTS) and state.step == 6.0
        assert all(m.shape == reference[name].shape for m in state.moments.values())
        assert state.moments["exp_avg_sq"].min() >= 0 and state.moments["exp_avg"].abs().sum() > 0


def test_a_resume_whose_batch_does_not_split_is_one_error_line(runs, tmp_path):
    """8 sequences per step on 3 ranks (through launch.torchrun): refused before anything is
    written, in one line naming what fits."""
    run_dir = copy_run(runs.get("2proc-zero2").check(), tmp_path / "run")
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    overrides = [*runs.overrides("2proc-zero2"), "logger=none", f"trainer.run_dir={run_dir}"]
    command = [sys.executable, "-m", "launch.torchrun", "--nproc", "3", "--", *overrides]
    proc = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # the launcher checks the config against the run's newest checkpoint before torchrun starts
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmsys-")]
    assert errors == [
        "lmsys-launch: error: cannot resume step 6 on 3 ranks: its global batch of 8 sequences "
        "(trainer.global_batch_tokens=256 / data.seq_len=32) does not split into micro-batches of 4 on 3 "
        "ranks; keep trainer.micro_batch_size=4 on 1 or 2 ranks (a resumed run keeps "
        "trainer.global_batch_tokens)"
    ], proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before
