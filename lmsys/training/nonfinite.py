"""Where a non-finite value, or a diverging loss, comes from: a step replayed with hooks.

When a step goes wrong (lmsys.training.health decides that from the step's global loss and
gradient norm), every rank replays its own micro-batches of that step on a plain copy of the
model (`replica`: the engine's current weights, gathered at ZeRO-3, in the engine's dtype; a bad
step's update is never applied, so they are the weights the step ran with). The replay is
deterministic: the batches are the step's own, and the model has no dropout. A hook on every
module watches each micro-batch, in order:

- forward: the first module to finish with a NaN/inf in its output while its inputs are finite
  is where the value appeared. Hooks fire as a module finishes, innermost first, and a module
  whose inputs were already non-finite only passes the value on, so the origin is named even
  when it sits in a parent's own code (then the parent is named). A non-finite weight among the
  module's own or its submodules' names the weight's owner, with the weight.
- backward: the first module whose gradient with respect to its inputs is non-finite while the
  gradient reaching its output is finite; failing that, the first module with a non-finite weight
  gradient.

`replay` also leaves every rank's share of the step's gradient in the copy (each micro-batch's
loss weighted by its share of the step's loss weights, as the trainer does): summed over the
ranks (`module_grad_norms`) it is the step's gradient, whose largest modules a divergence report
names.

A replay needs memory the training step did not: the whole copy, its gradients, and one
micro-batch's activations without checkpointing. When an allocation is refused, the rank's replay
stops with `ReplayDidNotFit` and the report says so; the run goes on under its policy
(lmsys.training.health). Where a collective follows (the ZeRO-3 gather, the gradient norms of a
divergence), every rank first learns which ranks ran short (`ranks_where`), so none waits alone.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmsys.core.config import ModelConfig
from lmsys.core.errors import TrainingError
from lmsys.data.loader import Batch
from lmsys.model.transformer import Transformer

COMPILED_PREFIX = "_orig_mod."  # torch.compile's wrapper in parameter names


class ReplayDidNotFit(TrainingError):
    """A bad step's replay ran out of memory: on this rank (the allocator's message), or, at
    ZeRO-3, on another rank before the gather that every rank joins (`elsewhere`)."""

    def __init__(self, message: str, elsewhere: bool = False) -> None:
        super().__init__(message)
        self.elsewhere = elsewhere


def out_of_memory(exc: BaseException) -> bool:
    """A refused allocation: torch.OutOfMemoryError (CUDA's) or the CPU allocator's RuntimeError."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def ranks_where(flag: bool, device: torch.device) -> list[int]:
    """The ranks whose `flag` is true (a collective every rank joins; [] or [0] on one process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [0] if flag else []
    flags = torch.zeros(dist.get_world_size(), device=device)  # (world,)
    flags[dist.get_rank()] = float(flag)
    dist.all_reduce(flags)
    return [rank for rank, value in enumerate(flags.tolist()) if value]


@dataclass(frozen=True)
class Finding:
    """Where a non-finite value first appeared on one rank."""

    rank: int
    micro_batch: int
    module: str  # dotted path in the Transformer, e.g. blocks.1.attn ("" when outside every module)
    pass_: str  # forward | backward
    tensor: str  # output | weight <name> | input gradient | weight gradient <name> | loss

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "micro_batch": self.micro_batch,
            "module": self.module,
            "pass": self.pass_,
            "tensor": self.tensor,
        }


def _finite(value: Any) -> bool:
    """Whether every floating-point tensor in `value` (a tensor, or a tuple/list of them) is finite."""
    if torch.is_tensor(value):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, (tuple, list)):
        return all(_finite(v) for v in value)
    return True


class _Watch:
    """Forward and full backward hooks on every module of a Transformer; `found` is the first
    (module, pass, tensor) where a non-finite value appeared (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.found: tuple[str, str, str] | None = None
        self.handles = []
        for name, module in model.named_modules():
            if not name:
                continue  # the Transformer itself: its loss() is not its forward
            self.handles.append(module.register_forward_hook(partial(self._forward, name)))
            self.handles.append(module.register_full_backward_hook(partial(self._backward, name)))

    def _forward(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        if self.found is not None or _finite(output):
            return
        if not _finite(args):
            return  # it only carries on a value that appeared before it
        # A non-finite weight of a submodule the module calls other than through its forward
        # (e.g. Norm.add_norm), or its own: named by the weight's owner.
        bad = next((n for n, p in module.named_parameters() if not _finite(p)), None)
        if bad is None:
            self.found = (name, "forward", "output")
        else:
            full = f"{name}.{bad}"
            self.found = (full.rsplit(".", 1)[0], "forward", f"weight {full}")

    def _backward(self, name: str, _module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        if self.found is None and not _finite(grad_input) and _finite(grad_output):
            self.found = (name, "backward", "input gradient")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def replica(
    engine: Any, model_cfg: ModelConfig, stage: int, allocated: Callable[[torch.device], None] | None = None
) -> Transformer:
    """A plain Transformer holding the engine's current weights (the whole of them at ZeRO-3,
    gathered for the copy: a collective every rank joins), on the engine's device and dtype.
    Raises ReplayDidNotFit when the copy cannot be allocated: at ZeRO-3 on every rank alike, the
    gather skipped. allocated: fault injection, called once the copy is allocated."""
    source = engine.module.model
    named = {n.replace(COMPILED_PREFIX, ""): p for n, p in source.named_parameters()}
    buffers = {n.replace(COMPILED_PREFIX, ""): b for n, b in source.named_buffers()}
    first = next(iter(named.values()))
    copy, refused = None, None
    try:
        copy = Transformer(model_cfg).to(device=first.device, dtype=first.dtype)
        if allocated is not None:
            allocated(first.device)
    except RuntimeError as exc:
        if not out_of_memory(exc):
            raise
        copy, refused = None, first_line(exc)
    gather: Any = contextlib.nullcontext()
    if stage == 3:
        short = ranks_where(refused is not None, first.device)
        if short and refused is None:
            ranks = ", ".join(map(str, short))
            raise ReplayDidNotFit(f"skipped: rank(s) {ranks} could not allocate the copy", elsewhere=True)
        import deepspeed  # late: DeepSpeed's import costs seconds (lmsys.engine.zero)

        gather = deepspeed.zero.GatheredParameters(list(named.values()), modifier_rank=None)
    if copy is None:
        raise ReplayDidNotFit(f"the copy of the model: {refused}")
    with torch.no_grad(), gather:
        for name, p in copy.named_parameters():
            p.copy_(named[name].detach())
        for name, b in copy.named_buffers():
            if name in buffers:
                b.copy_(buffers[name].detach())
    copy.train()
    return copy


def first_line(exc: BaseException) -> str:
    """An error's first line (CUDA's out-of-memory message runs to several)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _weight_gradient(model: nn.Module) -> tuple[str, str] | None:
    """(module, parameter name) of the first parameter whose gradient is non-finite."""
    for name, p in model.named_parameters():
        if p.grad is not None and not _finite(p.grad):
            owner = name.rsplit(".", 1)[0] if "." in name else ""
            return owner, name
    return None


def replay(
    model: Transformer, batches: list[Batch], scales: list[float], device: torch.device, rank: int
) -> Finding | None:
    """Forward and backward each micro-batch of this rank's share of a step on `model`, in order,
    until a non-finite value appears; where it first did, or None. The gradients accumulate in
    `model` (micro-batch i's loss weighted by scales[i])."""
    watch = _Watch(model)
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # the token embedding's input (ids) takes no gradient: its backward hook fires on its output
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return _replay(model, watch, batches, scales, device, rank)


def _replay(
    model: Transformer,
    watch: _Watch,
    batches: list[Batch],
    scales: list[float],
    device: torch.device,
    rank: int,
) -> Finding | None:
    try:
        for i, batch in enumerate(batches):
            on_device = batch.to(device)
            loss = model.loss(on_device.tokens, on_device.weights, on_device.documents)  # 0-dim
            if watch.found is None and not _finite(loss):
                watch.found = ("", "forward", "loss")
            if watch.found is not None:
                return Finding(rank, i, *watch.found)
            (loss * scales[i]).backward()
            if watch.found is None and (bad := _weight_gradient(model)) is not None:
                watch.found = (bad[0], "backward", f"weight gradient {bad[1]}")
            if watch.found is not None:
                return Finding(rank, i, *watch.found)
        return None
    finally:
        watch.remove()


def module_grad_norms(model: nn.Module, top: int = 5) -> tuple[float, list[dict[str, Any]]]:
    """The step's gradient norm and the `top` modules with the largest gradient norm in it: each
    rank's share of the gradient (left by `replay`) summed over the ranks. A collective every rank
    joins."""
    squares: dict[str, float] = {}
    for name, p in model.named_parameters():
        grad = p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(grad)
        owner = name.rsplit(".", 1)[0] if "." in name else name
        squares[owner] = squares.get(owner, 0.0) + float(grad.double().pow(2).sum().item())
    ranked = sorted(squares.items(), key=lambda item: -item[1] if math.isfinite(item[1]) else -math.inf)
    total = math.sqrt(sum(squares.values()))
    return total, [{"module": name, "grad_norm": math.sqrt(sq)} for name, sq in ranked[:top]]
