"""The devices lmsys knows, one table: each GPU's usable memory, dense peak FLOP/s, bandwidths and the
MFU a run on it is assumed to reach, each with its source. A run's MFU is measured against the peak of
the GPU it runs on (by the name torch reports); lmsys-plan plans for any of them (`device=NAME`), for
`device_memory=BYTES` of any other card, or for this machine's CPU. Memory is what the card reports
(torch.cuda's total capacity, as out-of-memory messages print it), not the datasheet's GB read as GiB:
the driver keeps the rest. FLOP/s are the datasheets' dense figures (without structured sparsity),
16-bit with fp32 accumulation (bf16; fp16 on the V100, which has no bf16). Nothing here was measured
by lmsys on a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from lmsys.core.errors import ConfigError

GIB = 1 << 30


@dataclass(frozen=True)
class Mfu:
    """The MFU (model FLOP/s over the dense peak, PaLM's count) a GPU family is assumed to reach."""

    value: float
    source: str  # the published runs it comes from


# The published runs' MFU by lmsys's FLOP count (6N + 6 L H (d_qk + d_vo) T a token; llm-foundry's
# benchmark table uses the same formula). docs/planning.md holds the table of runs the 25% check uses.
AMPERE = Mfu(0.50, "llm-foundry's A100-80GB benchmarks of MPT 125M-7B at T=2048 on 8 GPUs: 44.8-64.2%; "
             "llm.c's GPT-2 124M on 8 A100-80GB (10B tokens in about 90 minutes): about 63%")  # fmt: skip
HOPPER = Mfu(0.42, "llm-foundry's H100 benchmarks of MPT 760M-3B at T=2048 on 8-64 GPUs: 34.9-46.4%; "
             "llm.c's GPT-2 1558M on 8 H100 (about 33B tokens in 24 hours): about 50%")  # fmt: skip
VOLTA = Mfu(0.32, "the ZeRO-Offload paper: 40 TFLOP/s a V100 (32% of 125) for a 10B model")
DESKTOP = Mfu(0.40, "an assumption: one published run, nanoGPT's GPT-2 124M on one RTX 4090 at 29% of the "
              "A100's 312 TFLOP/s (about 55% of the 4090's 165); none found for the other "
              "PCIe cards")  # fmt: skip


@dataclass(frozen=True)
class Device:
    """A device a rank runs on, and the node around it (what offload uses)."""

    name: str  # device=NAME
    label: str
    kind: str  # "cuda" | "cpu": the precision and the kernels a run takes
    memory_bytes: int  # usable per device (cpu: the machine's, shared by its ranks)
    memory_source: str
    peak_flops: float | None  # dense 16-bit tensor peak per device (None: a CPU, no MFU)
    peak_fp32_flops: float | None
    mfu: Mfu | None
    link_bytes_per_s: float | None = None  # per GPU between the GPUs of a node (NVLink, else PCIe)
    pcie_bytes_per_s: float | None = None  # host <-> GPU, each way
    host_bytes_per_s: float | None = None  # the node's DRAM bandwidth, shared by its GPUs
    host_memory_bytes: int | None = None  # the node's RAM, shared by its GPUs (offload)
    gpus_per_node: int = 8
    node: str = ""  # what the node figures assume
    per_rank: bool = False  # memory_bytes is each rank's own (device_memory=, trainer.plan_memory_bytes)


# The nodes around the GPUs, in Device's field order: link_bytes_per_s, pcie_bytes_per_s,
# host_bytes_per_s, host_memory_bytes, gpus_per_node, node
_DGX_A100 = (300e9, 32e9, 2 * 204.8e9, 1024 * GIB, 8, "a DGX A100: 2 AMD EPYC 7742, 8 channels of "
             "DDR4-3200 each, 1 TiB; NVLink 600 GB/s both ways, PCIe Gen4")  # fmt: skip
_DGX_H100 = (450e9, 64e9, 2 * 307.2e9, 2048 * GIB, 8, "a DGX H100: 2 Xeon Platinum 8480C, 8 channels of "
             "DDR5-4800 each, 2 TiB; NVLink 900 GB/s both ways, PCIe Gen5")  # fmt: skip
_DGX2 = (150e9, 16e9, 2 * 128e9, 1536 * GIB, 16, "a DGX-2 (DeepSpeed's tutorials' node): 2 Xeon Platinum "
         "8168, 6 channels of DDR4-2666 each, 1.5 TiB; NVSwitch 300 GB/s both ways, PCIe Gen3")  # fmt: skip
_DGX1 = (150e9, 16e9, 2 * 76.8e9, 512 * GIB, 8, "a DGX-1: 2 Xeon E5-2698 v4, 4 channels of DDR4-2400 "
         "each, 512 GiB; NVLink 300 GB/s both ways, PCIe Gen3")  # fmt: skip
_AWS = (32e9, 32e9, 2 * 204.8e9, 768 * GIB, 8, "an AWS g5/g6 48xlarge: 2 AMD EPYC, 8 channels of "
        "DDR4-3200 each, 768 GiB; no NVLink, PCIe Gen4")  # fmt: skip
_DESK = (32e9, 32e9, 204.8e9, 256 * GIB, 4, "an assumed workstation: 4 GPUs, one CPU with 8 channels of "
         "DDR4-3200, 256 GiB; PCIe Gen4")  # fmt: skip
# name, label, usable GiB and the report it is read from, dense 16-bit and fp32 FLOP/s (datasheets),
# MFU, node
_TABLE = [
    ("v100-16gb", "V100 SXM2 16GB", 15.78, "kchengiva/Shift-GCN#34", 125e12, 15.7e12, VOLTA, _DGX1),
    ("v100-32gb", "V100 SXM 32GB", 31.75, "uni-medical/SAM-Med3D#8", 125e12, 15.7e12, VOLTA, _DGX2),
    ("a10g", "A10G (AWS g5)", 22.20, "XavierXiao/Dreambooth-Stable-Diffusion#18", 125e12, 31.2e12, DESKTOP,
     _AWS),
    ("l4", "L4", 22.03, "ArcInstitute/evo2#190", 121e12, 30.3e12, DESKTOP, _AWS),
    ("l40s", "L40S", 44.53, "Wan-Video/Wan2.1#205", 362e12, 91.6e12, DESKTOP, _AWS),
    ("rtx3090", "GeForce RTX 3090", 23.70, "Lightning-AI/lit-llama#137", 35.6e12, 35.6e12, DESKTOP, _DESK),
    ("rtx4090", "GeForce RTX 4090", 23.61, "pinokiofactory/flux-webui#11", 165.2e12, 82.6e12, DESKTOP, _DESK),
    ("a6000", "RTX A6000", 47.54, "google-research/semivl#18", 154.8e12, 38.7e12, DESKTOP, _DESK),
    ("a100-40gb", "A100 SXM 40GB", 39.50, "TianheWu/CoSeR#10", 312e12, 19.5e12, AMPERE, _DGX_A100),
    ("a100-80gb", "A100 SXM 80GB", 79.25, "wbfwonderful/Vad-R1#11", 312e12, 19.5e12, AMPERE, _DGX_A100),
    ("h100", "H100 SXM 80GB", 79.11, "vllm-project/vllm#27508", 989e12, 67e12, HOPPER, _DGX_H100),
    ("h200", "H200 SXM 141GB", 139.5, "", 989e12, 67e12, HOPPER, _DGX_H100),
]  # fmt: skip
# no published report of the H200's: 141 GiB less the share of its memory the H100's driver keeps
H200_ESTIMATE = "139.5 GiB, estimated: 141 GiB x 79.11 / 80 (the H100's reported share)"
GPUS: dict[str, Device] = {
    name: Device(
        name, f"NVIDIA {label}", "cuda", int(gib * GIB), f"{gib} GiB ({source})" if source else H200_ESTIMATE,
        bf16, fp32, family, *node,
    )
    for name, label, gib, source, bf16, fp32, family, node in _TABLE
}  # fmt: skip
# torch.cuda.get_device_name fragments, most specific first -> the table's entry (a run's MFU)
NAMES = [
    ("H200", "h200"), ("H100", "h100"), ("A100-SXM4-40GB", "a100-40gb"), ("A100", "a100-80gb"),
    ("L40S", "l40s"), ("L4", "l4"), ("A10G", "a10g"), ("RTX A6000", "a6000"), ("RTX 4090", "rtx4090"),
    ("RTX 3090", "rtx3090"), ("V100-SXM2-16GB", "v100-16gb"), ("V100", "v100-32gb"),
]  # fmt: skip
DEVICE_NAMES = ("cpu", *GPUS)


def gpu_by_name(name: str) -> Device | None:
    """The table's entry for a GPU called `name` (torch.cuda.get_device_name's), or None."""
    return next((GPUS[key] for fragment, key in NAMES if fragment in name), None)


def device_peak_flops(device: torch.device) -> float | None:
    """Dense 16-bit peak of one device in FLOP/s, or None (a CPU, an unknown GPU): MFU is then null."""
    known = gpu_by_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return known.peak_flops if known else None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads/process)"


