"""DeepSpeed's console noise that says nothing an lmsys line does not: what the engine layer
silences, and whether a launch still has DeepSpeed's ops to build (the start line says so only
then).

- `DeepSpeed ... built successfully`: a print() of every rank at every launch whose op was built,
  even long ago (lmsys no longer builds DeepSpeed's CPU collectives: skip_cpu_collectives_op);
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


# DeepSpeed's CPU shared-memory collectives (its ShareMemCommBuilder's op name)
CPU_COLLECTIVES_OP = "deepspeed_shm_comm"


def skip_cpu_collectives_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory collectives on CPU.

    deepspeed.init_distributed on its CPU accelerator JIT-builds this C++ op (about 100 CPU-seconds
    and a C++ compiler, once per machine; the first launch waits for it), and only its
    inference_all_reduce uses it: training's collectives go through torch.distributed (gloo) in any
    case. The op is marked incompatible, as DeepSpeed marks it when its compiler probe fails, so
    init_distributed does not build or load it.
    """
    import deepspeed.ops  # late: as lmsys.engine.zero's docstring says, only where it is used

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)  # probed once, then cached
    if isinstance(compatible, dict):
        compatible[CPU_COLLECTIVES_OP] = False


def ops_to_build(device: torch.device, offload_optimizer: bool = False) -> bool:
    """Whether DeepSpeed will still compile an op this launch uses (a minute or two, once per
    machine): on CUDA its fused Adam (CPU Adam when the optimizer is offloaded); on CPU none
    (skip_cpu_collectives_op). Judged from torch's extension build directory
    ($TORCH_EXTENSIONS_DIR, else torch's default, which this creates); True when unsure (ops built
    into the wheel)."""
    if device.type == "cpu":
        return False
    name = "cpu_adam" if offload_optimizer else "fused_adam"
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: guarded

        build = Path(_get_build_directory(name, verbose=False))
    except Exception:  # pragma: no cover - torch moved it
        return True
    return not any(build.glob(f"{name}*.so")) if build.is_dir() else True
