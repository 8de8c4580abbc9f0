"""The traced step: what one micro-batch of a config's real model allocates, read off its forward
and backward on fake tensors, so that no tensor of the model's size is ever allocated
(torchtitan's memory estimation runs its real step under FakeTensorMode the same way).

`Transformer(cfg.model)` is built on the meta device, its parameters and buffers made fake
tensors of the target's dtype, and one micro-batch runs the model's loss as lmsys.engine.zero
builds it (model.loss_impl, activation checkpointing; under sequence parallelism rank 0's
sharded loss, the all-to-all a local copy), then the backward. A dispatch mode counts each op's
new storages until they die (torch.distributed._tools.mem_tracker's bookkeeping) and records,
after every op, the step's own bytes alive, the gradient elements formed and the parameter
elements used so far. A GPU target's tensors are meta tensors that answer as CUDA ones (fake CUDA
tensors cannot run autograd in a CPU build of torch), so the Triton kernels' registered fake
implementations run; a CPU target's are FakeTensorMode's CPU fakes. What the step reads back from
a tensor (the loss's vocabulary check, the optimizer's step count) reads a healthy answer.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary, weakref

from lmsys.core.config import Config, tokens_per_sample
from lmsys.core.runtime import SequenceShard
from lmsys.engine.sequence_parallel import shard_sequences
from lmsys.engine.zero import apply_activation_checkpointing
from lmsys.model.transformer import Transformer

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to this many bytes
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StepTrace:
    """One micro-batch's forward and backward, traced; the three series have an entry per op."""

    param_numels: tuple[int, ...]  # each distinct parameter's elements
    buffer_bytes: int  # the model's buffers (position tables), whole on every rank
    flops_per_token: int  # the model's count: 6N + the attention's, PaLM appendix B
    recompute_flops_per_token: int  # the blocks' forward again, under activation checkpointing
    live: tuple[int, ...]  # bytes of the step's own tensors alive after each op
    formed: tuple[int, ...]  # gradient elements formed by then
    fetched: tuple[int, ...]  # parameter elements used by then
    backward_start: int  # the index of the backward's first op
    first_block_fetched: int  # parameter elements used by the end of the first block's forward

    @property
    def n_params(self) -> int:
        return sum(self.param_numels)


class _AnswersCuda(TorchFunctionMode):
    """Meta tensors answer as a GPU's: `is_cuda` to lmsys.model.ops (which then takes a GPU's path),
    and their device to the Triton kernels' input checks."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        getter_of = getattr(func, "__self__", None)  # a property's getter: the property
        if getter_of is torch.Tensor.is_cuda:
            return True
        if getter_of is torch.Tensor.device and _in_kernel_check(sys._getframe(1)):
            return torch.device("cuda", 0)
        return func(*args, **(kwargs or {}))


def _in_kernel_check(frame: Any) -> bool:
    """Whether `frame` is a Triton kernel's input check (kernels.*'s _check functions)."""
    module = frame.f_globals.get("__name__", "")
    return module.startswith("kernels.") and frame.f_code.co_name.startswith("_check")


def _answering_cuda(forward: Callable[..., Any]) -> Callable[..., Any]:
    def answering(*args: Any, **kwargs: Any) -> Any:
        with _AnswersCuda():
            return forward(*args, **kwargs)

    return answering


class _StepCounter(TorchDispatchMode):
    """The three series of StepTrace, op by op."""

    def __init__(self, params: list[nn.Parameter], block: int) -> None:
        super().__init__()
        self.block = block
        self.bytes: Any = WeakIdKeyDictionary()  # storage -> its bytes, while it lives
        self.unused = {p.untyped_storage()._cdata: p.numel() for p in params}
        self.parameters = set(self.unused)  # their views are no new memory
        self.live = self.formed = self.fetched = 0
        self.points: list[tuple[int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._local_scalar_dense.default:  # a check reads back: it passes
            return False if args[0].dtype == torch.bool else 1
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and self.unused:
                self.fetched += self.unused.pop(t.untyped_storage()._cdata, 0)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage() not in self.bytes:
                if t.untyped_storage()._cdata not in self.parameters:
                    self._count(t.untyped_storage())
        self.mark()
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        size = -(-storage.nbytes() // self.block) * self.block
        self.bytes[storage] = size
        self.live += size
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size

    def mark(self) -> None:
        self.points.append((self.live, self.formed, self.fetched))

    def gradient_formed(self, param: nn.Parameter) -> None:
        """A parameter's gradient is complete: counted, then let go (ZeRO decides where it goes)."""
        self.formed += param.numel()
        param.grad = None
        self.mark()