def mfu(
    flops_per_token: float, tokens_per_s: float, peak_per_device: float | None, world_size: int
) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak of all devices."""
    if peak_per_device is None or tokens_per_s <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak_per_device * world_size)


def host_memory_bytes() -> int:
    """This machine's physical memory (os.sysconf; /proc/meminfo's MemTotal where sysconf lacks it)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    raise ConfigError("cannot read this machine's memory size (os.sysconf, /proc/meminfo)")


def cpu_device() -> Device:
    memory = host_memory_bytes()
    return Device(
        "cpu", f"this machine's CPU ({os.cpu_count()} cores)", "cpu", memory, "os.sysconf", None, None, None,
        host_memory_bytes=memory, gpus_per_node=1,
    )  # fmt: skip


def device_spec(name: str, memory_bytes: int = 0) -> Device:
    """The Device of `device=NAME`; memory_bytes: another card's capacity, per rank."""
    if name not in DEVICE_NAMES:
        raise ConfigError(f"device={name!r} is not known; choose one of: {', '.join(DEVICE_NAMES)}")
    device = cpu_device() if name == "cpu" else GPUS[name]
    if memory_bytes:
        return replace(device, memory_bytes=memory_bytes, memory_source="given", per_rank=True)
    return device


def this_gpu(index: int = 0) -> Device:
    """The table's entry for this machine's CUDA device, or one made from what torch reports."""
    name = torch.cuda.get_device_name(index)
    total = torch.cuda.get_device_properties(index).total_memory
    known = gpu_by_name(name)
    if known is not None:
        return replace(known, memory_bytes=total, memory_source="torch.cuda")
    return Device(name, name, "cuda", total, "torch.cuda", None, None, None)
