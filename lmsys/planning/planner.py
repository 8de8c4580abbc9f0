"""The plan of a launch before it starts: memory and time per rank for any Config, world size and
device, and what would fit when it does not (lmsys-plan, lmsys-train's startup line, the check
before a launch). docs/planning.md says what each term counts and where its figures come from.

Memory: the traced step (lmsys.planning.trace) with ZeRO's arithmetic (lmsys.planning.zero_memory)
at the step's largest moment, plus the allocator's margin. Time, on a GPU only: the model's FLOPs
over the device's peak at its family's MFU (lmsys.core.devices), ZeRO's communication overlapped,
offload's host Adam and copies and sequence parallelism's all-to-alls in series.
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

# The allocator's margin on CUDA, from published out-of-memory reports (docs/planning.md): reserved
# over allocated memory (10 of 13 at or below 1.05), and the process's memory outside the allocator
# (the CUDA context, cuBLAS's and NCCL's buffers) by {world > 1}.
RESERVED_OVER_ALLOCATED = 1.05
NON_PYTORCH_BYTES = {False: GIB // 2, True: 3 * GIB // 2}
CPU_MARGIN = 0.05  # glibc's arenas beside the tensors, on a CPU (an assumption)
# Offload on a GPU: DeepSpeed's CPU Adam reads 16 bytes a parameter and writes 14, at this share of
# the node's DRAM peak (both from the update's arithmetic, not measured on a GPU).
HOST_ADAM_BYTES_PER_PARAM = 30
HOST_EFFICIENCY = 0.7
INTER_NODE_BYTES_PER_S = 50e9  # per GPU between nodes: a 400 Gb/s NIC per GPU (an assumption)


def precision_of(cfg: Config, device: Device) -> str:
    choice = cfg.deepspeed.precision
    return ("bf16" if device.kind == "cuda" else "fp32") if choice == "auto" else choice


def _bytes_per_value(cfg: Config, device: Device) -> int:
    return 4 if precision_of(cfg, device) == "fp32" else 2


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
        own = ("peak_bytes", "device_bytes", "fits", "peak_phase", "step_time_s", "tokens_per_s", "mfu",
               "time_source", "evaluation_s", "evaluations", "run_time_s", "world_size", "precision",
               "n_params")  # fmt: skip
        return {
            **{name: getattr(self, name) for name in own},
            "components": dict(self.components),
            "headroom_bytes": self.device_bytes - self.peak_bytes,
            "host_bytes": dict(self.host),
            "host_capacity_bytes": self.host_capacity_bytes,
            "device": self.device.name,
            "device_memory_source": self.device.memory_source,
            "micro_batch_size": self.batch.micro_batch_size,
            "grad_accum": self.batch.grad_accum,
            "suggestions": [vars(s) for s in self.suggestions],
        }


def memory(
    cfg: Config, world: int, device: Device, batch: BatchSplit
) -> tuple[StepTrace, StepMemory, dict[str, int]]:
    """(the trace, the step's largest moment, the components with the allocator margin), bytes per rank."""
    cuda = device.kind == "cuda"
    trace = trace_step(cfg, cuda, precision_of(cfg, device), batch.micro_batch_size)
    step = step_memory(trace, cfg, world, cuda, _bytes_per_value(cfg, device), batch.grad_accum)
    allocated = sum(step.components.values())
    if cuda:
        margin = int(allocated * (RESERVED_OVER_ALLOCATED - 1)) + NON_PYTORCH_BYTES[world > 1]
    else:
        margin = int(allocated * CPU_MARGIN)
    return trace, step, {**step.components, "allocator_margin": margin}


def serial_time_s(
    cfg: Config, world: int, device: Device, batch: BatchSplit, n_params: int
) -> tuple[float, float]:
    """(offload's, sequence parallelism's) seconds a step on a GPU spends in series with the compute.
    Offload: the host's Adam over the rank's partition, its gradients copied to the host (after
    each micro-batch from ZeRO-2) and its weights back, with offload_param its weights fetched for
    every pass (DeepSpeed overlaps part of the copies: this errs long). Sequence parallelism: every
    layer's all-to-alls in each forward and backward, over the node's links."""
    ds, p = cfg.deepspeed, _bytes_per_value(cfg, device)
    if device.kind != "cuda":
        return 0.0, 0.0
    passes = batch.grad_accum * (3 if ds.activation_checkpointing else 2)
    offload = 0.0
    if ds.offload_optimizer or ds.offload_param:
        assert device.pcie_bytes_per_s and device.host_bytes_per_s, device.name
        partition = math.ceil(n_params / world)
        host_share = device.host_bytes_per_s / min(world, device.gpus_per_node)
        copied = 0 if ds.offload_param and ds.offload_optimizer else partition * p  # updated on one side
        if ds.offload_optimizer:
            offload = partition * HOST_ADAM_BYTES_PER_PARAM / (host_share * HOST_EFFICIENCY)
            copied += (batch.grad_accum if ds.stage >= 2 else 1) * partition * p
        if ds.offload_param:
            copied += passes * partition * p
        offload += copied / device.pcie_bytes_per_s
    exchange = 0.0
    if batch.sequence_parallel > 1:
        elements = exchanged_elements(cfg.model, batch.rank_tokens, batch.sequence_parallel)
        link = device.link_bytes_per_s or INTER_NODE_BYTES_PER_S
        exchange = passes * cfg.model.n_layers * elements * p / link
    return offload, exchange


def step_time(
    cfg: Config, world: int, device: Device, batch: BatchSplit, trace: StepTrace
) -> tuple[float | None, float, float | None, str]:
    """(seconds per optimizer step or None, FLOPs per step per rank, MFU, where the time comes from)."""
    tokens = batch.rank_tokens * batch.grad_accum  # per rank per step (T/P per sequence under P)
    flops = float((trace.flops_per_token + trace.recompute_flops_per_token) * tokens)
    if device.kind == "cpu" or device.peak_flops is None or device.mfu is None:
        why = "a CPU" if device.kind == "cpu" else f"{device.label}: no known peak FLOP/s"
        return None, flops, None, f"no time on {why} (lmsys-train's progress line measures it)"
    p = _bytes_per_value(cfg, device)
    peak = device.peak_flops if p == 2 else device.peak_fp32_flops or device.peak_flops
    # ring traffic of the gradients' reduce(-scatter): once a step at ZeRO-0/1, after every
    # micro-batch from ZeRO-2; ZeRO-3 also all-gathers the parameters for each forward and backward
    stage, ring = cfg.deepspeed.stage, 2 * (world - 1) / world * trace.n_params * p
    comm = ring * (batch.grad_accum if stage >= 2 else 1) + (ring * batch.grad_accum if stage == 3 else 0)
    link = device.link_bytes_per_s if world <= device.gpus_per_node else INTER_NODE_BYTES_PER_S
    offload, exchange = serial_time_s(cfg, world, device, batch, trace.n_params)
    seconds = (
        max(flops / (peak * device.mfu.value), comm / (link or INTER_NODE_BYTES_PER_S)) + offload + exchange
    )
    source = f"MFU {device.mfu.value:.0%} assumed on {device.label} ({device.mfu.source})"
    source += "; communication overlapped"
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
        try:  # the manifest's counts only: the trainer's own opening checks the shards' ids
            if not Path(cfg.data.dir).is_dir():
                return None, None
            val = PreparedData(cfg.data.dir, full_check_bytes=0, id_check_bytes=0).split("val")
        except (LmsysError, OSError):  # not prepared here: the plan cannot count the split
            return None, None
        sequences = len(val) // batch.tokens_per_sample
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
    shared = device.kind == "cpu" and not device.per_rank  # the machine's memory, shared by its ranks
    host = device.host_memory_bytes // min(world, device.gpus_per_node) if device.host_memory_bytes else None
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
        host_capacity_bytes=host if device.kind == "cuda" else None,
        step_time_s=seconds,
        mfu=mfu,
        time_source=source,
        flops_per_step=flops,
        max_steps=cfg.trainer.max_steps,
        evaluation_s=eval_s,
        evaluations=evaluations_after(0, cfg.trainer.max_steps, cfg.trainer.eval_interval),
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

    def add(change: str, **groups: dict[str, Any]) -> None:
        found.append((change, _with(cfg, **groups)))

    sequences, micro = t.global_batch_tokens // cfg.data.seq_len, t.micro_batch_size
    groups = world // t.sequence_parallel  # the ranks that read different sequences
    while micro > 1:
        micro //= 2
        if sequences % (micro * groups) == 0:
            accum = sequences // (micro * groups)
            add(
                f"trainer.micro_batch_size={micro} (accumulation {accum})",
                trainer={"micro_batch_size": micro},
            )
    if not ds.activation_checkpointing:
        add("deepspeed.activation_checkpointing=true", deepspeed={"activation_checkpointing": True})
    sizes = [size for size in sequence_parallel_sizes(cfg, world) if size > t.sequence_parallel]
    for size in sizes:  # each rank holds T/P of every sequence
        add(f"trainer.sequence_parallel={size}", trainer={"sequence_parallel": size})
    chunked = "chunked" if cfg.model.loss_impl == "full" else cfg.model.loss_impl
    if chunked != cfg.model.loss_impl:
        add("model.loss_impl=chunked", model={"loss_impl": chunked})
    for stage in range(ds.stage + 1, 4):
        add(f"deepspeed.stage={stage}", deepspeed={"stage": stage})
    if not ds.offload_optimizer:
        stage = max(ds.stage, 1)
        add(
            f"deepspeed.stage={stage} deepspeed.offload_optimizer=true",
            deepspeed={"stage": stage, "offload_optimizer": True},
        )
    offload_all = {"stage": 3, "offload_optimizer": True, "offload_param": True}
    if not ds.offload_param:
        add("deepspeed=zero3_offload (optimizer and parameters in host memory)", deepspeed=offload_all)
    widest = max(sizes, default=t.sequence_parallel)
    smallest = next((m for m in (1, 2, 4) if sequences % (m * world // widest) == 0), t.micro_batch_size)
    add(
        "all of the above together",
        trainer={"micro_batch_size": min(smallest, t.micro_batch_size), "sequence_parallel": widest},
        deepspeed={"activation_checkpointing": True, **offload_all},
        model={"loss_impl": chunked},
    )
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
