"""The plan of a launch (lmsys/planning/), in this process: the trace against the same step run on
real tensors (a sequence-parallel rank's too), ZeRO's arithmetic against exact counts, a model
option the planner never saw, offload's host memory, the suggestions, evaluations, the startup
and memory lines, and the bench's tensor trace. The command and real runs:
tests/integration/training/test_plan.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmsys.core.config import compose
from lmsys.core.console import Console
from lmsys.core.devices import GPUS, device_spec
from lmsys.core.runtime import SequenceShard, Setup
from lmsys.engine.sequence_parallel import shard_sequences
from lmsys.model.transformer import Transformer
from lmsys.planning import trace as traced
from lmsys.planning.planner import plan_launch
from lmsys.planning.report import evaluation_warning, startup_line
from lmsys.planning.zero_memory import step_memory
from lmsys.training.peak_memory import (
    Measured,
    PeakMemory,
    diagnoses_run,
    diagnosis,
    measured_peak_bytes,
    memory_line,
)
from lmsys.training.reporter import Reporter
from tests.integration.features import COMMON, SEQ
from tools.bench.plan.tensor_trace import TensorPeak

SMALL = [o for o in COMMON if o.startswith("model.")] + [
    "trainer.global_batch_tokens=256",
    "trainer.micro_batch_size=4",
]


def _plan(overrides: list[str], world: int = 1, device: str = "cpu", memory: int = 0):
    return plan_launch(compose([*SMALL, *overrides]), world, device_spec(device, memory))


def _summary(live, formed, fetched, backward_start) -> tuple:
    """What the plan reads off a trace: the peaks of the forward and of the whole step, the bytes alive
    when the backward starts and at its end, the gradients' and the parameters' order."""
    dedup = lambda series: tuple(v for i, v in enumerate(series) if i == 0 or v != series[i - 1])  # noqa: E731
    forward = live[:backward_start]
    return max(forward), forward[-1], max(live), live[-1], dedup(formed), dedup(fetched)


LLAMA_DOCUMENTS = [
    "model.positions.kind=rotary",
    "model.norm.formula=rms",
    "model.attention.n_kv_heads=1",
    "model.ffn.gated=true",
    "model.ffn.activation=silu",
    "data.document_masking=true",
]


@pytest.mark.parametrize("size", [1, 2], ids=["whole", "sequence-parallel-2"])
@pytest.mark.parametrize("family", [[], LLAMA_DOCUMENTS], ids=["gpt", "llama-documents"])
def test_the_trace_is_the_steps_own_allocations(family, size):
    """The fake-tensor trace of a step against the same counter over the same step on real CPU
    tensors: the same peaks, the same bytes alive when the backward starts and ends, the gradients
    formed and the parameters used in the same order; for the GPT block and for the Llama family's
    (rotary, RMS norm, grouped-query heads, SwiGLU) on packed documents; and for a rank of a
    sequence-parallel group of 2 (its T/2 positions, the exchange's local stand-in)."""
    cfg = compose(
        [*SMALL, *family, "deepspeed.activation_checkpointing=true", f"trainer.sequence_parallel={size}"]
    )
    fake = traced.trace_step(cfg, False, "fp32", 2)
    model = Transformer(cfg.model)
    traced.apply_activation_checkpointing(model)
    compute = model.loss
    if size > 1:
        compute = shard_sequences(model, cfg.model, SequenceShard(0, size), unit=None)
    params = list(model.parameters())
    counter = traced._StepCounter(params, 1)
    for p in params:
        p.register_post_accumulate_grad_hook(counter.gradient_formed)
    shape = (2, SEQ + 1)
    with counter:
        tokens = torch.zeros(shape, dtype=torch.long)  # as the trace's
        documents = torch.zeros(shape, dtype=torch.long) if cfg.data.document_masking else None
        loss = compute(tokens, torch.ones(shape), documents)
        counter.mark()
        start = len(counter.points)
        loss.backward()
        counter.mark()
    real = _summary(*zip(*counter.points, strict=True), start)
    ours = _summary(fake.live, fake.formed, fake.fetched, fake.backward_start)
    assert ours[:5] == real[:5], real[:4]
    # the same parameters in the same order; fake tensors' device queries show some one op earlier
    assert set(real[5]) <= set(ours[5]) and real[5][-1] == ours[5][-1]
    assert fake.n_params == model.num_parameters() == fake.formed[-1] == fake.fetched[-1]


def test_zero_arithmetic_is_exact_counts_of_the_model():
    """The model states per stage from the traced parameter count: fp32 on CPU at ZeRO-0 (the
    weights are Adam's master), 12 bytes of the partition from ZeRO-1, ZeRO-3's partition on 2
    ranks, bf16 on a GPU (DeepSpeed's fp32 gradients at ZeRO-0)."""
    cfg = compose([*SMALL, "deepspeed=zero0"])
    n = Transformer(cfg.model).num_parameters()
    trace = traced.trace_step(cfg, False, "fp32", 4)
    z0 = step_memory(trace, cfg, 1, False, 4, 2)
    assert (z0.components["parameters"], z0.components["optimizer_states"]) == (
        4 * n + trace.buffer_bytes,
        8 * n,
    )
    half = -(-n // 2)
    z3_cfg = compose([*SMALL, "deepspeed=zero3", "deepspeed.param_persistence_threshold=0"])
    z3 = step_memory(traced.trace_step(z3_cfg, False, "fp32", 4), z3_cfg, 2, False, 4, 2)
    assert (z3.components["parameters"], z3.components["optimizer_states"]) == (4 * half, 12 * half)
    gpu = _plan(["deepspeed=zero0", "trainer.micro_batch_size=8"], device="h100")
    assert gpu.precision == "bf16" and gpu.components["optimizer_states"] == 12 * n
    # the peak is the largest moment: its components add up to it, the margin on top
    assert gpu.peak_bytes == sum(gpu.components.values()) > gpu.tensor_bytes


def _activations_at_forward_end(overrides: list[str]) -> tuple[int, int]:
    """(the plan's live bytes when the backward starts, the bytes autograd saves in a real forward)."""
    cfg = compose([*SMALL, *overrides])
    trace = traced.trace_step(cfg, False, "fp32", 4)
    model = Transformer(cfg.model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.hidden_states(torch.zeros((4, SEQ), dtype=torch.long))
    return trace.live[trace.backward_start - 1], sum(saved.values())


@pytest.mark.parametrize(
    "change",
    [
        ["model.ffn.d_ff=256"],
        ["model.ffn.activation=relu"],
        ["model.ffn.gated=true", "model.ffn.activation=silu"],
        ["model.norm.formula=rms"],
    ],
)
def test_a_model_option_the_planner_never_saw_changes_the_plan_by_what_autograd_saves(change):
    """A wider FFN, another activation, a gated FFN, another norm, through overrides: the plan's activations
    move by exactly what a real forward of the changed model saves more or less; no planner code
    names any of them."""
    plan_before, saved_before = _activations_at_forward_end([])
    plan_after, saved_after = _activations_at_forward_end(change)
    assert saved_after != saved_before
    assert plan_after - plan_before == saved_after - saved_before


def test_offload_on_a_gpu_is_host_memory_planned_against_the_nodes_ram():
    """ZeRO-Offload: the fp32 master, the moments and the fp32 gradient partition are host memory
    (with the half-precision copy sent back), the node's RAM shared by its GPUs; the GPU keeps the
    half-precision parameters, the buckets and the activations."""
    n = Transformer(compose(SMALL).model).num_parameters()
    plain = _plan(["deepspeed=zero2", "trainer.micro_batch_size=2"], world=2, device="a100-80gb")
    off = _plan(
        ["deepspeed=zero2", "deepspeed.offload_optimizer=true", "trainer.micro_batch_size=2"], 2, "a100-80gb"
    )
    half = -(-n // 2)
    assert off.components["optimizer_states"] == 0 and plain.components["optimizer_states"] == 12 * half
    assert off.host == {"optimizer_states": 12 * half, "gradients": 4 * half, "parameters": 2 * half}
    assert (
        off.peak_bytes < plain.peak_bytes
        and off.host_capacity_bytes == GPUS["a100-80gb"].host_memory_bytes // 2
    )
    node_ram = replace(device_spec("a100-80gb"), host_memory_bytes=2 * sum(off.host.values()) - 2)
    tight = plan_launch(compose([*SMALL, "deepspeed=zero2", "deepspeed.offload_optimizer=true",
                                 "trainer.micro_batch_size=2"]), 2, node_ram)  # fmt: skip
    assert not tight.host_fits and not tight.fits


def test_suggestions_lower_the_peak_and_come_lowest_first():
    roomy = _plan(["trainer.micro_batch_size=8", "model.loss_impl=full"], device="h100")
    assert roomy.fits and not roomy.suggestions
    tight = _plan(
        ["trainer.micro_batch_size=8", "model.loss_impl=full"], device="h100", memory=roomy.peak_bytes - 1
    )
    assert not tight.fits and tight.suggestions
    peaks = [s.peak_bytes for s in tight.suggestions]
    assert peaks == sorted(peaks) and max(peaks) < tight.peak_bytes
    changes = [s.change for s in tight.suggestions]
    assert "trainer.micro_batch_size=4 (accumulation 2)" in changes and "model.loss_impl=chunked" in changes


@pytest.mark.parametrize("preset, n_params", [("llama3_2_1b", 1_235_814_400), ("qwen3_0_6b", 596_049_920)])
def test_the_llama_family_is_planned_at_its_published_size(preset, n_params):
    """A Llama-family preset at full size, traced on fake tensors for 8 H100s: the parameters of the
    released checkpoint (its preset's header), and grouped-query heads planned as such: the same
    model with as many key/value heads as query heads has more parameters and a higher peak."""
    overrides = [f"model={preset}", "trainer=gpt2", "data.seq_len=2048", "trainer.micro_batch_size=4"]
    device = device_spec("h100")
    plan = plan_launch(compose(overrides), 8, device, suggest=False)
    assert plan.n_params == n_params and plan.fits and plan.step_time_s > 0
    mha = [*overrides, f"model.attention.n_kv_heads={compose(overrides).model.n_heads}"]
    full = plan_launch(compose(mha), 8, device, suggest=False)
    assert full.n_params > n_params and full.peak_bytes > plan.peak_bytes


def test_the_cpu_plan_gives_no_time_and_a_gpu_plan_counts_evaluations():
    cpu = _plan(["trainer.eval_batches=2"])
    assert cpu.step_time_s is None and cpu.run_time_s is None and "no time on a CPU" in cpu.time_source
    gpu = _plan(["trainer.eval_batches=2", "trainer.max_steps=10", "trainer.eval_interval=4"], device="h100")
    assert gpu.evaluations == 3 and gpu.evaluation_forwards == 2 and gpu.evaluation_s > 0
    assert gpu.run_time_s == pytest.approx(10 * gpu.step_time_s + 3 * gpu.evaluation_s)


def test_the_plans_evaluation_time_is_the_etas_until_the_first_is_timed():
    """A GPU launch's PeakMemory hands the plan's time for one evaluation to the console, whose ETA
    counts it for the evaluations to come (tests/unit/core/test_eta.py)."""
    cfg = compose([*SMALL, "trainer.eval_batches=2", "trainer.max_steps=10", "trainer.eval_interval=4"])
    plan = plan_launch(cfg, 1, device_spec("h100"))
    console = Console("lmsys-train", progress=False, interval=1, terminal=False)
    setup = Setup(torch.device("cpu"), "bf16", 0, 1, plan.batch)
    PeakMemory(cfg.trainer, setup, plan, Reporter(console, 1, plot=False)).begin(None)
    assert console.evaluation_estimate_s == plan.evaluation_s > 0


def test_evaluations_that_would_outweigh_the_training_are_warned_about():
    """trainer.eval_batches large against the run's steps: the startup line's warning names the
    share of the compute and the setting that caps it; a modest evaluation says nothing."""
    heavy = _plan(["trainer.eval_batches=500", "trainer.max_steps=10", "trainer.eval_interval=5"])
    warning = evaluation_warning(heavy)
    assert warning is not None and "trainer.eval_batches=N" in warning and "of the run's compute" in warning
    assert evaluation_warning(_plan(["trainer.eval_batches=2"])) is None
    assert "evaluation: 500 forward(s)" in startup_line(heavy)


def test_a_flag_is_named_as_the_override_it_means(capsys):
    """`--world 8` (an argparse habit) is one line naming world=8, exit 2; in-process."""
    from lmsys.plan import main

    for argv, meant in (
        (["--world", "8"], "world=8"),
        (["--micro_batch_size=4"], "trainer.micro_batch_size=4"),
    ):
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lmsys-plan: error: unknown option --"), lines
        assert f"did you mean {meant}?" in lines[0]


def test_bad_option_values_are_one_line_each(capsys):
    """lmsys-plan's own options, checked before anything is planned: exit 2, one line naming the
    value; --help prints every option."""
    from lmsys.plan import main

    for argv, named in (
        (["world=0"], "world=0 must be >= 1"),
        (["device_memory=-5"], "device_memory=-5 must be >= 1"),
        (["world=two"], "world='two' is not valid"),
        (["json=maybe"], "json='maybe' is not valid"),
        (["device=h300"], "device='h300' is not valid; choose one of: cpu, v100-16gb"),
    ):
        assert main(argv) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [lines[0]] and lines[0].startswith("lmsys-plan: error: ") and named in lines[0], lines
    assert main(["--help"]) == 0
    shown = capsys.readouterr().out
    assert all(f"  {key} " in shown for key in ("world", "device", "device_memory", "json", "check")), shown


def test_the_cuda_line_is_the_planners_error_and_the_diagnosis_is_named():
    mib = 2**20
    assert memory_line(100 * mib, 105 * mib, Measured(105 * mib, "cuda_max_allocated")).endswith(
        "measured 105.0 MiB (max_memory_allocated, +5%)"
    )
    before = diagnoses_run()
    with diagnosis(torch.device("cpu")):
        pass
    rss = measured_peak_bytes(torch.device("cpu"), 0)
    assert diagnoses_run() == before + 1 and rss.by == "rss" and rss.includes_diagnosis
    assert memory_line(100 * mib, rss.bytes, rss).endswith(
        "it includes a bad step's replay on a copy of the model"
    )


def test_the_tensor_trace_counts_what_is_alive_from_its_start():
    """The bench's TensorPeak on a known pattern: 8 MiB held from before the trace and freed in it
    (no negative count), 16 then 8 MiB allocated, the 16 freed, 4 allocated: the peak is 24 MiB;
    inside a diagnosis span no peak is taken."""
    mib = 2**20
    before = torch.empty(2 * mib)  # 8 MiB
    trace = TensorPeak()
    del before
    first = torch.empty(4 * mib)
    second = torch.ones(2 * mib)
    del first
    with diagnosis(torch.device("cpu")):
        replica = torch.empty(8 * mib)  # 32 MiB in the span: no peak there
        del replica
    third = torch.zeros(mib)
    peak, unseen = trace.stop()
    assert abs(peak - 24 * mib) < mib // 4 and unseen == 0, (peak / mib, unseen)
    del second, third
