"""The plan of a launch before it starts: memory and time per rank for any Config, world size
and device (lmsys-plan, the trainer's startup line, preflight's refusal).

Memory is counted as lmsys and DeepSpeed really allocate it, per rank (every rank holds the same
here; with ZeRO the largest partition is counted), in bytes, at the moment of the step where the
most is alive (lmsys.engine.memory: the loss, the checkpointed backward, the gradient reduction or
the optimizer step; which tensors each holds). The components are those alive at that moment:

- parameters, optimizer_states (Adam's moments and its fp32 master; offload_optimizer moves them
  to host memory, `host` in the plan, which on a CPU device is the same memory), gradients,
  activations (what autograd saves per block, `block_saved_elements`), loss_head (model.loss_impl's
  buffers), zero_buffers (ZeRO-3's gathered parameters, the reductions' gradient copies),
  workspace (the optimizer's temporaries and the input batch);
- runtime: memory the process takes on top that is not a tensor of the model (DeepSpeed's
  ZeRO bookkeeping, gloo's buffers, the loader): in the peak RSS on CPU, fitted by
  `python -m lmsys.bench plan`; on CUDA 0 (the CUDA context lives outside the allocator);
- allocator_margin: CUDA: the caching allocator's fragmentation and the CUDA context (10% + 1
  GiB); CPU: 5% (glibc's arenas).

Time: FLOPs per step and rank (6N + 6 L H (d_qk + d_vo) T per token, PaLM appendix B, plus the
recomputed forward with activation checkpointing) over the device's peak times an MFU assumption
(MFU_ASSUMED, stated in every report); ZeRO's communication is assumed overlapped and only counts
when it takes longer than the compute; offload's host Adam and PCIe copies are added in series
(offload_time_s). On CPU: over a measured matmul rate times CPU_EFFICIENCY,
plus what a CPU step spends beside its FLOPs (cpu_overhead_s: the step's bookkeeping, the
optimizer, ZeRO-3's hooks and gathers, the gradient reductions over gloo, which a CPU does not
overlap), with constants fitted by the bench.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lmsys.core.config import Config
from lmsys.core.errors import ConfigError
from lmsys.core.runtime import BatchSplit, sequence_parallel_sizes, split_batch
from lmsys.engine.memory import StepMemory, step_memory
from lmsys.engine.sequence_parallel import exchanged_elements
from lmsys.model.shapes import model_shapes
from lmsys.training.devices import GIB, GPUS, Device, cpu_device, cpu_flops, device_peak_flops

MIB = 1 << 20
# The MFU a GPU run of a GPT-2-sized dense model reaches with flash attention and fused kernels:
# an assumption, not a measurement (no GPU here). llm.c's GPT-2 1558M on 8 H100s (about 32B tokens
# in about 24 h, its discussion #677) is about 43% of the H100's dense bf16 peak by the same
# formula; 40% leaves room for lmsys's Python loop and DeepSpeed.
MFU_ASSUMED = 0.40
# Training's FLOPs on CPU run at this fraction of the matmul rate `cpu_flops` measures (the
# elementwise ops between the matmuls): fitted with the terms below (71 GFLOP/s against a matmul
# rate of 93 on 2026-11-27); `python -m lmsys.bench plan` calibrates it on its rows.
CPU_EFFICIENCY = 0.76
# What a CPU step spends beside its FLOPs (cpu_overhead_s), least-squares fitted on 2026-11-27 to
# the 25 rows of `python -m lmsys.bench plan` (1 and 2 ranks, this 2-core machine, one thread per
# rank; docs/planning.md): seconds per unit of each.
CPU_STEP_S = 0.078  # per optimizer step: DeepSpeed's bookkeeping, the loader, the logger
CPU_OPTIMIZER_S_PER_PARAM = 6.2e-9  # AdamW over the rank's optimizer partition
CPU_Z3_HOOK_S = 0.155e-3  # ZeRO-3's fetch/release hooks, per parameter per pass per micro-batch
CPU_Z3_GATHER_S = 4.6e-3  # ZeRO-3, 2+ ranks: one gloo all-gather per partitioned parameter and pass
CPU_Z3_GATHER_S_PER_BYTE = 0.73e-9  # ZeRO-3: the partitioned parameters' bytes, gathered or copied
CPU_REDUCE_S_PER_BYTE = 2.9e-9  # 2+ ranks: a gradient reduction over gloo, per byte of ring traffic
# Offload on a GPU (offload_time_s): DeepSpeed's CPU Adam is bound by host memory. Per parameter it
# reads the fp32 weight, gradient and both moments (16 bytes) and writes the weight, the moments and
# the half-precision copy sent back to the GPU (14 bytes), at HOST_EFFICIENCY of the DRAM's peak
# (about what a streaming kernel reaches): both assumptions, from the update's arithmetic, not
# measured on a GPU node.
HOST_ADAM_BYTES_PER_PARAM = 30
HOST_EFFICIENCY = 0.7
# Per GPU between nodes (a 400 Gb/s NIC per GPU, as in DGX H100 / A100 nodes): an assumption.
INTER_NODE_BYTES_PER_S = 50e9
GPUS_PER_NODE = 8
# Process memory beyond the model's tensors on CPU, by ZeRO stage (bytes), fitted by the bench:
# DeepSpeed's ZeRO optimizer bookkeeping, gloo's buffers, the data loader. Refitted on
# 2026-11-27 to 1-rank runs of tiny and seed_trax once DeepSpeed's Muon module stopped importing
# inductor at initialize (lmsys.engine.muon.import_muon_lazily): the 47 MiB that ZeRO 1-3 seemed
# to add over ZeRO-0 were that import's, not the optimizer's.
CPU_RUNTIME_BYTES = {0: 2 * MIB, 1: 16 * MIB, 2: 16 * MIB, 3: 15 * MIB}
COMPONENTS = (
    "parameters",
    "gradients",
    "optimizer_states",
    "activations",
    "loss_head",
    "zero_buffers",
    "workspace",
    "runtime",
    "allocator_margin",
)


def loss_impl_of(cfg: Config, device: Device) -> str:
    """model.loss_impl as it runs on `device` (lmsys.model.ops.loss_implementation's rule)."""
    impl = cfg.model.loss_impl
    if impl != "auto":
        return impl
    uses_triton = cfg.model.kernels == "triton" or (cfg.model.kernels == "auto" and device.kind == "cuda")
    return "fused" if uses_triton else "chunked"


# ----------------------------------------------------------------------------- the plan


@dataclass
class Suggestion:
    change: str  # the overrides that make it fit
    peak_bytes: int
    fits: bool


@dataclass
class Plan:
    device: Device
    world_size: int
    batch: BatchSplit
    precision: str
    loss_impl: str
    n_params: int
    components: dict[str, int]
    host: dict[str, int]
    peak_phase: str  # the moment of the step the peak is at (lmsys.engine.memory.PHASES)
    peak_bytes: int
    device_bytes: int  # available to this rank (cpu: the machine's memory / ranks)
    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    mfu_source: str
    flops_per_step: float  # per rank
    max_steps: int
    suggestions: list[Suggestion] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.device_bytes

    @property
    def allocated_bytes(self) -> int:
        """The peak without the allocator margin: what max_memory_allocated (or RSS) measures."""
        return self.peak_bytes - self.components["allocator_margin"]

    @property
    def tensor_bytes(self) -> int:
        """The tensors alone (no runtime): what max_memory_allocated or a CPU trace measures."""
        return self.allocated_bytes - self.components["runtime"]

    def startup_line(self) -> str:
        """lmsys-train's startup line: the prediction it checks against the measured peak."""
        verdict = "fits" if self.fits else "does NOT fit"
        runtime = self.components["runtime"]
        beside = f" + {mib(runtime)} of the process's own" if runtime else ""
        return (
            f"memory: predicted {mib(self.tensor_bytes)} of tensors per rank{beside} ({mib(self.peak_bytes)} "
            f"with the allocator margin; {verdict} {mib(self.device_bytes)}), about {self.step_time_s:.3g} s "
            f"per step (lmsys-plan lists the components)"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "components": dict(self.components),
            "device_bytes": self.device_bytes,
            "fits": self.fits,
            "headroom_bytes": self.device_bytes - self.peak_bytes,
            "host_bytes": dict(self.host),
            "peak_phase": self.peak_phase,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "mfu_source": self.mfu_source,
            "time_for_max_steps_s": self.step_time_s * self.max_steps,
            "device": self.device.name,
            "world_size": self.world_size,
            "precision": self.precision,
            "loss_impl": self.loss_impl,
            "n_params": self.n_params,
            "micro_batch_size": self.batch.micro_batch_size,
            "grad_accum": self.batch.grad_accum,
            "suggestions": [
                {"change": s.change, "peak_bytes": s.peak_bytes, "fits": s.fits} for s in self.suggestions
            ],
        }


def precision_of(cfg: Config, device: Device) -> str:
    choice = cfg.deepspeed.precision
    if choice == "auto":
        return "bf16" if device.kind == "cuda" else "fp32"
    return choice


def memory_components(
    cfg: Config, world: int, device: Device, batch: BatchSplit
) -> tuple[StepMemory, dict[str, int]]:
    """(the step's tensors at their peak moment, the components with the runtime and the allocator
    margin), bytes per rank."""
    p = 4 if precision_of(cfg, device) == "fp32" else 2
    step = step_memory(
        cfg,
        model_shapes(cfg),
        world,
        cuda=device.kind == "cuda",
        p=p,
        tokens=batch.rank_tokens,  # T/P positions per sequence under sequence parallelism
        loss_impl=loss_impl_of(cfg, device),
        grad_accum=batch.grad_accum,
        batch_bytes=2 * 8 * batch.micro_batch_size * batch.tokens_per_sample,  # inputs, targets
    )
    components = {name: step.components.get(name, 0) for name in COMPONENTS[:-2]}
    components["runtime"] = CPU_RUNTIME_BYTES[cfg.deepspeed.stage] if device.kind == "cpu" else 0
    allocated = sum(components.values())
    margin = int(0.10 * allocated) + GIB if device.kind == "cuda" else int(0.05 * allocated)
    components["allocator_margin"] = margin
    return step, components


def cpu_overhead_s(cfg: Config, world: int, device: Device, batch: BatchSplit) -> float:
    """Seconds a CPU optimizer step spends beside its FLOPs, per rank: a CPU runs the collectives
    and DeepSpeed's Python between its matmuls, not beside them. The constants (CPU_*_S) are
    per unit of the work each counts."""
    shapes = model_shapes(cfg)
    ds, p = cfg.deepspeed, 4 if precision_of(cfg, device) == "fp32" else 2
    seconds = CPU_STEP_S + CPU_OPTIMIZER_S_PER_PARAM * math.ceil(shapes.n_params / (world if ds.stage else 1))
    if ds.stage == 3:  # each pass (forward, backward, the recomputed forward) fetches every parameter
        passes = batch.grad_accum * (3 if ds.activation_checkpointing else 2)
        partitioned = [k for k in shapes.param_numels if k >= ds.param_persistence_threshold]
        per_pass = CPU_Z3_HOOK_S * len(shapes.param_numels) + CPU_Z3_GATHER_S_PER_BYTE * sum(partitioned) * p
        if world > 1:
            per_pass += CPU_Z3_GATHER_S * len(partitioned)
        seconds += passes * per_pass
    if world > 1:  # ZeRO-0/1 reduce once a step, ZeRO-2/3 after every micro-batch
        reductions = batch.grad_accum if ds.stage >= 2 else 1
        seconds += reductions * CPU_REDUCE_S_PER_BYTE * 2 * (world - 1) / world * shapes.n_params * p
    return seconds


def step_time(
    cfg: Config, world: int, device: Device, batch: BatchSplit, cpu_rate: float | None
) -> tuple[float, float, float | None, str]:
    """(seconds per optimizer step, FLOPs per step per rank, MFU, where the rate comes from)."""
    shapes = model_shapes(cfg)
    tokens = batch.rank_tokens * batch.grad_accum  # per rank per step
    per_token = shapes.flops_per_token
    if cfg.deepspeed.activation_checkpointing:
        per_token += shapes.recompute_flops_per_token
    flops = float(per_token * tokens)
    if device.kind == "cpu":
        rate = (cpu_rate or cpu_flops()) * CPU_EFFICIENCY
        source = (
            f"CPU: measured matmul rate x {CPU_EFFICIENCY}, plus the step's non-FLOP time "
            "(both calibrated by python -m lmsys.bench plan)"
        )
        return flops / rate + cpu_overhead_s(cfg, world, device, batch), flops, None, source
    peak = device.peak_bf16_flops if precision_of(cfg, device) != "fp32" else device.peak_fp32_flops
    assert peak is not None
    compute = flops / (peak * MFU_ASSUMED)
    p = 4 if precision_of(cfg, device) == "fp32" else 2
    comm_bytes = 0.0
    if world > 1:  # ring reduce(-scatter) of the gradients; ZeRO-3 all-gathers parameters twice
        comm_bytes = 2 * (world - 1) / world * shapes.n_params * p
        if cfg.deepspeed.stage == 3:
            comm_bytes += 2 * (world - 1) / world * shapes.n_params * p
    link = device.interconnect_bytes_per_s or INTER_NODE_BYTES_PER_S
    if world > GPUS_PER_NODE:
        link = INTER_NODE_BYTES_PER_S
    offload = offload_time_s(cfg, world, device, batch)
    exchange = exchange_time_s(cfg, device, batch)
    seconds = max(compute, comm_bytes / link) + offload + exchange
    mfu = flops / seconds / peak
    source = (
        f"MFU assumed {MFU_ASSUMED:.0%} of {device.label}'s dense peak "
        "(lmsys.training.planning.MFU_ASSUMED), communication overlapped"
    )
    if exchange:
        source += f"; sequence parallelism's all-to-alls add {exchange:.3g} s a step, not overlapped"
    if offload:
        source += (
            f"; offload adds {offload:.3g} s a step, not overlapped: the host's Adam at "
            f"{HOST_EFFICIENCY:.0%} of {host_share(device, world) / 1e9:.1f} GB/s of host memory per GPU "
            f"and the copies over PCIe at {device.pcie_bytes_per_s / 1e9:.0f} GB/s each way "
            "(lmsys.training.devices)"
        )
    return seconds, flops, mfu, source


def exchange_time_s(cfg: Config, device: Device, batch: BatchSplit) -> float:
    """Seconds a step spends in sequence parallelism's all-to-alls on a GPU, per rank: every
    layer's forward and backward (and recomputed forward) exchange, in series with the compute,
    over the node's links (a group stays within a node). 0 without it and on a CPU."""
    if device.kind != "cuda" or batch.sequence_parallel == 1:
        return 0.0
    passes = batch.grad_accum * (3 if cfg.deepspeed.activation_checkpointing else 2)
    elements = exchanged_elements(cfg.model, batch.rank_tokens, batch.sequence_parallel)
    p = 4 if precision_of(cfg, device) == "fp32" else 2
    link = device.interconnect_bytes_per_s or INTER_NODE_BYTES_PER_S
    return passes * cfg.model.n_layers * elements * p / link


def host_share(device: Device, world: int) -> float:
    """Host memory bandwidth per GPU: the node's, shared by the ranks on it (up to GPUS_PER_NODE)."""
    assert device.host_bytes_per_s, device.name
    return device.host_bytes_per_s / min(world, GPUS_PER_NODE)


def offload_time_s(cfg: Config, world: int, device: Device, batch: BatchSplit) -> float:
    """Seconds a step spends on offload (ZeRO-Offload) on a GPU, per rank, counted in series with
    the compute (DeepSpeed overlaps the gradients' copies with the backward in part, so this is
    high by up to that part): the host's Adam over the rank's partition (offload_optimizer), the
    partition's gradients copied to the host (after each micro-batch's reduction at ZeRO-2/3, once
    a step at ZeRO-1) and its updated weights copied back; with offload_param its weights fetched
    from the host for every pass (forward, backward, the recomputed forward), and written back
    after the step unless the host's Adam updated them there. 0 on a CPU, where host and device
    memory are one."""
    ds = cfg.deepspeed
    if device.kind != "cuda" or not (ds.offload_optimizer or ds.offload_param):
        return 0.0
    assert device.pcie_bytes_per_s, device.name
    p = 4 if precision_of(cfg, device) == "fp32" else 2
    partition = math.ceil(model_shapes(cfg).n_params / world)
    host_s, copied_bytes = 0.0, 0
    if ds.offload_optimizer:
        host_s = partition * HOST_ADAM_BYTES_PER_PARAM / (host_share(device, world) * HOST_EFFICIENCY)
        copied_bytes += (batch.grad_accum if ds.stage >= 2 else 1) * partition * p
    if ds.offload_param:  # the weights live on the host: fetched for every pass
        copied_bytes += batch.grad_accum * (3 if ds.activation_checkpointing else 2) * partition * p
    if not (ds.offload_param and ds.offload_optimizer):  # updated on one side, kept on the other
        copied_bytes += partition * p
    return host_s + copied_bytes / device.pcie_bytes_per_s


def plan_launch(
    cfg: Config, world: int, device: Device, cpu_rate: float | None = None, suggest: bool = True
) -> Plan:
    """The plan of `cfg` on `world` ranks of `device` (ConfigError when the batch does not split)."""
    if world < 1:
        raise ConfigError(f"world={world} must be >= 1")
    batch = split_batch(cfg, world)
    step, components = memory_components(cfg, world, device, batch)
    seconds, flops, mfu, source = step_time(cfg, world, device, batch, cpu_rate)
    shared = device.kind == "cpu" and not device.per_rank  # the machine's memory, shared by its ranks
    available = device.memory_bytes // world if shared else device.memory_bytes
    plan = Plan(
        device=device,
        world_size=world,
        batch=batch,
        precision=precision_of(cfg, device),
        loss_impl=loss_impl_of(cfg, device),
        n_params=model_shapes(cfg).n_params,
        components=components,
        host=step.host,
        peak_phase=step.phase,
        peak_bytes=sum(components.values()),
        device_bytes=available,
        step_time_s=seconds,
        tokens_per_s=batch.tokens_per_step / seconds,
        mfu=mfu,
        mfu_source=source,
        flops_per_step=flops,
        max_steps=cfg.trainer.max_steps,
    )
    if suggest and not plan.fits:
        plan.suggestions = suggestions(cfg, world, device, cpu_rate)
    return plan


# ----------------------------------------------------------------------------- what would fit


def _with(cfg: Config, **groups: dict[str, Any]) -> Config:
    return replace(cfg, **{name: replace(getattr(cfg, name), **values) for name, values in groups.items()})


def _candidates(cfg: Config, world: int) -> list[tuple[str, Config]]:
    """Changes that lower the peak, each alone, then combined (the order the report lists them)."""
    t, ds, m = cfg.trainer, cfg.deepspeed, cfg.model
    found: list[tuple[str, Config]] = []
    sequences = t.global_batch_tokens // cfg.data.seq_len
    micro, groups = t.micro_batch_size, world // t.sequence_parallel
    while micro > 1:
        micro //= 2
        if sequences % (micro * groups) == 0:
            accum = sequences // (micro * groups)
            found.append(
                (
                    f"trainer.micro_batch_size={micro} (accumulation {accum})",
                    _with(cfg, trainer={"micro_batch_size": micro}),
                )
            )
    if not ds.activation_checkpointing:
        found.append(
            (
                "deepspeed.activation_checkpointing=true",
                _with(cfg, deepspeed={"activation_checkpointing": True}),
            )
        )
    for size in sequence_parallel_sizes(cfg, world):  # each rank holds T/P of every sequence
        if size > t.sequence_parallel:
            sharded = _with(cfg, trainer={"sequence_parallel": size})
            found.append((f"trainer.sequence_parallel={size}", sharded))
    if m.loss_impl == "full":
        found.append(("model.loss_impl=chunked", _with(cfg, model={"loss_impl": "chunked"})))
    for stage in range(ds.stage + 1, 4):
        found.append((f"deepspeed.stage={stage}", _with(cfg, deepspeed={"stage": stage})))
    if not ds.offload_optimizer:
        stage = max(ds.stage, 1)
        found.append(
            (
                f"deepspeed.stage={stage} deepspeed.offload_optimizer=true",
                _with(cfg, deepspeed={"stage": stage, "offload_optimizer": True}),
            )
        )
    if not ds.offload_param:
        found.append(
            (
                "deepspeed=zero3_offload (optimizer and parameters in host memory)",
                _with(cfg, deepspeed={"stage": 3, "offload_optimizer": True, "offload_param": True}),
            )
        )
    return found


def suggestions(cfg: Config, world: int, device: Device, cpu_rate: float | None) -> list[Suggestion]:
    """Each change with its predicted peak, those that fit first; if none fits alone, the
    combination of all of them (smallest micro-batch, checkpointing, ZeRO-3 with offload)."""
    out = []
    candidates = _candidates(cfg, world)
    for change, changed in candidates:
        peak = plan_launch(changed, world, device, cpu_rate, suggest=False)
        out.append(Suggestion(change, peak.peak_bytes, peak.fits))
    if candidates and not any(s.fits for s in out):
        combined = _with(
            cfg,
            trainer={
                "micro_batch_size": 1
                if (cfg.trainer.global_batch_tokens // cfg.data.seq_len) % world == 0
                else cfg.trainer.micro_batch_size
            },
            deepspeed={
                "activation_checkpointing": True,
                "stage": 3,
                "offload_optimizer": True,
                "offload_param": True,
            },
            model={"loss_impl": "chunked" if cfg.model.loss_impl == "full" else cfg.model.loss_impl},
        )
        peak = plan_launch(combined, world, device, cpu_rate, suggest=False)
        out.append(Suggestion("all of the above together", peak.peak_bytes, peak.fits))
    return sorted(out, key=lambda s: (not s.fits, s.peak_bytes))


# ----------------------------------------------------------------------------- words


def mib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB" if abs(n) < 10 * GIB else f"{n / GIB:,.2f} GiB"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def report_lines(plan: Plan) -> list[str]:
    """The plan in words: components, the verdict, time, suggestions."""
    b = plan.batch
    lines = [
        f"{plan.n_params:,} parameters, {plan.precision}, loss_impl {plan.loss_impl}, "
        f"world {plan.world_size} on {plan.device.label}; {b.arithmetic()}",
        "memory per rank:",
    ]
    width = max(len(k) for k in plan.components)
    for name, value in plan.components.items():
        lines.append(f"  {name:<{width}}  {mib(value):>12}")
    lines.append(f"  {'peak':<{width}}  {mib(plan.peak_bytes):>12}")
    for name, value in plan.host.items():
        lines.append(f"  host memory ({name}, offloaded): {mib(value)} per rank")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"{verdict}: {mib(plan.peak_bytes)} of {mib(plan.device_bytes)} per rank "
        f"(headroom {mib(plan.device_bytes - plan.peak_bytes)})"
    )
    mfu = f", MFU {plan.mfu:.0%}" if plan.mfu is not None else ""
    lines.append(
        f"time: {plan.step_time_s:.3g} s per step, {plan.tokens_per_s:,.0f} tokens/s{mfu}; "
        f"trainer.max_steps={plan.max_steps}: {duration(plan.step_time_s * plan.max_steps)} "
        f"({plan.mfu_source})"
    )
    if plan.suggestions:
        lines.append("what would fit (predicted peak per rank):")
        for s in plan.suggestions:
            lines.append(f"  {s.change}: {mib(s.peak_bytes)}{'' if s.fits else ' (still too large)'}")
    return lines


# ----------------------------------------------------------------------------- the check before a launch

PLAN_CHOICES = ("auto", "refuse", "warn", "off")


def run_device(cfg: Config) -> Device:
    """The Device a launch of `cfg` will train on, seen from this machine (trainer.device; a GPU
    by its name, else by the memory torch reports), with trainer.plan_memory_bytes applied."""
    choice = cfg.trainer.device
    on_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if not on_cuda:
        device = cpu_device()
    else:
        name = torch.cuda.get_device_name(0)
        total = torch.cuda.get_device_properties(0).total_memory
        key = "h200" if "H200" in name else "h100" if "H100" in name else None
        if "A100" in name:
            key = "a100-80gb" if total > 60 * GIB else "a100-40gb"
        device = GPUS[key] if key else Device(name, name, "cuda", total, None, None, None, None, "torch.cuda")
        if device.peak_bf16_flops is None:
            device = replace(device, peak_bf16_flops=device_peak_flops(torch.device("cuda", 0)) or 100e12)
    if cfg.trainer.plan_memory_bytes:
        device = replace(device, memory_bytes=cfg.trainer.plan_memory_bytes, per_rank=True)
    return device


def check_plan(cfg: Config, world: int, warn: Callable[[str], None]) -> Plan | None:
    """trainer.plan before the engine exists: the plan, or None (off); ConfigError, with what would
    fit, for a launch predicted not to fit under refuse (auto: on CUDA); a warning under warn."""
    mode = cfg.trainer.plan
    if mode == "off":
        return None
    device = run_device(cfg)
    plan = plan_launch(cfg, world, device, cpu_rate=cpu_flops(seconds=0.05))
    if plan.fits:
        return plan
    refuse = mode == "refuse" or (mode == "auto" and device.kind == "cuda")
    fixes = "; ".join(f"{s.change} ({mib(s.peak_bytes)})" for s in plan.suggestions if s.fits)
    message = (
        f"predicted peak memory {mib(plan.peak_bytes)} per rank does not fit {mib(plan.device_bytes)} "
        f"on {device.label} (lmsys-plan shows the components); "
        + (f"what would fit: {fixes}" if fixes else "nothing tried fits; use more ranks or a larger device")
        + f" (the plan as lmsys-plan prints it: {plan_command(cfg, world)})"
    )
    if refuse:
        raise ConfigError(message + "; trainer.plan=warn launches anyway")
    warn(message)
    return plan


def plan_command(cfg: Config, world: int) -> str:
    return (
        f"lmsys-plan model={cfg.model.name} deepspeed.stage={cfg.deepspeed.stage} "
        f"trainer.micro_batch_size={cfg.trainer.micro_batch_size} world={world} ..."
    )
