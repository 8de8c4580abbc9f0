"""One kernel launch as a host launcher builds it.

The launchers in `flash_attention.py` and `layer_norm.py` first build `KernelLaunch` records
(kernel, grid, arguments, constexprs, tuning candidates) and then run them. `kernels.inspect`
builds the very same records from meta tensors and compiles them for sm_80 / sm_90 without a
GPU, so what it reports is what a launch on such a device compiles, never a second copy of the
argument lists that could drift from the real one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import triton

Grid = tuple[int, ...] | Callable[[dict], tuple[int, ...]]


@dataclass
class KernelLaunch:
    name: str  # report name, e.g. "attn_fwd", "ln_bwd"
    kernel: Any  # the @triton.jit function (an interpreted one under TRITON_INTERPRET=1)
    grid: Grid
    args: tuple  # positional arguments, in the kernel's order
    kwargs: dict[str, Any]  # constexprs, plus the tiling and num_warps when the launch is not tuned
    # Tuned launches: the triton.autotune wrapper of `kernel` that picks one of `configs`, and the
    # pruner that `tuned` applies for the launching device, callable for any target:
    # prune(configs, capability, smem_per_block) -> the configs worth timing.
    tuned: Any = None
    configs: Sequence[triton.Config] = field(default_factory=list)
    prune: Callable[[list[triton.Config], int | None, int], list[triton.Config]] | None = None
    # Sets argument state that depends on the tiling (tensor-descriptor block shapes), given the
    # named arguments merged with a config's kwargs; the autotune configs carry the same hook.
    pre_hook: Callable[[dict], None] | None = None

    def named_args(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Arguments by kernel parameter name, merged with the kwargs (and `extra`)."""
        names = self.kernel.arg_names
        return {**dict(zip(names, self.args)), **self.kwargs, **(extra or {})}

    def kwargs_for(self, config: triton.Config | None) -> dict[str, Any]:
        """The keyword arguments of a launch with `config` (None: the launch's own kwargs), with
        the pre-hook applied to the arguments, as the autotuner does before it launches."""
        kwargs = {**self.kwargs, **(config.all_kwargs() if config is not None else {})}
        if self.pre_hook is not None:
            self.pre_hook(self.named_args(kwargs))
        return kwargs

    def run(self) -> None:
        if self.tuned is not None:
            self.tuned[self.grid](*self.args, **self.kwargs)
        else:
            self.kernel[self.grid](*self.args, **self.kwargs_for(None))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sm_count(device: torch.device) -> int | None:
    """SMs of a CUDA device (launch geometries fill them); None elsewhere (the interpreter)."""
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
