"""The plan of a launch before it starts: memory and time per rank for any Config, world size and
device, and what would fit when it does not (lmsys-plan, the trainer's startup line, the check
before a launch).

Memory is the traced step (lmsys.planning.trace) with ZeRO's arithmetic (lmsys.planning.zero_memory) at
the step's largest moment, plus the allocator's margin: on CUDA the caching allocator reserves
more than it hands out (RESERVED_OVER_ALLOCATED) and the process holds memory of its own outside
it (NON_PYTORCH_BYTES); on a CPU, glibc's arenas (CPU_MARGIN, an assumption).

Time, on a GPU: the model's FLOPs (PaLM's count, plus the blocks' forward again under activation
checkpointing) over the device's dense peak at its family's MFU assumption (lmsys.core.devices),
ZeRO's communication assumed overlapped (it counts only when slower), offload's host Adam and
PCIe copies in series (offload_time_s), and under sequence parallelism the all-to-alls of every
layer in series (exchange_time_s). Evaluations take the forward's third of the FLOPs at the
same rate. On a CPU the plan gives no time: lmsys-train's progress measures it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lmsys.core.config import Config
from lmsys.core.console import evaluations_after
from lmsys.core.devices import GIB, Device
from lmsys.core.errors import ConfigError, LmsysError
from lmsys.core.runtime import BatchSplit, sequence_parallel_sizes, split_batch
from lmsys.data.shards import PreparedData
from lmsys.engine.sequence_parallel import exchanged_elements
from lmsys.planning.trace import StepTrace, trace_step
from lmsys.planning.zero_memory import StepMemory, step_memory

# PyTorch's reserved memory over its allocated memory in published out-of-memory reports of
# training runs (reserved / allocated at the failure, which is what fragmentation left unusable):
# 1.00 (lit-llama#137, LLaVA#812, chatglm3_finetuning#13, semivl#18), 1.01 (GPT2-Chinese#215,
# Shift-GCN#34, stanford_alpaca#76, DeepSpeedExamples#279), 1.04 (GPT-4-LLM#16), 1.05
# (SAM-Med3D#8), 1.10 (fine-tune-mistral#3), 1.25 (Vad-R1#11), 1.56 (MADDoG#11): 10 of 13 at or
# below 1.05, the median 1.01.
RESERVED_OVER_ALLOCATED = 1.05
# The process's memory outside PyTorch's allocator (the CUDA context, cuBLAS's and NCCL's buffers):
# "this process has X in use" less PyTorch's reserved, in the same kind of reports: 0.20-0.51 GiB
# on one GPU (VGGT-Long#6, evo2#190, loca#12, SoulX-FlashTalk#5, flux-webui#11, MTVCrafter#21,
# CoSeR#10, Qwen3-VL#2097; median 0.44), 1.43 GiB on a rank of a 4-GPU NCCL job (Vad-R1#11).
NON_PYTORCH_BYTES = {False: GIB // 2, True: 3 * GIB // 2}  # {world > 1: bytes}
CPU_MARGIN = 0.05  # glibc's arenas beside the tensors, on a CPU (an assumption)
# Offload on a GPU: DeepSpeed's CPU Adam reads the fp32 weight, gradient and both moments (16 bytes a
# parameter) and writes the weight, the moments and the half-precision copy sent back (14), at
# HOST_EFFICIENCY of the node's DRAM peak: both from the update's arithmetic, not measured on a GPU.
HOST_ADAM_BYTES_PER_PARAM = 30
HOST_EFFICIENCY = 0.7
INTER_NODE_BYTES_PER_S = 50e9  # per GPU between nodes: a 400 Gb/s NIC per GPU (an assumption)


def precision_of(cfg: Config, device: Device) -> str:
    choice = cfg.deepspeed.precision
    return ("bf16" if device.kind == "cuda" else "fp32") if choice == "auto" else choice


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
    n_params: int
    components: dict[str, int]
    host: dict[str, int]  # what offload keeps in host memory, per rank
    peak_phase: str  # forward, backward, reduce or step (lmsys.planning.zero_memory)
    device_bytes: int  # available to this rank (cpu: the machine's memory / ranks)
    host_capacity_bytes: int | None  # the node's RAM per rank (offload), None when unknown
    step_time_s: float | None  # None on a CPU
    mfu: float | None
    time_source: str
    flops_per_step: float  # per rank
    max_steps: int
    evaluation_s: float | None = None  # one evaluation, when its size is known
    evaluations: int = 0  # in trainer.max_steps
    evaluation_forwards: int | None = None  # per rank per evaluation
    suggestions: list[Suggestion] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return sum(self.components.values())

    @property
    def tensor_bytes(self) -> int:
        """The peak without the allocator margin: what max_memory_allocated measures."""
        return self.peak_bytes - self.components["allocator_margin"]

    @property
    def host_fits(self) -> bool:
        return self.host_capacity_bytes is None or sum(self.host.values()) <= self.host_capacity_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.device_bytes and self.host_fits

    @property
    def run_time_s(self) -> float | None:
        """trainer.max_steps' steps and their evaluations, when both are known."""
        if self.step_time_s is None:
            return None
        return self.step_time_s * self.max_steps + (self.evaluation_s or 0.0) * self.evaluations

    @property
    def tokens_per_s(self) -> float | None:
        return self.batch.tokens_per_step / self.step_time_s if self.step_time_s else None

    def as_json(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "components": dict(self.components),
            "device_bytes": self.device_bytes,
            "fits": self.fits,
            "headroom_bytes": self.device_bytes - self.peak_bytes,
            "host_bytes": dict(self.host),
            "host_capacity_bytes": self.host_capacity_bytes,
            "peak_phase": self.peak_phase,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "time_source": self.time_source,
            "evaluation_s": self.evaluation_s,
            "evaluations": self.evaluations,
            "run_time_s": self.run_time_s,
            "device": self.device.name,
            "device_memory_source": self.device.memory_source,
            "world_size": self.world_size,
            "precision": self.precision,
            "n_params": self.n_params,
            "micro_batch_size": self.batch.micro_batch_size,
            "grad_accum": self.batch.grad_accum,
            "suggestions": [
                {"change": s.change, "peak_bytes": s.peak_bytes, "fits": s.fits} for s in self.suggestions
            ],
        }


