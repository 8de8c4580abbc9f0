"""torch.compile for lmsys: `trainer.compile=auto|true|false` (training and its evaluation), and
the `compile=` option of lmsys-generate and lmsys-eval.

What is compiled, and why there:
- Training at ZeRO 0-2: the module the DeepSpeed engine runs (the model's loss), with
  `nn.Module.compile()`, in place, so the state-dict keys, and with them checkpoints and exports,
  are those of an eager run. One graph for the training step, one for evaluation (no gradients).
- Training at ZeRO-3: each block's forward (`compile_blocks`, torchtitan's per-block compile).
  ZeRO-3 gathers a module's partitioned parameters in hooks around its `__call__`; traced through
  them, dynamo sees the parameters while they are still partitioned (size 0) and fails, DeepSpeed's
  own `engine.compile()` included (its DeepCompile is CUDA-only). lmsys.engine.zero makes each block a
  ZeRO-3 leaf module (all its parameters gathered at once by the block's hooks) and the compiled
  forward runs inside them. The blocks share one code object: one graph serves them all.
- Generation: the model's forward with a StaticKVCache (lmsys.model.transformer), whose shapes never change
  while tokens are generated: one graph for the prompts (their width and the cache's length are
  marked dynamic, `vary`) and one for the decode step; none per token.
- lmsys-eval: the model's forward on windows padded to a full batch: one graph.
The Triton kernels are torch custom ops (registered beside each kernel in kernels/), so dynamo
traces through them.

`auto` compiles on CUDA and runs eager elsewhere (on a CPU inductor spends tens of seconds per
graph building C++ for little gain). Under `auto` a compile failure runs that code eager instead
(dynamo's suppress_errors) with one warning; under `true` it is one error line (`compile_errors`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lmsys.core.console import Console, one_line
from lmsys.core.errors import ConfigError, LmsysError

# `compile=` of lmsys-generate and lmsys-eval: trainer.compile's choices and meaning


def wants_compile(choice: str, device: torch.device) -> bool:
    """Whether `choice` (auto, true, false) compiles on `device`."""
    return device.type == "cuda" if choice == "auto" else choice == "true"


def _configure(strict: bool) -> None:
    import torch._dynamo  # late: only runs that compile pay for dynamo's configuration

    torch._dynamo.config.suppress_errors = not strict


def compile_module(module: nn.Module, strict: bool, dynamic: bool | None = None) -> None:
    """Compile `module`'s forward in place (inductor). strict=False (auto): a frame that fails to
    compile runs eager instead."""
    _configure(strict)
    module.compile(dynamic=dynamic)


def compile_blocks(blocks: Iterable[nn.Module], strict: bool) -> int:
    """Compile each block's forward (inductor), leaving its `__call__` and the hooks around it
    eager (ZeRO-3's parameter gathers). Returns the number of blocks."""
    _configure(strict)
    n = 0
    for block in blocks:
        block.forward = torch.compile(block.forward)
        n += 1
    return n


def vary(tensor: torch.Tensor, *dims: int) -> torch.Tensor:
    """Tell torch.compile that `tensor`'s sizes along `dims` change between calls, so that one
    graph serves every size instead of one graph per size (a no-op without compile)."""
    import torch._dynamo  # late: see _configure

    for dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return tensor


@dataclass(frozen=True)
class CompileStats:
    """Dynamo's counts: process-wide, or since an earlier reading (`compile_stats(since)`)."""

    graphs: int  # frames compiled into a graph (a recompilation adds one)
    graph_breaks: int
    seconds: float  # compiling, forward and backward graphs

    def __sub__(self, other: CompileStats) -> CompileStats:
        return CompileStats(
            self.graphs - other.graphs, self.graph_breaks - other.graph_breaks, self.seconds - other.seconds
        )


def compile_stats(since: CompileStats | None = None) -> CompileStats:
    """Dynamo's counts so far in this process, or since `since` (a sweep's jobs share a process)."""
    from torch._dynamo.utils import calculate_time_spent, counters  # late: see _configure

    times = calculate_time_spent()
    seconds = times.get("entire_frame_compile", 0.0) + times.get("entire_backward_compile", 0.0)
    now = CompileStats(
        graphs=int(counters["stats"]["unique_graphs"]),
        graph_breaks=int(sum(counters["graph_break"].values())),
        seconds=float(seconds),
    )
    return now if since is None else now - since


@contextlib.contextmanager
def compile_errors(setting: str, eager: str) -> Iterator[None]:
    """For `setting`=true: a torch.compile failure inside the block (dynamo's or inductor's) is one
    error line (ConfigError, exit 2: the configuration is unsupported) instead of its traceback;
    `eager` says how to run without compiling. Other errors pass unchanged."""
    from torch._dynamo.exc import TorchDynamoException  # late: see _configure

    try:
        yield
    except TorchDynamoException as exc:
        if isinstance(exc, LmsysError):
            raise
        raise ConfigError(
            f"{setting}=true: torch.compile failed on this model and device ({type(exc).__name__}: "
            f"{one_line(exc)}); {eager}"
        ) from exc


def describe_compile(stats: CompileStats, detail: str) -> str | None:
    """`torch.compile: 2 graph(s), 0 graph break(s), compiled in 3.1 s (<detail>)`, or None when
    nothing compiled (under auto, dynamo fell back to eager)."""
    if stats.graphs == 0:
        return None
    return (
        f"torch.compile: {stats.graphs} graph(s), {stats.graph_breaks} graph break(s), "
        f"compiled in {stats.seconds:.1f} s ({detail})"
    )


def _fell_back(outcome: str) -> str:
    return f"torch.compile failed on this model and device; {outcome}"


def say_compiled(console: Console, stats: CompileStats, what: str, first_s: float) -> None:
    """Once, after the first compiled step of a training run: what was compiled and how long it
    took, or (auto, after dynamo fell back) a warning that `what` runs eager."""
    line = describe_compile(stats, f"the first step took {first_s:.1f} s")
    if line is None:
        console.warn(_fell_back(f"{what} runs eager"))
    else:
        console.say(f"{console.prog}: {line}")


def compile_summary(stats: CompileStats, what: str) -> str:
    """The end-of-run line: every graph built, with what they were for."""
    return f"torch.compile: {stats.graphs} graph(s) in all ({what}), {stats.seconds:.1f} s compiling"


@contextlib.contextmanager
def compiled_for_cli(
    choice: str,
    device: torch.device,
    prog: str,
    work: str,
    warn: Callable[[str], None],
) -> Iterator[Callable[[nn.Module], bool]]:
    """`compile=<choice>` of a CLI that runs models for `work` (generation, evaluation). Yields
    `compile_model(model) -> bool`, which compiles a model in place when the choice says so
    (and says whether it did); under true a compile failure inside the block is one error line.
    Afterwards one line on stderr says what was compiled, or `warn` says that the work ran eager
    (auto, after a failure)."""
    enabled, strict = wants_compile(choice, device), choice == "true"

    def compile_model(model: nn.Module) -> bool:
        if enabled:
            compile_module(model, strict=strict)
        return enabled

    if not enabled:
        yield compile_model
        return
    start = compile_stats()
    with compile_errors("compile", "compile=false runs eager") if strict else contextlib.nullcontext():
        yield compile_model
    line = describe_compile(compile_stats(start), f"for {work}")
    if line is None:
        warn(_fell_back(f"{work} ran eager"))
    else:
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