def fake_model(cfg: Config, fake: FakeTensorMode | None, device: str, dtype: torch.dtype) -> Transformer:
    """cfg's Transformer with parameters and buffers of `dtype` on `device` that hold no memory:
    `fake`'s tensors, or meta tensors (tied ones tied)."""
    with torch.device("meta"), _NoInit():
        model = Transformer(cfg.model)
    made: dict[int, torch.Tensor] = {}

    def faked(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            with fake or contextlib.nullcontext():
                empty = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
            made[id(t)] = (
                nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
            )
        return made[id(t)]

    for module in model.modules():
        for kind in (module._parameters, module._buffers):
            for name, t in kind.items():
                if t is not None:
                    kind[name] = faked(t)
    return model


def trace_step(cfg: Config, cuda: bool, precision: str, micro_batch: int) -> StepTrace:
    """The traced forward and backward of one micro-batch of `micro_batch` sequences of cfg's
    model, on a GPU target (`cuda`) or a CPU, in `precision` (module docstring). Cached: the
    suggestions plan a handful of variants of one config."""
    key = (repr(cfg.model), repr(cfg.data), cfg.deepspeed.activation_checkpointing,
           cfg.trainer.sequence_parallel, cuda, precision, micro_batch)  # fmt: skip
    if key not in _TRACES:
        _TRACES[key] = _trace(cfg, cuda, precision, micro_batch)
    return _TRACES[key]


_TRACES: dict[tuple[Any, ...], StepTrace] = {}


def _trace(cfg: Config, cuda: bool, precision: str, micro_batch: int) -> StepTrace:
    fake = None if cuda else FakeTensorMode()
    model = fake_model(cfg, fake, "meta" if cuda else "cpu", DTYPES[precision])
    if fake is None:  # the blocks' recomputation in the backward runs outside the trace's modes
        for block in model.blocks:
            block.forward = _answering_cuda(block.forward)
    if cfg.deepspeed.activation_checkpointing:
        apply_activation_checkpointing(model)
    compute: Callable[..., torch.Tensor] = model.loss  # a rank's loss, as lmsys.engine.zero builds it
    if cfg.trainer.sequence_parallel > 1:  # rank 0 of a group; the exchange a local stand-in
        shard = SequenceShard(0, cfg.trainer.sequence_parallel)
        compute = shard_sequences(model, cfg.model, shard, unit=None)
    params = list(model.parameters())
    counter = _StepCounter(params, CUDA_BLOCK if cuda else 1)
    for p in params:
        p.register_post_accumulate_grad_hook(counter.gradient_formed)
    first_block: list[int] = []
    if len(model.blocks):
        model.blocks[0].register_forward_hook(lambda *_: first_block.append(counter.fetched))
    shape = (micro_batch, tokens_per_sample(cfg.model, cfg.data.seq_len))
    device = "meta" if cuda else "cpu"
    traced = (counter, _AnswersCuda()) if fake is None else (fake, counter)
    with contextlib.ExitStack() as stack:
        for mode in traced:
            stack.enter_context(mode)
        tokens = torch.zeros(shape, dtype=torch.long, device=device)  # (B, S), as the loader's
        # packed rows carry their documents (B, S) to every block, as the loader's batches do
        documents = torch.zeros(shape, dtype=torch.long, device=device) if cfg.data.document_masking else None
        loss = compute(tokens, torch.ones(shape, dtype=torch.float32, device=device), documents)
        counter.mark()  # what the forward leaves for the backward
        backward_start = len(counter.points)
        loss.backward()
        counter.mark()
    flops = model.flops_per_token(cfg.data.seq_len)
    # the forward is a third of the FLOPs; the loss head's matmul is not recomputed
    recomputed = (
        (flops - 6 * model.unembed.weight.numel()) // 3 if cfg.deepspeed.activation_checkpointing else 0
    )
    return StepTrace(
        tuple(p.numel() for p in params),
        sum(b.untyped_storage().nbytes() for b in model.buffers()),
        flops,
        recomputed,
        *zip(*counter.points, strict=True),  # live, formed, fetched
        backward_start,
        first_block[0] if first_block else counter.fetched,
    )


class _NoInit(TorchFunctionMode):
    """Skips the in-place random initialisations of a model built on the meta device: there they
    run torch's Python references, whose first call imports torch._dynamo (about 2 s of CPU at
    every launch) to fill tensors that have no data."""

    SKIPPED = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_,
                         nn.init.trunc_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
                         nn.init.xavier_uniform_, nn.init.xavier_normal_})  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in self.SKIPPED:  # the tensor, unchanged (nn.init passes it by keyword)
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))