def memory(
    cfg: Config, world: int, device: Device, batch: BatchSplit
) -> tuple[StepTrace, StepMemory, dict[str, int]]:
    """(the trace, the step's largest moment, the components with the allocator margin), bytes per rank."""
    precision = precision_of(cfg, device)
    trace = trace_step(cfg, device.kind == "cuda", precision, batch.micro_batch_size)
    step = step_memory(
        trace, cfg, world, device.kind == "cuda", 4 if precision == "fp32" else 2, batch.grad_accum
    )
    components = dict(step.components)
    allocated = sum(components.values())
    if device.kind == "cuda":
        margin = int(allocated * (RESERVED_OVER_ALLOCATED - 1)) + NON_PYTORCH_BYTES[world > 1]
    else:
        margin = int(allocated * CPU_MARGIN)
    components["allocator_margin"] = margin
    return trace, step, components


def offload_time_s(cfg: Config, world: int, device: Device, batch: BatchSplit, n_params: int) -> float:
    """Seconds a step spends on offload on a GPU, in series with the compute (DeepSpeed overlaps the
    gradients' copies with the backward in part: this errs long): the host's Adam over the rank's
    partition, the partition's gradients copied to the host (after each micro-batch at ZeRO-2/3,
    once a step at ZeRO-1) and its weights back; with offload_param its weights fetched for every
    pass. 0 on a CPU, where host and device memory are one."""
    ds = cfg.deepspeed
    if device.kind != "cuda" or not (ds.offload_optimizer or ds.offload_param):
        return 0.0
    assert device.pcie_bytes_per_s and device.host_bytes_per_s, device.name
    p = 4 if precision_of(cfg, device) == "fp32" else 2
    partition = math.ceil(n_params / world)
    host_share = device.host_bytes_per_s / min(world, device.gpus_per_node)
    host_s, copied = 0.0, 0
    if ds.offload_optimizer:
        host_s = partition * HOST_ADAM_BYTES_PER_PARAM / (host_share * HOST_EFFICIENCY)
        copied += (batch.grad_accum if ds.stage >= 2 else 1) * partition * p
    if ds.offload_param:  # the weights live on the host: fetched for every pass
        copied += batch.grad_accum * (3 if ds.activation_checkpointing else 2) * partition * p
    if not (ds.offload_param and ds.offload_optimizer):  # updated on one side, kept on the other
        copied += partition * p
    return host_s + copied / device.pcie_bytes_per_s


