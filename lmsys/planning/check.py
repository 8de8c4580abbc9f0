"""The check before a launch (trainer.plan), the one part of the planner training imports: the
plan of the device the launch will train on, and a launch predicted not to fit refused (auto: on
CUDA) or warned about before any process group, model or engine exists."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from lmsys.core.config import Config
from lmsys.core.devices import Device, cpu_device, this_gpu
from lmsys.core.errors import ConfigError
from lmsys.model.ops import prepare_kernels
from lmsys.planning.planner import Plan, plan_launch
from lmsys.planning.report import evaluation_warning, mib, startup_line

__all__ = ["Plan", "check_plan", "evaluation_warning", "mib", "run_device", "startup_line"]


def run_device(cfg: Config) -> Device:
    """The Device a launch of `cfg` trains on, seen from this machine (trainer.device), with
    trainer.plan_memory_bytes applied (each rank's own memory)."""
    choice = cfg.trainer.device
    device = (
        this_gpu() if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else cpu_device()
    )
    if cfg.trainer.plan_memory_bytes:
        given = cfg.trainer.plan_memory_bytes
        device = replace(device, memory_bytes=given, memory_source="trainer.plan_memory_bytes", per_rank=True)
    return device


def check_plan(cfg: Config, world: int, warn: Callable[[str], None]) -> Plan | None:
    """The plan, or None (trainer.plan=off); ConfigError naming what would lower the peak for a
    launch predicted not to fit under refuse (auto: on CUDA); a warning under warn."""
    if cfg.trainer.plan == "off":
        return None
    device = run_device(cfg)
    # the trace runs the ops the run will (model.kernels=triton on a CPU: the interpreter, chosen first)
    prepare_kernels(cfg.model.kernels, "cuda" if device.kind == "cuda" else "cpu")
    plan = plan_launch(cfg, world, device)
    if plan.fits:
        return plan
    fixes = "; ".join(f"{s.change} ({mib(s.peak_bytes)})" for s in plan.suggestions if s.fits)
    message = (
        f"predicted peak memory {mib(plan.peak_bytes)} per rank does not fit {mib(plan.device_bytes)} "
        f"on {device.label} (lmsys-plan shows the components); "
        + (f"what would fit: {fixes}" if fixes else "nothing tried fits; use more ranks or a larger device")
        + f" (the plan as lmsys-plan prints it: lmsys-plan model={cfg.model.name} "
        f"deepspeed.stage={cfg.deepspeed.stage} trainer.micro_batch_size={cfg.trainer.micro_batch_size} "
        f"world={world} ...)"
    )
    if cfg.trainer.plan == "refuse" or (cfg.trainer.plan == "auto" and device.kind == "cuda"):
        raise ConfigError(message + "; trainer.plan=warn launches anyway")
    warn(message)
    return plan
