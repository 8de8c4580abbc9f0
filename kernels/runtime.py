"""How the kernels run in this process: Triton's mode, the launching GPU, one launch as a record,
and the one rule that picks a launch's tiling.

Importing this module imports no triton: lmsys imports it to decide whether to select the Triton CPU
interpreter, which must happen before triton's import. What needs triton imports it when called.

The interpreter. Triton decides at its import whether `@triton.jit` builds compiled GPU kernels
or Python functions for its CPU interpreter (TRITON_INTERPRET in the environment), and builds its
own library functions (tl.sum, ...) then; a kernel of the other mode cannot call them. The mode
is a property of the process, fixed at that import; this module is the only place that reads or
writes the variable:
    interpreter_requested()   the environment asks for the interpreter
    request_interpreter()     ask for it (effective while triton is not imported)
    compiler_environment()    an environment without the request (children that compile for a GPU)
    triton_mode()             None while triton is not imported, else "interpreter" or "compiled"
    interpreting()            the kernels of this process run interpreted (imports triton)

The launching GPU: `device_limits(device)`, its compute capability, SM count and shared memory
per program, read once per device; None off CUDA.

Tiling. A launch's tiling (block sizes, warps, pipeline stages) is a `triton.Config`. Each kernel
module lists its GPU candidates beside the kernels (which ones is decided offline: `python -m
tools.inspect` compiles every listed config for sm_80 and sm_90 and fails on one that spills or
cannot launch) and one small fixed tiling for the interpreter, whose cost grows with the number
of programs and loop steps. At launch `prune_configs` keeps the candidates that fit the device;
flash attention times those that remain (`triton.autotune`), the linear cross-entropy launches
its first. Layer norm derives its geometry from the row width (`kernels/layer_norm.py`).

`KernelLaunch` is one launch as a host launcher builds it; `python -m tools.inspect` builds the same
records from meta tensors and compiles them for sm_80 / sm_90 without a GPU, so what it reports is
what a launch on such a device compiles.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only: importing this module imports no triton
    import triton

_VARIABLE = "TRITON_INTERPRET"
# Values of the variable that Triton reads as "on" (triton.knobs' boolean parsing).
_TRUTHY = ("1", "true", "on", "yes", "y")


# ----------------------------------------------------------------------------------------------
# The interpreter
# ----------------------------------------------------------------------------------------------


def interpreter_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `environ` (default: this process's) asks Triton for its CPU interpreter."""
    value = (os.environ if environ is None else environ).get(_VARIABLE, "")
    return value.strip().lower() in _TRUTHY


def request_interpreter() -> None:
    """Ask for the interpreter, in this process (if triton is not imported yet) and its children."""
    os.environ[_VARIABLE] = "1"


