"""The devices lmsys knows: each GPU's dense bf16 peak FLOP/s by its name (a run's MFU is measured
against it), the devices a launch can be planned for (lmsys-plan device=NAME) with their memory,
peak FLOP/s and bandwidths, each with its source, and this machine's CPU (its memory, its
measured FLOP rate).

The GPU figures are the vendors' datasheet numbers (dense, i.e. without structured sparsity);
memory is the datasheet capacity, read as GiB (what nvidia-smi lists as the card's total is a
little less; the plan keeps a margin for the CUDA context and the allocator). Nothing here was
measured on a GPU.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from lmsys.core.errors import ConfigError

GIB = 1 << 30

# Dense bf16 tensor-core peak FLOP/s by a fragment of the device's name, most specific first: what a
# run's MFU is measured against (docs/DESIGN.md), and the planned devices' (GPUS) peak.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A6000", 155e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16 tensor cores (no bf16)
    ("T4", 65e12),  # fp16 tensor cores (no bf16)
]


def bf16_peak(name: str) -> float | None:
    """The dense bf16 peak in FLOP/s of the GPU called `name` (torch.cuda.get_device_name's), or None."""
    return next((peak for fragment, peak in PEAK_BF16_FLOPS if fragment in name), None)


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of one device in FLOP/s, or None (CPU, unknown GPU): MFU is then null."""
    return bf16_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


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


@dataclass(frozen=True)
class Device:
    """One device a rank runs on."""

    name: str  # the key of `device=NAME`
    label: str  # what it is, for the report
    kind: str  # "cuda" | "cpu": decides the precision (deepspeed.precision=auto) and the kernels
    memory_bytes: int  # per device (cpu: the whole machine's, shared by its ranks)
    peak_bf16_flops: float | None  # dense tensor-core peak per device (None: measured, see cpu_flops)
    peak_fp32_flops: float | None  # plain fp32 (not TF32) peak per device
    hbm_bytes_per_s: float | None
    interconnect_bytes_per_s: float | None  # per GPU, NVLink total (both directions)
    source: str
    per_rank: bool = False  # memory_bytes is each rank's own (trainer.plan_memory_bytes), not shared
    # What offload (ZeRO-Offload) runs over: each GPU's PCIe link, each direction, and the memory
    # bandwidth of the host of a typical node, shared by its GPUs (both None on the CPU).
    pcie_bytes_per_s: float | None = None
    host_bytes_per_s: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# The host side of offload: the node's DRAM peak (channels x transfer rate x 8 bytes per socket, two
# sockets), shared by the node's GPUs. An assumption about the node, not a property of the GPU.
_DGX_A100_HOST = (
    "a DGX A100-like node, 2 AMD EPYC 7742 with 8 channels of DDR4-3200 each (204.8 GB/s per socket), "
    "409.6 GB/s shared by its GPUs"
)
_DGX_H100_HOST = (
    "a DGX H100-like node, 2 Intel Xeon Platinum 8480C with 8 channels of DDR5-4800 each (307.2 GB/s per "
    "socket), 614.4 GB/s shared by its GPUs"
)

GPUS: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            "a100-40gb", "NVIDIA A100 SXM 40GB", "cuda", 40 * GIB, bf16_peak("A100"), 19.5e12, 1555e9, 600e9,
            "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS (dense), FP32 19.5 TFLOPS, "
            "HBM2 1,555 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s (both directions); host: " + _DGX_A100_HOST,
            pcie_bytes_per_s=32e9, host_bytes_per_s=2 * 204.8e9,
        ),
        Device(
            "a100-80gb", "NVIDIA A100 SXM 80GB", "cuda", 80 * GIB, bf16_peak("A100"), 19.5e12, 2039e9, 600e9,
            "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS (dense), FP32 19.5 TFLOPS, "
            "HBM2e 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s (both directions); host: " + _DGX_A100_HOST,
            pcie_bytes_per_s=32e9, host_bytes_per_s=2 * 204.8e9,
        ),
        Device(
            "h100", "NVIDIA H100 SXM 80GB", "cuda", 80 * GIB, bf16_peak("H100"), 67e12, 3.35e12, 900e9,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity = 989 dense, "
            "FP32 67 TFLOPS, HBM3 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions); "
            "host: " + _DGX_H100_HOST,
            pcie_bytes_per_s=64e9, host_bytes_per_s=2 * 307.2e9,
        ),
        Device(
            "h200", "NVIDIA H200 SXM 141GB", "cuda", 141 * GIB, bf16_peak("H200"), 67e12, 4.8e12, 900e9,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity = 989 dense, "
            "FP32 67 TFLOPS, HBM3e 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions); "
            "host: " + _DGX_H100_HOST,
            pcie_bytes_per_s=64e9, host_bytes_per_s=2 * 307.2e9,
        ),
    )
}  # fmt: skip
DEVICE_NAMES = ("cpu", *GPUS)


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
    return Device(
        "cpu", f"this machine's CPU ({os.cpu_count()} cores)", "cpu", host_memory_bytes(),
        None, None, None, None, "os.sysconf(SC_PHYS_PAGES) x SC_PAGE_SIZE; FLOP rate measured (cpu_flops)",
    )  # fmt: skip


def device_spec(name: str) -> Device:
    """The Device of `device=NAME`; ConfigError naming the valid ones."""
    if name == "cpu":
        return cpu_device()
    if name in GPUS:
        return GPUS[name]
    raise ConfigError(f"device={name!r} is not known; choose one of: {', '.join(DEVICE_NAMES)}")


def cpu_flops(threads: int = 1, seconds: float = 0.3) -> float:
    """fp32 matmul FLOP/s of this CPU with `threads` threads (torchrun gives each CPU worker one):
    the best of repeated 256x512 @ 512x512 products, about the shapes of the small models' GEMMs."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(256, 512), torch.randn(512, 512)
        best = float("inf")
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            best = min(best, (time.perf_counter() - start) / 4)
        return 2 * 256 * 512 * 512 / best
    finally:
        torch.set_num_threads(previous)