def exchange_time_s(cfg: Config, device: Device, batch: BatchSplit) -> float:
    """Seconds a step spends in sequence parallelism's all-to-alls on a GPU, per rank: every
    layer's forward and backward (and recomputed forward) exchange, in series with the compute,
    over the node's links (a group stays within a node). 0 without it and on a CPU."""
    if device.kind != "cuda" or batch.sequence_parallel == 1:
        return 0.0
    passes = batch.grad_accum * (3 if cfg.deepspeed.activation_checkpointing else 2)
    elements = exchanged_elements(cfg.model, batch.rank_tokens, batch.sequence_parallel)
    p = 4 if precision_of(cfg, device) == "fp32" else 2
    return passes * cfg.model.n_layers * elements * p / (device.link_bytes_per_s or INTER_NODE_BYTES_PER_S)


def step_time(
    cfg: Config, world: int, device: Device, batch: BatchSplit, trace: StepTrace
) -> tuple[float | None, float, float | None, str]:
    """(seconds per optimizer step or None, FLOPs per step per rank, MFU, where the time comes from)."""
    tokens = batch.rank_tokens * batch.grad_accum  # per rank per step (T/P per sequence under P)
    flops = float((trace.flops_per_token + trace.recompute_flops_per_token) * tokens)
    if device.kind == "cpu" or device.peak_flops is None or device.mfu is None:
        why = "a CPU" if device.kind == "cpu" else f"{device.label}: no known peak FLOP/s"
        return None, flops, None, f"no time on {why} (lmsys-train's progress line measures it)"
    peak = (
        device.peak_flops
        if precision_of(cfg, device) != "fp32"
        else device.peak_fp32_flops or device.peak_flops
    )
    compute = flops / (peak * device.mfu.value)
    p = 4 if precision_of(cfg, device) == "fp32" else 2
    # ring traffic of the gradients' reduce(-scatter): once a step at ZeRO-0/1, after every
    # micro-batch from ZeRO-2; ZeRO-3 also all-gathers the parameters for each forward and backward
    stage, ring = cfg.deepspeed.stage, 2 * (world - 1) / world * trace.n_params * p
    comm = ring * (batch.grad_accum if stage >= 2 else 1) + (ring * batch.grad_accum if stage == 3 else 0)
    link = device.link_bytes_per_s if world <= device.gpus_per_node else INTER_NODE_BYTES_PER_S
    offload = offload_time_s(cfg, world, device, batch, trace.n_params)
    exchange = exchange_time_s(cfg, device, batch)
    seconds = max(compute, comm / (link or INTER_NODE_BYTES_PER_S)) + offload + exchange
    source = f"MFU {device.mfu.value:.0%} assumed on {device.label} ({device.mfu.source}); "
    source += "communication overlapped"
    if exchange:
        source += f"; sequence parallelism's all-to-alls add {exchange:.3g} s a step, not overlapped"
    if offload:
        source += f"; offload adds {offload:.3g} s a step (host Adam and PCIe copies, not overlapped)"
    return seconds, flops, flops / seconds / peak, source