def compiler_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `environ` (default: this process's) without the interpreter request: for a child
    process that compiles kernels for a GPU."""
    return {k: v for k, v in (os.environ if environ is None else environ).items() if k != _VARIABLE}


def triton_mode() -> str | None:
    """How this process's triton builds `@triton.jit` functions: None while triton is not imported,
    else "interpreter" or "compiled" (what its own library functions were built as)."""
    if "triton" not in sys.modules:
        return None
    try:  # triton is already imported: these imports only look at it
        from triton.language import standard
        from triton.runtime import JITFunction

        compiled = isinstance(standard.sum, JITFunction)  # an InterpretedFunction otherwise
    except (ImportError, AttributeError):  # another triton layout: trust the variable it read
        compiled = not interpreter_requested()
    return "compiled" if compiled else "interpreter"


@functools.cache
def interpreting() -> bool:
    """Whether the kernels of this process run in the CPU interpreter (fixed at triton's import,
    which this performs if nobody has)."""
    import triton  # noqa: F401  (the mode is chosen by this import)

    return triton_mode() == "interpreter"


# ----------------------------------------------------------------------------------------------
# The launching GPU
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceLimits:
    """What a launch may use on one GPU."""

    capability: int  # compute capability as one int: 90 for 9.0
    sm_count: int
    smem_per_block: int  # bytes of shared memory one program may use (the opt-in maximum)
    max_threads_per_block: int = 1024


def device_limits(device: torch.device | str) -> DeviceLimits | None:
    """The limits of the CUDA device `device` is; None for any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_limits(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_limits(index: int) -> DeviceLimits:
    props = torch.cuda.get_device_properties(index)
    try:  # what Triton's driver reports, the figure its launcher checks against
        import triton  # the driver's view; kernels are launched through it anyway

        smem = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # an unfamiliar driver: torch's figure, else a consumer GPU's budget
        smem = int(getattr(props, "shared_memory_per_block_optin", 99 * 1024))
    return DeviceLimits(10 * props.major + props.minor, props.multi_processor_count, smem)


# ----------------------------------------------------------------------------------------------
# Tiling
# ----------------------------------------------------------------------------------------------


def prune_configs(
    configs: Sequence[triton.Config],
    device: DeviceLimits,
    shared_bytes: Callable[[triton.Config], int],
    prefer: Callable[[triton.Config], bool] | None = None,
) -> list[triton.Config]:
    """The candidates worth launching on `device`, in their order:

    1. those whose estimated shared memory (`shared_bytes`, an upper bound of what the compiler
       allocates) fits one program on the device, with no more threads than a program may have;
    2. of those, the ones `prefer` likes, when there are any (tiles no longer than the sequence);
    3. never none: the candidate with the least estimated shared memory is the last resort;
    4. under torch.use_deterministic_algorithms the first alone: the tiling sets the order of a
       kernel's sums, so every run launches the same one, not whichever timed fastest.
    """
    fits = [
        c
        for c in configs
        if c.num_warps * 32 <= device.max_threads_per_block and shared_bytes(c) <= device.smem_per_block
    ]
    preferred = [c for c in fits if prefer(c)] if prefer is not None else []
    kept = preferred or fits or [min(configs, key=shared_bytes)]
    return kept[:1] if torch.are_deterministic_algorithms_enabled() else kept


def config(tiling: Mapping[str, int]) -> triton.Config:
    """A fixed tiling as a config: its block constexprs, and num_warps / num_stages when given
    (otherwise Triton's defaults for a launch, 4 and 3)."""
    import triton  # only kernel modules build configs, after triton's import

    blocks = {k: v for k, v in tiling.items() if k not in ("num_warps", "num_stages")}
    return triton.Config(blocks, num_warps=tiling.get("num_warps", 4), num_stages=tiling.get("num_stages", 3))


# ----------------------------------------------------------------------------------------------
# One launch
# ----------------------------------------------------------------------------------------------

Grid = tuple[int, ...] | Callable[[dict], tuple[int, ...]]


@dataclass
class KernelLaunch:
    """One kernel launch: the host launchers build these records, then run them."""

    name: str  # report name, e.g. "attn_fwd", "ln_bwd"
    kernel: Any  # the @triton.jit function (an interpreted one under the interpreter)
    grid: Grid  # a function of the tiling when it depends on it
    args: tuple  # positional arguments, in the kernel's order
    kwargs: dict[str, Any]  # constexprs that do not depend on the tiling
    # The candidate tilings: one for a fixed geometry (and under the interpreter), several where
    # `tuned`, the triton.autotune wrapper of `kernel`, times them.
    configs: Sequence[triton.Config] = field(default_factory=list)
    tuned: Any = None
    # The candidates the launch may run with on a device, as `tuned` prunes them on the launching
    # one: prune(configs, device) -> kept. Default: all of them (a fixed geometry).
    prune: Callable[[list[triton.Config], DeviceLimits], list[triton.Config]] | None = None
    # Sets argument state that depends on the tiling (tensor-descriptor block shapes), given the
    # named arguments merged with a config's kwargs; the autotune configs carry the same hook.
    pre_hook: Callable[[dict], None] | None = None

    def kept(self, device: DeviceLimits) -> list[triton.Config]:
        """The candidates this launch may run with on `device`."""
        return list(self.configs) if self.prune is None else self.prune(list(self.configs), device)

    def named_args(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Arguments by kernel parameter name, merged with the kwargs (and `extra`)."""
        names = self.kernel.arg_names
        return {**dict(zip(names, self.args)), **self.kwargs, **(extra or {})}

    def kwargs_for(self, config: triton.Config) -> dict[str, Any]:
        """The keyword arguments of a launch with `config`, with the pre-hook applied to the
        arguments, as the autotuner does before it launches."""
        kwargs = {**self.kwargs, **config.all_kwargs()}
        if self.pre_hook is not None:
            self.pre_hook(self.named_args(kwargs))
        return kwargs

    def run(self) -> None:
        if self.tuned is not None:
            self.tuned[self.grid](*self.args, **self.kwargs)
        else:
            self.kernel[self.grid](*self.args, **self.kwargs_for(self.configs[0]))
