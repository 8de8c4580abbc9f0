"""Ulysses sequence parallelism (trainer.sequence_parallel, lmsys/engine/sequence_parallel.py):

- the model's math: on 4 ranks (ulysses_probe.py beside this file), in groups of 4 and of 2, the loss
  and every gradient are the single-device model's, for learned, sinusoidal and rotary positions,
  bos_shift, grouped-query attention with key/value heads split and copied, packed documents, and
  the Triton kernels (flash attention, with grouped heads and documents too; the fused loss; the
  Llama family's), interpreted, inside DeepSpeed's exchange;
- real runs (tests/integration/features.py's matrix): 2 ranks in one group give the losses of 1 process
  at ZeRO-0 and ZeRO-3 for tiny and llama_tiny (grouped-query) with packed documents, and 4 ranks
  in 2 groups (accumulation, activation checkpointing, ZeRO-3, Muon, async saves) give them too;
- a run saved at P=2 on 2 ranks continues at P=1 on 1 process with the uninterrupted run's losses,
  and a run saved by 1 process continues at P=2 on 2 ranks with its losses;
- lmsys-plan's predicted growth of a rank's peak from T to 4T is the measured one's within 10%
  (each rank's CPU tensors traced by the planner bench's probe, tools.bench.plan.tensor_trace);
- bad settings are one error line each, before any process group forms (the trainer's line too).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmsys.core.config import compose
from lmsys.core.devices import cpu_device, device_spec
from lmsys.core.errors import ConfigError
from lmsys.core.runtime import resume_batch_split, split_batch
from lmsys.planning.planner import plan_launch
from tests.integration.features import TORCHRUN, Run, RunCache, child_env, copy_run, run_train
from tests.integration.training.test_matrix import assert_losses_close
from tests.integration.training.ulysses_probe import CASES as PROBE_CASES


@pytest.mark.slow
def test_the_sharded_model_computes_the_single_device_loss_and_gradients(tmp_path):
    script = Path(__file__).with_name("ulysses_probe.py")
    command = [TORCHRUN, "--standalone", "--nproc_per_node=4", str(script), str(tmp_path)]
    proc = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(4):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(report) == sorted(PROBE_CASES)
        for case, found in report.items():
            assert found["loss"] == pytest.approx(found["reference"], rel=1e-6), (rank, case, found)
            assert found["largest_gradient_difference"] < 1e-6, (rank, case, found)


def assert_same_training(run: Run, reference: Run) -> None:
    """The losses to 1e-5 and the gradient norms to 1e-4 (Adam hides a gradient off by a constant
    factor from the losses; the norm and its clipping do not)."""
    assert_losses_close(run.losses(), reference.losses())
    norms = {r["step"]: r["grad_norm"] for r in run.records("train")}
    for r in reference.records("train"):
        assert norms[r["step"]] == pytest.approx(r["grad_norm"], rel=1e-4), (norms, r)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3], ids=["zero0", "zero3"])
@pytest.mark.parametrize("model", ["tiny", "llama_tiny"])
def test_two_ranks_in_one_group_give_the_losses_of_one_process(runs, stage, model):
    reference = f"1proc-documents-heads4-{model}"
    run = runs.get(f"ulysses-zero{stage}-{model}").check()
    assert_same_training(run, runs.get(reference).check())
    assert "Ulysses sequence parallel 2" in run.stdout
    assert (
        "256 tokens per step = micro 8 x seq 32 x world 2 / sequence parallel 2 x accumulation 1"
        in run.stdout
    )


@pytest.mark.slow
def test_two_groups_of_two_give_the_losses_of_one_process(runs):
    run = runs.get("ulysses4-zero3-accum2-actckpt-muon").check()
    assert_same_training(run, runs.get("1proc-muon-zero2").check())
    assert "micro 2 x seq 32 x world 4 / sequence parallel 2 x accumulation 2" in run.stdout
    ranks = run.stats()["ranks"]
    assert len(ranks) == 4  # ZeRO-3 partitions over every rank (DeepSpeed's sequence-data-parallel group)
    for rank in ranks:
        assert rank["param_bytes"] == pytest.approx(rank["full_param_bytes"] / 4, rel=0.05), ranks


@pytest.mark.slow
def test_a_run_saved_at_p2_continues_at_p1_on_one_process(runs, tmp_path):
    """The P=2 ZeRO-3 run's step-4 checkpoint (its newer one removed) continued by 1 process
    without sequence parallelism: steps 5 and 6 are the uninterrupted P=2 run's."""
    source = runs.get("ulysses-zero3-tiny").check()
    run_dir = copy_run(source, tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints" / "step_0000006")
    overrides = [*runs.overrides("ulysses-zero3-tiny"), "trainer.sequence_parallel=1", "logger=none"]
    run = run_train("continued", 1, overrides, run_dir, cwd=tmp_path).check()
    assert "(step 4; resharded from ZeRO-3 on 2 rank(s), fp32, to ZeRO-3 on 1, fp32)" in run.stdout
    assert "Ulysses" not in run.stdout
    want = source.losses()
    for step in (5, 6):
        assert run.losses()[step] == pytest.approx(want[step], rel=1e-5), (run.losses(), want)


@pytest.mark.slow
def test_a_run_saved_at_p1_continues_at_p2_on_two_ranks(runs, tmp_path):
    """The 1-process run's step-4 checkpoint (ZeRO-2, packed documents) continued by 2 ranks in one
    group of 2: steps 5 and 6 are the uninterrupted 1-process run's."""
    source = runs.get("1proc-documents").check()
    run_dir = copy_run(source, tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints" / "step_0000006")
    overrides = [*runs.overrides("1proc-documents"), "trainer.sequence_parallel=2"]
    run = run_train("continued", 2, overrides, run_dir, cwd=tmp_path).check()
    assert "(step 4; resharded from ZeRO-2 on 1 rank(s), fp32, to ZeRO-2 on 2, fp32)" in run.stdout
    assert "Ulysses sequence parallel 2" in run.stdout
    want = source.losses()
    for step in (5, 6):
        assert run.losses()[step] == pytest.approx(want[step], rel=1e-5), (run.losses(), want)


def confirmed_peaks(runs: RunCache, case: str) -> list[int]:
    """Each rank's traced peak less the blocks whose free went unseen: buffers of the collectives
    (the all-to-alls', the gradients' all-reduce) that gloo's threads let go of after the call."""
    return [r["bytes"] - r["unseen_bytes"] for r in runs.traced_peaks(case)]


@pytest.mark.slow
def test_activation_memory_per_rank_grows_about_half_as_fast_at_p2(runs):
    """From T=512 to 4T, the largest rank's traced peak grows at most 0.6x as much at P=2 as at
    P=1 (the activations of T/P positions; the all-to-alls' buffers on top)."""
    growth = {}
    for p in (1, 2):
        short, long = (confirmed_peaks(runs, f"ulysses-memory-p{p}-t{t}") for t in (512, 2048))
        growth[p] = max(b - a for a, b in zip(short, long, strict=True))
    assert 0.4 * growth[1] < growth[2] <= 0.6 * growth[1], growth


def planned_peak(runs, p: int, t: int) -> int:
    """lmsys-plan's peak per rank for the traced run at P=p, T=t (2 ranks of this CPU)."""
    cfg = compose(runs.traced_overrides(f"ulysses-memory-p{p}-t{t}"))
    return plan_launch(cfg, 2, cpu_device(), suggest=False).tensor_bytes


@pytest.mark.slow
@pytest.mark.parametrize("p", [1, 2])
def test_the_plan_predicts_the_growth_from_t_to_4t_within_ten_percent(runs, p):
    """The plan counts a rank's T/P positions (each attending over all T): its predicted growth of
    the peak per rank from T=512 to 4T is the measured one's within 10%, at P=1 and at P=2."""
    short, long = (confirmed_peaks(runs, f"ulysses-memory-p{p}-t{t}") for t in (512, 2048))
    measured = max(b - a for a, b in zip(short, long, strict=True))
    predicted = planned_peak(runs, p, 2048) - planned_peak(runs, p, 512)
    assert predicted == pytest.approx(measured, rel=0.10), (predicted, measured)


def test_the_plan_counts_a_ranks_share_and_suggests_sequence_parallelism():
    """llama3_2_1b at T=688,128 on 8 H100: at P=1 it does not fit, and the suggestions name the
    sequence-parallel sizes that do; at P=8 a rank's traced activations are an eighth (and the
    exchange's buffers), and the step time carries the all-to-alls."""
    t = 688_128
    base = [
        "model=llama3_2_1b",
        f"data.seq_len={t}",
        f"model.max_seq_len={t}",
        "trainer.micro_batch_size=1",
        f"trainer.global_batch_tokens={8 * t}",
        "deepspeed=zero3",
        "deepspeed.activation_checkpointing=true",
    ]
    whole = plan_launch(compose(base), 8, device_spec("h100"))
    assert not whole.fits
    fitting = {s.change for s in whole.suggestions if s.fits}
    assert {f"trainer.sequence_parallel={p}" for p in (2, 4, 8)} <= fitting
    sharded = plan_launch(compose([*base, "trainer.sequence_parallel=8"]), 8, device_spec("h100"))
    assert sharded.fits
    # the traced rank's activations: those of T/8 positions, with the whole rows it receives and the
    # exchange's buffers on top (less than 1% here)
    eighth = whole.components["activations"] / 8
    assert eighth <= sharded.components["activations"] <= 1.01 * eighth
    assert sharded.batch.grad_accum == 8 * whole.batch.grad_accum
    assert sharded.flops_per_step == pytest.approx(whole.flops_per_step)  # each rank's share of the step
    assert "sequence parallelism's all-to-alls add" in sharded.time_source
    assert sharded.step_time_s > whole.step_time_s


# ----------------------------------------------------------------------------- bad settings


def small(*extra: str) -> list[str]:
    return ["model=llama_tiny", "data.seq_len=32", *extra]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            small("trainer.sequence_parallel=3"),
            "trainer.sequence_parallel=3 does not divide model.n_heads=4: each rank of a group attends "
            "with n_heads / 3 of the query heads; use trainer.sequence_parallel=2 or 4",
        ),
        (
            small("model.n_heads=8", "model.attention.n_kv_heads=2", "trainer.sequence_parallel=8"),
            None,  # 2 key/value heads copied to 8 ranks: allowed
        ),
        (
            small(
                "model.n_heads=12",
                "model.d_model=96",
                "model.attention.n_kv_heads=3",
                "trainer.sequence_parallel=2",
            ),
            "trainer.sequence_parallel=2 and model.attention.n_kv_heads=3: the key/value heads are split "
            "among the 2 ranks of a group (a multiple of 2) or copied to them (a divisor of 2), and 3 is "
            "neither; use trainer.sequence_parallel=3, 6 or 12",
        ),
        (
            small("data.seq_len=30", "trainer.sequence_parallel=4"),
            "data.seq_len=30 does not divide by trainer.sequence_parallel=4: each rank of a group holds "
            "data.seq_len / 4 positions of every sequence; use e.g. data.seq_len=28",
        ),
        (small("trainer.sequence_parallel=0"), "trainer.sequence_parallel=0 must be >= 1 (1: off)"),
    ],
    ids=["heads", "kv-copied", "kv-heads", "seq-len", "zero"],
)
def test_a_model_or_sequence_that_does_not_split_is_one_error(overrides, needle):
    if needle is None:
        assert compose(overrides).trainer.sequence_parallel == 8
        return
    with pytest.raises(ConfigError) as caught:
        compose(overrides)
    assert str(caught.value) == needle