def evaluation(
    cfg: Config, device: Device, batch: BatchSplit, trace: StepTrace
) -> tuple[int | None, float | None]:
    """(forwards per rank of one evaluation, its seconds), each None when not known: the whole
    validation split (trainer.eval_batches=0) needs the prepared data; the time needs a GPU."""
    forwards: int | None = cfg.trainer.eval_batches or None
    if forwards is None:
        if not Path(cfg.data.dir).is_dir():
            return None, None
        try:
            # the manifest's counts only: the trainer's own opening checks the shards' ids
            val = PreparedData(cfg.data.dir, full_check_bytes=0, id_check_bytes=0).split("val")
            sequences = len(val) // batch.tokens_per_sample
        except (LmsysError, OSError):  # not prepared here: the plan cannot count the split
            return None, None
        forwards = -(-sequences // (batch.micro_batch_size * batch.data_parallel))
    if device.kind == "cpu" or device.peak_flops is None or device.mfu is None:
        return forwards, None
    flops = trace.flops_per_token / 3 * forwards * batch.rank_tokens
    return forwards, flops / (device.peak_flops * device.mfu.value)


def plan_launch(cfg: Config, world: int, device: Device, suggest: bool = True) -> Plan:
    """The plan of `cfg` on `world` ranks of `device` (ConfigError when the batch does not split)."""
    if world < 1:
        raise ConfigError(f"world={world} must be >= 1")
    batch = split_batch(cfg, world)
    trace, step, components = memory(cfg, world, device, batch)
    seconds, flops, mfu, source = step_time(cfg, world, device, batch, trace)
    forwards, eval_s = evaluation(cfg, device, batch, trace)
    t = cfg.trainer
    shared = device.kind == "cpu" and not device.per_rank  # the machine's memory, shared by its ranks
    ranks_on_node = min(world, device.gpus_per_node)
    host_capacity = device.host_memory_bytes // ranks_on_node if device.host_memory_bytes else None
    plan = Plan(
        device=device,
        world_size=world,
        batch=batch,
        precision=precision_of(cfg, device),
        n_params=trace.n_params,
        components=components,
        host=step.host,
        peak_phase=step.phase,
        device_bytes=device.memory_bytes // world if shared else device.memory_bytes,
        host_capacity_bytes=host_capacity if device.kind == "cuda" else None,
        step_time_s=seconds,
        mfu=mfu,
        time_source=source,
        flops_per_step=flops,
        max_steps=t.max_steps,
        evaluation_s=eval_s,
        evaluations=evaluations_after(0, t.max_steps, t.eval_interval),
        evaluation_forwards=forwards,
    )
    if suggest and not plan.fits:
        plan.suggestions = suggestions(cfg, world, device, plan.peak_bytes)
    return plan


# ----------------------------------------------------------------------------- what would fit


def _with(cfg: Config, **groups: dict[str, Any]) -> Config:
    return replace(cfg, **{name: replace(getattr(cfg, name), **values) for name, values in groups.items()})


def _candidates(cfg: Config, world: int) -> list[tuple[str, Config]]:
    """Changes that may lower the peak, each alone, then all of them together."""
    t, ds = cfg.trainer, cfg.deepspeed
    found: list[tuple[str, Config]] = []
    sequences, micro = t.global_batch_tokens // cfg.data.seq_len, t.micro_batch_size
    groups = world // t.sequence_parallel  # the ranks that read different sequences
    while micro > 1:
        micro //= 2
        if sequences % (micro * groups) == 0:
            accum = sequences // (micro * groups)
            change = f"trainer.micro_batch_size={micro} (accumulation {accum})"
            found.append((change, _with(cfg, trainer={"micro_batch_size": micro})))
    if not ds.activation_checkpointing:
        change = "deepspeed.activation_checkpointing=true"
        found.append((change, _with(cfg, deepspeed={"activation_checkpointing": True})))
    sizes = [size for size in sequence_parallel_sizes(cfg, world) if size > t.sequence_parallel]
    for size in sizes:  # each rank holds T/P of every sequence
        found.append((f"trainer.sequence_parallel={size}", _with(cfg, trainer={"sequence_parallel": size})))
    if cfg.model.loss_impl == "full":
        found.append(("model.loss_impl=chunked", _with(cfg, model={"loss_impl": "chunked"})))
    for stage in range(ds.stage + 1, 4):
        found.append((f"deepspeed.stage={stage}", _with(cfg, deepspeed={"stage": stage})))
    if not ds.offload_optimizer:
        stage = max(ds.stage, 1)
        change = f"deepspeed.stage={stage} deepspeed.offload_optimizer=true"
        found.append((change, _with(cfg, deepspeed={"stage": stage, "offload_optimizer": True})))
    offload_all = {"stage": 3, "offload_optimizer": True, "offload_param": True}
    if not ds.offload_param:
        found.append(
            (
                "deepspeed=zero3_offload (optimizer and parameters in host memory)",
                _with(cfg, deepspeed=offload_all),
            )
        )
    widest = max(sizes, default=t.sequence_parallel)
    smallest = next((m for m in (1, 2, 4) if sequences % (m * world // widest) == 0), t.micro_batch_size)
    everything = _with(
        cfg,
        trainer={"micro_batch_size": min(smallest, t.micro_batch_size), "sequence_parallel": widest},
        deepspeed={"activation_checkpointing": True, **offload_all},
        model={"loss_impl": "chunked" if cfg.model.loss_impl == "full" else cfg.model.loss_impl},
    )
    found.append(("all of the above together", everything))
    return found


def suggestions(cfg: Config, world: int, device: Device, peak: int) -> list[Suggestion]:
    """The changes that lower the predicted peak, by their predicted peak (lowest first); none
    that would raise it."""
    out = []
    for change, changed in _candidates(cfg, world):
        plan = plan_launch(changed, world, device, suggest=False)
        if plan.peak_bytes < peak:
            out.append(Suggestion(change, plan.peak_bytes, plan.fits))
    return sorted(out, key=lambda s: s.peak_bytes)
