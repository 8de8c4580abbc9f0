"""The memory plan of a launch (lmsys/training/planning.py, lmsys/engine/memory.py), in this
process: the components against exact counts (the model's numel, what autograd really saves per
block), the largest moment of a step, a CPU step's time, offload's terms, suggestions that fit,
and the tensor trace. The command and real runs: tests/integration/training/test_plan.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmsys.core.config import compose
from lmsys.engine.memory import StepMemory, block_saved_elements, step_memory
from lmsys.model.shapes import model_shapes
from lmsys.model.transformer import Block, Transformer
from lmsys.training import planning
from lmsys.training.devices import device_spec
from lmsys.training.peak_memory import TensorPeak, diagnoses_run, diagnosis, measured_peak_bytes, memory_line
from lmsys.training.planning import plan_launch
from tests.integration.features import COMMON


def test_model_states_are_exact_counts_of_the_model():
    cfg = compose(SMALL)
    n = Transformer(cfg.model).num_parameters()
    z0 = _plan(["deepspeed=zero0"])
    assert z0.n_params == n
    # fp32 on CPU, ZeRO-0: weights, gradients, Adam's two moments (the weights are the master)
    assert (z0.components["parameters"], z0.components["gradients"]) == (4 * n, 4 * n)
    assert z0.components["optimizer_states"] == 8 * n
    # ZeRO-3 on 2 ranks, every parameter partitioned: 1/2 of the weights, fp32 master + moments
    half = -(-n // 2)
    z3 = _plan(["deepspeed=zero3", "deepspeed.param_persistence_threshold=0"], world=2)
    assert z3.components["parameters"] == 4 * half
    assert z3.components["optimizer_states"] == 12 * half
    # bf16 on a GPU at ZeRO-0: bf16 weights and gradients, DeepSpeed's fp32 gradients and master
    gpu = _plan(["deepspeed=zero0"], device="h100")
    assert gpu.precision == "bf16"
    assert (gpu.components["parameters"], gpu.components["gradients"]) == (2 * n, 6 * n)
    assert gpu.components["optimizer_states"] == 12 * n
    # offload moves the optimizer states of a GPU run to host memory, and says so
    off = _plan(["deepspeed=zero3_offload"], world=2, device="h100")
    assert off.components["optimizer_states"] == 0 and off.host["optimizer_states"] > 0


def test_the_peak_is_the_largest_moment_of_the_step_and_each_moment_holds_its_own_tensors():
    """The loss's buffers, the reduction's copies and the optimizer's temporaries never coexist:
    each moment counts the tensors alive then, and the plan's peak is the largest moment."""
    full, n, tokens = _moments(["deepspeed=zero0", "model.loss_impl=full"])
    vocab = compose(SMALL).model.vocab_size
    assert full.phase == max(full.totals, key=full.totals.get)
    assert sum(full.components.values()) == max(full.totals.values())
    loss, reduce, step = full.moments["loss"], full.moments["reduce"], full.moments["step"]
    # full loss: the log-softmax and two gradients of (tokens, V) in fp32, the saved h
    d = compose(SMALL).model.d_model
    assert loss["loss_head"] == 3 * tokens * vocab * 4 + tokens * d * 4
    assert loss["activations"] > 0 and reduce["activations"] == 0 and step["loss_head"] == 0
    # ZeRO-0 flattens a copy of every gradient to reduce it, once the activations are gone
    assert reduce["zero_buffers"] == 4 * n and reduce["gradients"] == 4 * n
    # ZeRO-3 on 2 ranks keeps every gathered parameter from the forward to its backward; 1 rank not
    two, n, _ = _moments(["deepspeed=zero3", "deepspeed.param_persistence_threshold=0"], world=2, micro=2)
    one, _, _ = _moments(["deepspeed=zero3", "deepspeed.param_persistence_threshold=0"], world=1, micro=4)
    assert two.moments["loss"]["zero_buffers"] == 4 * n and one.moments["loss"]["zero_buffers"] == 0
    # activation checkpointing keeps each block's input, then recomputes one block in the backward
    ckpt, _, _ = _moments(["deepspeed=zero2", "deepspeed.activation_checkpointing=true"])
    plain, _, _ = _moments(["deepspeed=zero2"])
    assert ckpt.moments["loss"]["activations"] < plain.moments["loss"]["activations"]
    assert ckpt.moments["backward"]["activations"] > ckpt.moments["loss"]["activations"]