def test_a_size_that_does_not_divide_the_world_is_one_line_from_the_trainer(tmp_path):
    """1 process at P=2: one error line, exit 2, before any process group, data or run directory."""
    command = [sys.executable, "-m", "lmsys.train", *small("trainer.sequence_parallel=2"),
               f"data.dir={tmp_path / 'absent'}", f"trainer.run_dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "lmsys-train: error: trainer.sequence_parallel=2 does not divide the world size 1: the ranks form "
        "groups of 2; launch a multiple of 2 ranks or use trainer.sequence_parallel=1"
    ]
    assert list(tmp_path.iterdir()) == []  # no run directory, no Hydra output


def test_the_batch_arithmetic_counts_groups():
    cfg = compose(
        small("trainer.sequence_parallel=2", "trainer.micro_batch_size=2", "trainer.global_batch_tokens=256")
    )
    batch = split_batch(cfg, 4)
    assert (batch.data_parallel, batch.grad_accum, batch.global_batch_sequences) == (2, 2, 8)
    assert batch.arithmetic() == (
        "256 tokens per step = micro 2 x seq 32 x world 4 / sequence parallel 2 x accumulation 2"
    )
    assert [batch.shard(r).index for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ConfigError) as caught:
        split_batch(cfg, 3)
    assert str(caught.value) == (
        "trainer.sequence_parallel=2 does not divide the world size 3: the ranks form groups of 2; "
        "launch a multiple of 2 ranks or use trainer.sequence_parallel=1 or 3"
    )
    too_big = compose(
        small("trainer.sequence_parallel=2", "trainer.micro_batch_size=3", "trainer.global_batch_tokens=256")
    )
    with pytest.raises(ConfigError) as caught:
        split_batch(too_big, 4)
    assert str(caught.value) == (
        "trainer.global_batch_tokens=256 gives 8 sequences per step (256 / data.seq_len=32), which does "
        "not divide by trainer.micro_batch_size=3 x world_size=4 / trainer.sequence_parallel=2 = 6; use a "
        "multiple of 192 tokens, e.g. trainer.global_batch_tokens=192"
    )
    with pytest.raises(ConfigError) as caught:
        resume_batch_split(too_big, 4, step=6)
    assert str(caught.value) == (
        "cannot resume step 6 on 4 ranks: its global batch of 8 sequences (trainer.global_batch_tokens=256 "
        "/ data.seq_len=32) does not split into micro-batches of 3 on 2 groups of 2 ranks "
        "(trainer.sequence_parallel=2); use trainer.micro_batch_size=1, 2 or 4 on 4 ranks (a resumed run "
        "keeps trainer.global_batch_tokens)"
    )
