"""DeepSpeed's console noise that says nothing an lmsys line does not: what the engine layer
silences, and whether a launch still has DeepSpeed's ops to build (the start line says so only
then).

- `DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully`: a print() of every
  rank at every launch (CPU), even when the op was built long ago;
- `[deepspeed] OVERFLOW! Skipping step ...`: DeepSpeed's warning for a non-finite gradient, beside
  lmsys's own for the same step (lmsys.training.trainer).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

NOISE = ("built successfully",)


class _NoOverflow(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "OVERFLOW!" not in record.getMessage()


def quiet_overflow(logger: logging.Logger) -> None:
    """Drop DeepSpeed's overflow warnings on `logger` (once)."""
    if not any(isinstance(f, _NoOverflow) for f in logger.filters):
        logger.addFilter(_NoOverflow())


@contextlib.contextmanager
def without_build_lines() -> Iterator[None]:
    """Run DeepSpeed code whose print()s of built ops are dropped; its other lines still print."""
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        yield
    kept = [line for line in captured.getvalue().splitlines() if not any(n in line for n in NOISE)]
    if kept:
        print("\n".join(kept), file=sys.stdout, flush=True)


def ops_to_build(device: torch.device, offload_optimizer: bool = False) -> bool:
    """Whether DeepSpeed will still compile an op this launch uses (a minute or two, once per
    machine): on CPU its shared-memory collectives, on CUDA its fused Adam (CPU Adam when the
    optimizer is offloaded). Judged from torch's extension build directory ($TORCH_EXTENSIONS_DIR,
    else torch's default, which this creates); True when unsure (ops built into the wheel)."""
    if device.type == "cpu":
        name = "deepspeed_shm_comm"
    else:
        name = "cpu_adam" if offload_optimizer else "fused_adam"
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: guarded

        build = Path(_get_build_directory(name, verbose=False))
    except Exception:  # pragma: no cover - torch moved it
        return True
    return not any(build.glob(f"{name}*.so")) if build.is_dir() else True
