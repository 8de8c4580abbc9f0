"""ZeRO's arithmetic over a traced step (lmsys.planning.trace): what one rank holds at each moment of
a training step, by component (parameters, optimizer_states, gradients, activations, zero_buffers,
workspace), as DeepSpeed 0.19's source allocates it; docs/planning.md has the table of what each
counts. With offload_optimizer on a GPU, what DeepSpeed keeps on the host (the fp32 master and
moments, the fp32 gradient partition, the half-precision copy it sends back) is host memory; on a
CPU host memory is the device's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lmsys.core.config import Config
from lmsys.engine.zero import contiguous_gradients
from lmsys.planning.trace import StepTrace, _StepCounter

DS_ALLREDUCE_ELEMENTS = 500_000_000  # ZeRO-0 all-reduces flattened gradients this many at a time
# ZeRO-3 keeps the parameters it gathers until their backward, up to this many elements
# (stage3_max_live_parameters: DeepSpeed's default, which lmsys leaves)
DS_MAX_LIVE_PARAMETERS = 1_000_000_000
COMPONENTS = ("parameters", "optimizer_states", "gradients", "activations", "zero_buffers", "workspace")


@dataclass(frozen=True)
class StepMemory:
    phase: str  # forward, backward, reduce (the backward's end) or step: where the peak is
    components: dict[str, int]  # what is alive then, bytes per rank
    host: dict[str, int]  # what offload keeps in host memory, bytes per rank


def adam_temporaries(numel: int) -> int:
    """Bytes torch's AdamW (foreach=False, lmsys's CPU optimizer) allocates beside its state in
    a step over a parameter of `numel` fp32 elements, traced on a fake tensor (its second step:
    the first creates the state)."""
    fake = FakeTensorMode()
    with fake:
        param = torch.nn.Parameter(torch.empty(numel))
        param.grad = torch.empty(numel)
    adam = torch.optim.AdamW([param], foreach=False)
    peaks = []
    for _ in range(2):
        counter = _StepCounter([], 1)
        with fake, counter:
            adam.step()
        peaks.append(max((live for live, _, _ in counter.points), default=0) - counter.live)
    return peaks[-1]


def step_memory(trace: StepTrace, cfg: Config, world: int, cuda: bool, p: int, grad_accum: int) -> StepMemory:
    """The rank's largest moment over the traced forward and backward of the step's last
    micro-batch, its end and the optimizer step (module docstring), in bytes."""
    ds, n, stage = cfg.deepspeed, trace.n_params, cfg.deepspeed.stage
    part = math.ceil(n / world) if stage else n  # DeepSpeed pads the partitions equal
    offload = cuda and ds.offload_optimizer and stage >= 1
    bucket = min(ds.reduce_bucket_size, n)
    contiguous = contiguous_gradients(cfg, cfg.trainer.sequence_parallel, cuda)
    preallocated = cuda and stage >= 2 and (contiguous or ds.offload_optimizer)
    buckets = ds.reduce_bucket_size * p * (2 if ds.overlap_comm else 1) if preallocated else 0
    accumulating = grad_accum > 1
    gathering = stage == 3 and world > 1
    persistent = sum(k for k in trace.param_numels if k < ds.param_persistence_threshold) if gathering else 0
    params = (part + persistent if stage == 3 else n) * p + trace.buffer_bytes
    if cuda and ds.offload_param and stage == 3:
        params -= part * p
    optimizer = 0 if offload else 12 * part if stage or p < 4 else 8 * n
    if stage < 2:  # every gradient until the step; bf16 at ZeRO-0 beside DeepSpeed's fp32 ones
        held = (4 * n if stage == 0 and p < 4 else 0) + (n * p if accumulating else 0)
        copies = 0
    else:  # the averaged fp32 partition between micro-batches (on the host with offload)
        held = 0 if offload else 4 * part if (accumulating or stage == 3) else 0
        held += 4 * part if stage == 3 and ds.offload_optimizer and not cuda else 0  # the host's, here
        copies = 1 if stage == 2 else 2  # ZeRO-2 the averaged copy, ZeRO-3 + the contiguous bucket
    moments: dict[str, dict[str, int]] = {}
    fill = formed_before = 0
    for i, (act, formed, fetched) in enumerate(zip(trace.live, trace.formed, trace.fetched, strict=True)):
        new, formed_before, flushed = formed - formed_before, formed, 0
        if stage >= 2 and not preallocated and new:  # DeepSpeed reduces a bucket a gradient would overflow
            flushed, fill = (fill, new) if fill and fill + new > bucket else (0, fill + new)
        kept = formed if stage < 2 and not accumulating else fill + flushed
        gathered = min(max(0, fetched - formed - persistent), DS_MAX_LIVE_PARAMETERS) * p if gathering else 0
        alive = dict(
            activations=act, gradients=held + kept * p, zero_buffers=gathered + buckets + copies * flushed * p
        )
        phase = "forward" if i < trace.backward_start else "backward"
        if sum(alive.values()) > sum(moments.get(phase, {}).values()):
            moments[phase] = alive
    if stage < 2:  # the reduction: ZeRO-0 flattens up to 5e8 elements at a time, ZeRO-1 a bucket
        kept, end_copies = (
            (0 if accumulating else n),
            min(n, DS_ALLREDUCE_ELEMENTS if stage == 0 else bucket) * p,
        )
    else:
        kept, end_copies = fill, buckets + copies * fill * p
    if gathering:  # the parameters up to the first block's are still gathered at the end
        end_copies += max(trace.fetched[-1] - trace.formed[-1], trace.first_block_fetched) * p
    moments["reduce"] = dict(activations=trace.live[-1], gradients=held + kept * p, zero_buffers=end_copies)
    step_grads = (
        held if stage >= 2 else 0 if stage == 1 and world > 1 else held + (0 if accumulating else n * p)
    )
    temporaries = 0 if cuda else adam_temporaries(part if stage else max(trace.param_numels, default=0))
    workspace = temporaries + (4 * part if stage == 3 and not offload else 0)
    moments["step"] = dict(gradients=step_grads, workspace=workspace)
    phase = max(moments, key=lambda name: sum(moments[name].values()))
    components = dict.fromkeys(COMPONENTS, 0)
    components.update(parameters=params, optimizer_states=optimizer, **moments[phase])
    return StepMemory(phase, components, host_memory(cfg, n, part, p, cuda))


def host_memory(cfg: Config, n: int, part: int, p: int, cuda: bool) -> dict[str, int]:
    """What offload keeps in host memory per rank (module docstring)."""
    ds, host = cfg.deepspeed, {}
    if ds.offload_optimizer and ds.stage >= 1:
        host = {"optimizer_states": 12 * part, "gradients": 4 * part}
        if cuda:  # the half-precision copy the host's Adam sends back to the GPU
            host["parameters"] = part * p
    if ds.offload_param and ds.stage == 3:
        host["parameters"] = host.get("parameters", 0) + part * p
    return host