def test_a_cpu_steps_time_beside_its_flops_counts_the_models_parameters_and_passes():
    """cpu_overhead_s from the model's own counts: the optimizer over the rank's partition; at
    ZeRO-3 a hook per parameter and pass (a third pass with activation checkpointing), a gloo
    all-gather per partitioned parameter on 2 ranks, the partitioned bytes; on 2 ranks a gradient
    reduction once a step (ZeRO-0/1) or once a micro-batch (ZeRO-2/3)."""
    cpu = device_spec("cpu")
    model = Transformer(compose(SMALL).model)
    n, numels = model.num_parameters(), [p.numel() for p in model.parameters()]

    def overhead(overrides: list[str], world: int) -> tuple[float, int]:
        overrides = [*overrides, "trainer.micro_batch_size=2"]  # accumulation 2 on 2 ranks, 4 on 1
        cfg = compose([*SMALL, *overrides])
        plan = _plan(overrides, world)
        return planning.cpu_overhead_s(cfg, world, cpu, plan.batch), plan.batch.grad_accum

    z0, _ = overhead(["deepspeed=zero0"], 1)
    assert z0 == pytest.approx(planning.CPU_STEP_S + planning.CPU_OPTIMIZER_S_PER_PARAM * n)
    z1_w2, _ = overhead(["deepspeed=zero1"], 2)  # half the optimizer, one reduction of n fp32
    reduce_once = planning.CPU_REDUCE_S_PER_BYTE * 4 * n
    assert z1_w2 == pytest.approx(
        planning.CPU_STEP_S + planning.CPU_OPTIMIZER_S_PER_PARAM * -(-n // 2) + reduce_once
    )
    z2_w2, accum = overhead(["deepspeed=zero2"], 2)
    assert accum == 2 and z2_w2 - z1_w2 == pytest.approx(reduce_once)  # one more: a micro-batch each
    threshold = 1000
    partitioned = [k for k in numels if k >= threshold]
    assert 0 < len(partitioned) < len(numels)  # both kinds in this model
    z3 = ["deepspeed=zero3", f"deepspeed.param_persistence_threshold={threshold}"]
    per_pass = planning.CPU_Z3_HOOK_S * len(numels) + planning.CPU_Z3_GATHER_S_PER_BYTE * 4 * sum(partitioned)
    z3_w1, accum_w1 = overhead(z3, 1)
    z1_w1, _ = overhead(["deepspeed=zero1"], 1)
    assert accum_w1 == 4 and z3_w1 - z1_w1 == pytest.approx(2 * 4 * per_pass)  # forward and backward
    z3_ckpt, _ = overhead([*z3, "deepspeed.activation_checkpointing=true"], 1)
    assert z3_ckpt - z1_w1 == pytest.approx(3 * 4 * per_pass)  # and the recomputed forward
    z3_w2, _ = overhead(z3, 2)
    gathers = 2 * 2 * planning.CPU_Z3_GATHER_S * len(partitioned)
    assert z3_w2 - z2_w2 == pytest.approx(2 * 2 * per_pass + gathers)
    # the step time on CPU is the FLOPs at the rate plus this (the rate of _plan: 1e9 FLOP/s)
    plan = _plan([*z3, "trainer.micro_batch_size=2"], 2)
    assert plan.step_time_s == pytest.approx(plan.flops_per_step / (1e9 * planning.CPU_EFFICIENCY) + z3_w2)


def test_offload_on_a_gpu_adds_the_host_adam_and_the_pcie_copies():
    """offload_time_s from the rank's partition: the host's Adam (30 bytes a parameter at 70% of
    the node's DRAM, shared by the ranks on the node, 8 at most), the gradients' copies (one a
    micro-batch at ZeRO-2/3) and the weights' copy back, or with offload_param the weights
    fetched for every pass; added in series to the step, and nothing on a CPU."""
    n = Transformer(compose(SMALL).model).num_parameters()
    a100 = device_spec("a100-80gb")
    pcie, node = a100.pcie_bytes_per_s, a100.host_bytes_per_s
    base = ["trainer.micro_batch_size=2"]  # 2 ranks: accumulation 2; bf16 on a GPU: 2 bytes

    def added(overrides: list[str], world: int = 2) -> float:
        with_offload = plan_launch(compose([*SMALL, *base, *overrides]), world, a100)
        without = [o for o in overrides if "offload" not in o]
        plain = plan_launch(compose([*SMALL, *base, *without]), world, a100)
        assert "offload adds" in with_offload.mfu_source and "offload" not in plain.mfu_source
        return with_offload.step_time_s - plain.step_time_s

    half = -(-n // 2)
    adam = half * planning.HOST_ADAM_BYTES_PER_PARAM / (node / 2 * planning.HOST_EFFICIENCY)
    zero2 = added(["deepspeed=zero2", "deepspeed.offload_optimizer=true"])
    assert zero2 == pytest.approx(adam + (2 * half * 2 + half * 2) / pcie)  # 2 reductions, 1 copy back
    zero1 = added(["deepspeed=zero1", "deepspeed.offload_optimizer=true"])
    assert zero1 == pytest.approx(adam + (half * 2 + half * 2) / pcie)  # one copy of the gradients
    both = added(["deepspeed=zero3_offload", "deepspeed.activation_checkpointing=true"])
    assert both == pytest.approx(adam + (2 * half * 2 + 2 * 3 * half * 2) / pcie)  # 3 passes x 2
    weights_only = added(["deepspeed=zero3", "deepspeed.offload_param=true"])  # Adam on the GPU
    assert weights_only == pytest.approx((2 * 2 * half * 2 + half * 2) / pcie)  # and written back
    # 16 ranks: 8 on a node share its host memory (not 16); on a CPU offload adds nothing
    wide = compose([*SMALL, "trainer.micro_batch_size=1", "trainer.global_batch_tokens=512",
                    "deepspeed=zero2", "deepspeed.offload_optimizer=true"])  # fmt: skip
    batch, sixteenth = plan_launch(wide, 16, a100).batch, -(-n // 16)
    host = sixteenth * planning.HOST_ADAM_BYTES_PER_PARAM / (node / 8 * planning.HOST_EFFICIENCY)
    assert planning.offload_time_s(wide, 16, a100, batch) == pytest.approx(host + 2 * sixteenth * 2 / pcie)
    assert planning.offload_time_s(wide, 16, device_spec("cpu"), batch) == 0.0


@pytest.mark.parametrize("preset", ["tiny", "seed_trax", "seed_compact", "seed_gpt"])
def test_block_activations_are_what_autograd_saves(preset):
    """Every tensor a block's forward saves for its backward (saved-tensor hooks, one count per
    storage, parameters excluded) against the plan's per-token count."""
    cfg = compose([f"model={preset}", "model.n_layers=1", "model.vocab_size=64", "data.seq_len=16"])
    block = Block(cfg.model)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(2, 16, cfg.model.d_model, requires_grad=True)  # (B, T, D)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    assert sum(storages.values()) == block_saved_elements(cfg) * 2 * 16 * 4


def test_suggestions_fit_and_lower_the_peak():
    cfg = compose([*SMALL, "trainer.micro_batch_size=8", "model.loss_impl=full"])
    roomy = plan_launch(cfg, 1, device_spec("h100"))
    assert roomy.fits and not roomy.suggestions
    tiny_gpu = replace(device_spec("h100"), memory_bytes=roomy.peak_bytes - 1)
    tight = plan_launch(cfg, 1, tiny_gpu)
    assert not tight.fits and tight.suggestions
    fitting = [s for s in tight.suggestions if s.fits]
    assert fitting and all(s.peak_bytes < tight.peak_bytes for s in fitting)
    assert any(s.change == "trainer.micro_batch_size=4 (accumulation 2)" for s in tight.suggestions)
    assert any(s.change == "model.loss_impl=chunked" for s in tight.suggestions)


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


def test_the_tensor_trace_counts_what_is_alive_from_its_start():
    """A known pattern: 8 MiB held from before the trace and freed in it (no negative count),
    16 MiB then 8 MiB allocated, the 16 freed, 4 allocated: the peak is 24 MiB, made by the op
    that allocated the 8, and held by the ops that allocated the 16 and the 8."""
    mib = 2**20
    before = torch.empty(2 * mib)  # 8 MiB
    trace = TensorPeak()
    del before
    first = torch.empty(4 * mib)
    second = torch.ones(2 * mib)
    del first
    third = torch.zeros(mib)
    traced = trace.stop()
    assert abs(traced.bytes - 24 * mib) < mib // 4 and traced.unconfirmed_bytes == 0, traced
    assert "aten::ones" in traced.during, traced.during
    # what held the peak, by the op that allocated it: the 16 (empty) and the 8 (ones)
    largest = [(name.split(" > ")[0], round(size / mib)) for name, size in traced.holders.items()][:2]
    assert largest == [("aten::empty", 16), ("aten::ones", 8)], traced.holders
    del second, third


def test_a_diagnosis_span_is_left_out_of_the_traced_peak():
    """lmsys's replay of a bad step (metrics.diagnosis) holds a replica the step does not: inside
    the span its blocks count but no peak is taken. 8 MiB kept; in the span 32 MiB made and
    freed, 4 MiB made and kept; then 4 MiB more: the peak is 8 + 4 + 4 = 16 MiB, not 40."""
    mib = 2**20
    trace, before = TensorPeak(), diagnoses_run()
    kept = torch.empty(2 * mib)  # 8 MiB
    with diagnosis(torch.device("cpu")):
        replica = torch.empty(8 * mib)  # 32 MiB
        survivor = torch.ones(mib)  # 4 MiB, still held after the span
        del replica
    later = torch.zeros(mib)  # 4 MiB
    traced = trace.stop()
    assert abs(traced.bytes - 16 * mib) < mib // 4, traced
    assert "aten::zeros" in traced.during, traced.during
    del kept, survivor, later
    # the peak RSS cannot leave it out: the measure and its line say so
    assert diagnoses_run() == before + 1
    rss = measured_peak_bytes(torch.device("cpu"), 0, None)
    assert rss.by == "rss" and rss.includes_diagnosis
    line = memory_line(100 * mib, rss.bytes, rss.by, 0, rss.includes_diagnosis)
    assert line.endswith(
        "it includes a bad step's replay on a copy of the model, which the peak RSS cannot leave out"
    )


SMALL = [o for o in COMMON if o.startswith("model.")] + [
    "trainer.global_batch_tokens=256",
    "trainer.micro_batch_size=4",
]


def _plan(overrides: list[str], world: int = 1, device: str = "cpu"):
    return plan_launch(compose([*SMALL, *overrides]), world, device_spec(device), cpu_rate=1e9)


def _moments(overrides: list[str], world: int = 1, micro: int = 4) -> tuple[StepMemory, int, int]:
    """The step's moments of SMALL (fp32, CPU), its parameter count and tokens per micro-batch."""
    cfg = compose([*SMALL, *overrides, f"trainer.micro_batch_size={micro}"])
    shapes = model_shapes(cfg)
    tokens = micro * cfg.data.seq_len
    accum = cfg.trainer.global_batch_tokens // (tokens * world)
    args = dict(cuda=False, p=4, tokens=tokens, grad_accum=accum, batch_bytes=0)
    return step_memory(cfg, shapes, world, loss_impl=cfg.model.loss_impl, **args), shapes.n_params, tokens
