"""torch.compile for lmsys (`trainer.compile=auto|true|false`, `lmsys-generate compile=...`).

What is compiled: the module the DeepSpeed engine runs (the loss of `Transformer`, so training
steps and evaluation) with `nn.Module.compile()`, in place, so the state-dict keys, and with them
checkpoints and exports, are the same as eager; for generation, the model's forward with dynamic
shapes (the KV cache grows by one position per token: one graph for the prompt and one for every
later step, not one per token). The Triton kernels are torch custom ops (kernels/library.py), so
dynamo traces through them.

auto compiles on CUDA and runs eager elsewhere (on a CPU inductor's C++ code takes minutes to
build for a small gain); a compile failure under auto falls back to eager (dynamo's
suppress_errors) with one warning; under true it is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from lmsys.cli import one_line
from lmsys.console import Console
from lmsys.errors import ConfigError, LmsysError

T = TypeVar("T")


def wants_compile(choice: str, device: torch.device) -> bool:
    """Whether `choice` compiles on `device`."""
    return device.type == "cuda" if choice == "auto" else choice == "true"


def compile_module(module: nn.Module, strict: bool, dynamic: bool | None = None) -> None:
    """Compile `module`'s forward in place (inductor). strict=False (auto): a frame that fails to
    compile runs eager instead."""
    import torch._dynamo  # late: only runs that compile pay for dynamo's configuration

    torch._dynamo.config.suppress_errors = not strict
    module.compile(dynamic=dynamic)


@dataclass(frozen=True)
class CompileStats:
    """Dynamo's process-wide counts so far."""

    graphs: int  # frames compiled into a graph (a recompilation adds one)
    graph_breaks: int
    seconds: float  # compiling, forward and backward graphs


def compile_stats() -> CompileStats:
    from torch._dynamo.utils import calculate_time_spent, counters  # late: see compile_module

    times = calculate_time_spent()
    seconds = times.get("entire_frame_compile", 0.0) + times.get("entire_backward_compile", 0.0)
    return CompileStats(
        graphs=int(counters["stats"]["unique_graphs"]),
        graph_breaks=int(sum(counters["graph_break"].values())),
        seconds=float(seconds),
    )


def strict_compile(step: Callable[[int], T], number: int) -> T:
    """Run the first step of a trainer.compile=true launch, where dynamo compiles: a failure is
    one error line (ConfigError, exit 2: the configuration is unsupported), not its traceback."""
    try:
        return step(number)
    except Exception as exc:
        if isinstance(exc, LmsysError):
            raise
        raise ConfigError(
            f"trainer.compile=true: torch.compile failed on this model and device ({type(exc).__name__}: "
            f"{one_line(exc)}); "
            "trainer.compile=false trains eager"
        ) from exc


def say_first_compile(console: Console, first_step_s: float) -> None:
    """Once, after a compiled launch's first step: what was compiled and how long it took, or
    (auto, after dynamo fell back) a warning that the run is eager."""
    stats = compile_stats()
    if stats.graphs == 0:
        console.warn("torch.compile failed on this model and device; training runs eager")
        return
    console.say(
        f"{console.prog}: torch.compile: {stats.graphs} graph(s), {stats.graph_breaks} graph break(s), "
        f"compiled in {stats.seconds:.1f} s (the first step took {first_step_s:.1f} s)"
    )


def compile_summary() -> str:
    stats = compile_stats()
    return (
        f"torch.compile: {stats.graphs} graph(s) in all (the training step; evaluation, without "
        f"gradients, has its own), {stats.seconds:.1f} s compiling"
    )
