"""DeepSpeed: the only module of lmsys that knows about ZeRO.

Parallelism is applied to the single-device `Transformer` from outside, in this fixed order
(the batch arithmetic before it is lmsys.core.runtime.split_batch):

1. `apply_activation_checkpointing`: each block's forward is wrapped in
   `torch.utils.checkpoint` (recomputed in the backward) when deepspeed.activation_checkpointing.
2. `LossModule`: the engine's forward is the model's loss, so DeepSpeed sees one module whose
   output is the scalar to differentiate; under sequence parallelism (trainer.sequence_parallel)
   lmsys.engine.sequence_parallel's, this rank's part of it, each layer's attention wrapped in
   DeepSpeed's DistributedAttention, and DeepSpeed's sequence-parallel groups go to its `mpu`.
3. `apply_compile` (trainer.compile): torch.compile of the loss module (ZeRO 0-2) or of each
   block (ZeRO-3, blocks made ZeRO-3 leaf modules), before DeepSpeed registers its hooks.
4. `build_optimizer`: AdamW, weight decay only on matrices (>= 2-D weights, embeddings
   included); torch's AdamW on CPU, DeepSpeed's fused Adam on CUDA (its CPU Adam when the
   optimizer state is offloaded). optim=muon: DeepSpeed's MuonWithAuxAdam (lmsys.engine.muon).
5. `deepspeed_config` + `deepspeed.initialize`: the DeepSpeed JSON generated from the config
   groups (ZeRO stage and offload, precision, micro-batch, accumulation, clipping).

During training `optimizer_step` is the accumulation boundary: it applies the update or, for a
non-finite loss, skips it, whatever the ZeRO stage. The learning rate follows `lr_at(step)`
(linear warmup, cosine or warmup-stable-decay to lr * min_lr_ratio); the train loop writes it into the
optimizer's param groups before each step, so the schedule is a pure function of the step and a
resumed run follows it exactly without scheduler state.

Afterwards `consolidated_state_dict` reads a DeepSpeed checkpoint of any stage and world size
back into whole fp32 weights, never unpickling code.

`deepspeed` is imported inside the functions that use it, deliberately: it imports triton (through
torch._dynamo), which must wait until lmsys.model.ops.prepare_kernels has chosen how Triton runs, and it
costs seconds that the export tools and the CPU paths do not need to pay.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import pickle
import re
import socket
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from lmsys.core.config import Config, OptimConfig, compile_choice
from lmsys.core.errors import CheckpointError
from lmsys.core.runtime import BatchSplit
from lmsys.engine.muon import build_muon, import_muon_lazily
from lmsys.engine.quiet import quiet_overflow, skip_cpu_collectives_op, without_build_lines
from lmsys.engine.sequence_parallel import averaged_ranks, sequence_parallel_groups, shard_sequences
from lmsys.engine.zero_to_fp32 import safe_torch_load, weights_only
from lmsys.model.compiling import compile_blocks, compile_module, wants_compile

# ----------------------------------------------------------------------------- the process group


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quiet_deepspeed() -> None:
    """DeepSpeed logs its whole configuration and every bucket size at INFO; keep warnings only."""
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
        quiet_overflow(logging.getLogger(name))  # lmsys reports a skipped step itself
    try:
        from deepspeed.utils import logger as ds_logger  # deepspeed late: see the module docstring

        ds_logger.setLevel(logging.WARNING)
        quiet_overflow(ds_logger)
    except Exception:  # pragma: no cover - older layouts
        pass


def init_distributed(device: torch.device, timeout_s: float) -> None:
    """Join (or create, for a plain one-process run) the process group, with a collective timeout
    so that a rank that dies or hangs brings the job down instead of blocking the others forever."""
    if device.type == "cpu":  # tell DeepSpeed rather than let it warn that it found no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed calls torch.distributed's older collective names; their deprecation notices
    # would print on every rank at every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    import deepspeed  # late: see the module docstring

    if dist.is_initialized():  # a Hydra multirun calls the task several times in one process
        return
    if "MASTER_ADDR" not in os.environ:  # plain `python -m lmsys.train`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    quiet_deepspeed()
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's static rendezvous (the default with --master_addr/--master_port) keeps ONE
        # store for every restart of the job, and env:// adds no per-attempt prefix: after a
        # --max_restarts restart the new ranks would read the dead ranks' addresses and fail to
        # connect. Key everything by the attempt; the agent hosts the store, we are its clients.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            int(os.environ["WORLD_SIZE"]),
            is_master=False,
            timeout=timeout,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"lmsys/attempt_{attempt}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    if device.type == "cpu":
        skip_cpu_collectives_op()
    with without_build_lines():  # DeepSpeed prints each op it loads on every rank
        deepspeed.init_distributed(
            dist_backend=backend, auto_mpi_discovery=False, verbose=False, timeout=timeout
        )


def close_distributed() -> None:
    """Leave the process group at the end of a process's training (done or failed): every
    backend is shut down here, before the interpreter's shutdown, where tearing a group down once
    aborted a failed run ("terminate called without an active exception") after its error line.
    gloo's threads outlive this call (the DeepSpeed engine, kept by torch's hook registries, holds
    the groups): they idle through the interpreter's shutdown (tests/torchrun_exit.py)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- model wrapping


class LossModule(nn.Module):
    """What the engine runs: (tokens (B, S), weights (B, S), documents (B, S) or None) -> the
    model's scalar loss (documents: the packed rows' document ids, data.document_masking).

    The model stays the single-device Transformer; its parameters live under `model.` here.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        tokens: torch.Tensor,
        weights: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model.loss(tokens, weights, documents)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute every block's activations in the backward instead of storing them: each block's
    forward runs under torch.utils.checkpoint (non-reentrant, which also re-runs ZeRO-3's
    parameter-gathering hooks). Applied from outside: the state-dict keys do not change."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError("activation checkpointing needs a model with a `blocks` ModuleList")
    for block in blocks:
        inner = block.forward

        def forward(x, cache=None, layer=0, key_mask=None, rope=None, documents=None, _inner=inner):
            if cache is not None or not torch.is_grad_enabled():  # generation / eval: nothing to save
                return _inner(x, cache, layer, key_mask, rope, documents)
            return checkpoint(_inner, x, None, layer, key_mask, rope, documents, use_reentrant=False)

        block.forward = forward
    return len(blocks)


def apply_compile(model: nn.Module, module: nn.Module, stage: int, strict: bool) -> None:
    """torch.compile what the engine will run (lmsys.model.compiling says why each way): at ZeRO 0-2 the
    whole loss module, in place; at ZeRO-3 each block's forward, every block a ZeRO-3 leaf module
    so that its own hooks gather all its parameters before the compiled forward runs (and no hook
    of its submodules fires inside it)."""
    if stage < 3:
        compile_module(module, strict=strict)
        return
    from deepspeed.utils import set_z3_leaf_module  # late: see the module docstring

    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError("compiling at ZeRO-3 needs a model with a `blocks` ModuleList")
    for block in blocks:
        set_z3_leaf_module(block, True)
    compile_blocks(blocks, strict=strict)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (>= 2-D: linear weights, embeddings, position tables), none on
    biases and norm gains. A tied matrix appears once (named_parameters de-duplicates)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            dims = len(p.ds_shape) if hasattr(p, "ds_shape") else p.dim()  # ZeRO-3: the unpartitioned shape
            (decay if dims >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup over optim.warmup_steps,
    then down to optim.lr * optim.min_lr_ratio at optim.decay_steps (when set, else max_steps),
    constant after it. optim.schedule=cosine: a cosine from the warmup's end; wsd
    (warmup-stable-decay): optim.lr until the last optim.decay_frac of the horizon, then linear."""
    if optim.warmup_steps > 0 and step <= optim.warmup_steps:
        return optim.lr * step / optim.warmup_steps
    horizon = optim.decay_steps or max_steps
    min_lr = optim.lr * optim.min_lr_ratio
    if optim.schedule == "wsd":
        decay_start = max(optim.warmup_steps, horizon - round(optim.decay_frac * horizon))
        progress = min(1.0, max(0.0, (step - decay_start) / max(1, horizon - decay_start)))
        return optim.lr - (optim.lr - min_lr) * progress
    decay_steps = max(1, horizon - optim.warmup_steps)
    progress = min(1.0, max(0.0, (step - optim.warmup_steps) / decay_steps))
    return min_lr + 0.5 * (optim.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def _adam_kwargs(optim: OptimConfig) -> dict[str, Any]:
    return {"lr": optim.lr, "betas": (optim.beta1, optim.beta2), "eps": optim.eps}


def build_optimizer(
    model: nn.Module, cfg: Config, device: torch.device, compiled: bool = False
) -> tuple[torch.optim.Optimizer | None, dict[str, Any] | None, list[dict[str, Any]], str]:
    """(client optimizer, DeepSpeed "optimizer" JSON section, param groups, description).

    optim=muon: DeepSpeed's MuonWithAuxAdam, built by lmsys.engine.muon (why there). CPU:
    torch.optim.AdamW as a client optimizer. CUDA: DeepSpeed builds its fused Adam (or, with the
    optimizer state offloaded, its CPU Adam) from the JSON section, in AdamW mode.
    """
    if cfg.optim.name == "muon":
        optimizer, muon_groups = build_muon(model, cfg.optim, compiled)
        return optimizer, None, muon_groups, "DeepSpeed Muon + AdamW"
    groups = param_groups(model, cfg.optim.weight_decay)
    if device.type == "cuda":
        section = {
            "type": "AdamW",
            "params": {
                "lr": cfg.optim.lr,
                "betas": [cfg.optim.beta1, cfg.optim.beta2],
                "eps": cfg.optim.eps,
                "weight_decay": cfg.optim.weight_decay,
            },
        }
        kind = "DeepSpeed CPU Adam (offloaded)" if cfg.deepspeed.offload_optimizer else "DeepSpeed fused Adam"
        return None, section, groups, kind
    return torch.optim.AdamW(groups, **_adam_kwargs(cfg.optim), foreach=False), None, groups, "torch AdamW"


# ----------------------------------------------------------------------------- DeepSpeed JSON


def contiguous_gradients(cfg: Config, sequence_parallel: int, cuda: bool) -> bool:
    """Whether DeepSpeed gathers the gradients into preallocated buckets: on a GPU when
    deepspeed.contiguous_gradients asks, except for ZeRO-3 Muon under sequence parallelism, whose
    every bucket must pass the reduce-scatter's averaging (sequence_parallel.averaged_ranks)."""
    muon_sharded = cfg.deepspeed.stage == 3 and cfg.optim.name == "muon" and sequence_parallel > 1
    return cfg.deepspeed.contiguous_gradients and cuda and not muon_sharded


def deepspeed_config(
    cfg: Config,
    batch: BatchSplit,
    device: torch.device,
    precision: str,
    optimizer_section: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed JSON, generated from the deepspeed/optim/trainer groups."""
    ds = cfg.deepspeed
    cuda = device.type == "cuda"
    zero: dict[str, Any] = {
        "stage": ds.stage,
        # Both exist for GPUs (overlap the gradient reduction with the backward on a side stream;
        # avoid fragmenting GPU memory). A CPU has no streams and no fragmentation to avoid: they
        # only add gradient copies (~10% of a tiny model's ZeRO-2 step; tools.bench train).
        "overlap_comm": ds.overlap_comm and cuda,
        "contiguous_gradients": contiguous_gradients(cfg, batch.sequence_parallel, cuda),
        "reduce_bucket_size": ds.reduce_bucket_size,
        "allgather_bucket_size": ds.allgather_bucket_size,
    }
    pin = cuda
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if ds.stage == 3:
        zero["stage3_param_persistence_threshold"] = ds.param_persistence_threshold
        if cfg.optim.name == "muon":  # DeepSpeed's ZeRO-3 Muon all-reduces whole gradients
            zero["reduce_scatter"] = False
        zero["stage3_prefetch_bucket_size"] = ds.allgather_bucket_size
    config: dict[str, Any] = {
        "train_batch_size": batch.global_batch_sequences,
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,  # torch AdamW on CPU
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # lmsys logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
        "checkpoint": {"tag_validation": "FAIL"},
    }
    if optimizer_section is not None:
        config["optimizer"] = optimizer_section
    return config


# ----------------------------------------------------------------------------- the engine


@dataclass
class EngineInfo:
    """What the banner, metrics and tests need to know about the engine."""

    stage: int
    precision: str
    device: str
    world_size: int
    optimizer: str
    activation_checkpointing: bool
    offload_optimizer: bool
    offload_param: bool
    compiled: bool = False  # torch.compile (trainer.compile)
    compile_strict: bool = False  # trainer.compile=true: a compile failure is an error
    sequence_parallel: int = 1  # ranks per Ulysses group (trainer.sequence_parallel)
    averaged_ranks: int = 1  # the ranks DeepSpeed averages the micro-batch gradients over

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def initialize(
    model: nn.Module, cfg: Config, batch: BatchSplit, device: torch.device, precision: str
) -> tuple[Any, EngineInfo, dict[str, Any]]:
    """Wrap the model into a DeepSpeed engine. Returns (engine, info, the DeepSpeed JSON).

    `model` is the plain Transformer, built identically (same seed) on every rank; DeepSpeed
    broadcasts rank 0's weights and, at ZeRO-3, partitions them. `precision` is resolved
    (lmsys.core.runtime.resolve_precision).
    """
    import deepspeed  # late: see the module docstring

    quiet_deepspeed()
    import_muon_lazily()
    unit = sequence_parallel_groups(batch.sequence_parallel)  # None without sequence parallelism
    if cfg.deepspeed.activation_checkpointing:
        apply_activation_checkpointing(model)
    if unit is None:
        module: nn.Module = LossModule(model)
    else:
        module = shard_sequences(model, cfg.model, batch.shard(dist.get_rank()), unit)
    choice = compile_choice(cfg.trainer.compile)  # validated by lmsys.core.config
    compiled = wants_compile(choice, device)
    if compiled:  # before DeepSpeed wraps it (and registers its ZeRO-3 hooks)
        apply_compile(model, module, cfg.deepspeed.stage, strict=choice == "true")
    client_opt, opt_section, groups, opt_kind = build_optimizer(model, cfg, device, compiled)
    ds_config = deepspeed_config(cfg, batch, device, precision, opt_section)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        optimizer=client_opt,
        model_parameters=groups,
        config=ds_config,
        mpu=unit,
        dist_init_required=False,
    )
    info = EngineInfo(
        stage=cfg.deepspeed.stage,
        precision=precision,
        device=str(device),
        world_size=batch.world_size,
        optimizer=opt_kind,
        activation_checkpointing=cfg.deepspeed.activation_checkpointing,
        offload_optimizer=cfg.deepspeed.offload_optimizer,
        offload_param=cfg.deepspeed.offload_param,
        compiled=compiled,
        compile_strict=choice == "true",
        sequence_parallel=batch.sequence_parallel,
        averaged_ranks=averaged_ranks(cfg.deepspeed.stage, batch),
    )
    return engine, info, ds_config


@contextlib.contextmanager
def skipped_update(engine: Any):
    """Run one `engine.step()` that applies no update: gradients zeroed, the optimizer's step a
    no-op (Adam moments, step counts and weights untouched), DeepSpeed's own bookkeeping (step
    counters, zero_grad) as usual. For ZeRO stage 0; ZeRO >= 1 discards a step with non-finite
    gradients by itself."""
    for p in engine.module.parameters():
        if p.grad is not None:
            p.grad.zero_()
    optimizer = engine.optimizer
    optimizer.step = lambda *args, **kwargs: None  # shadows the method for this one call
    try:
        yield
    finally:
        del optimizer.step


def grad_norm(engine: Any) -> float | None:
    """The global gradient norm of the last step (before clipping)."""
    norm = engine.get_global_grad_norm()
    if torch.is_tensor(norm):
        norm = norm.item()
    return None if norm is None else float(norm)


def replicated_grad_norm(module: nn.Module) -> float:
    """ZeRO stage 0: every rank holds the whole averaged gradient after the boundary backward.
    One fused norm and one device sync (DeepSpeed's own stage-0 clipping discards its norm)."""
    grads = [p.grad.detach() for p in module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0).item())


@dataclass(frozen=True)
class StepOutcome:
    applied: bool  # the weights were updated
    grad_norm: float | None  # global gradient norm before clipping; None when not applied


def optimizer_step(engine: Any, loss_is_finite: bool) -> StepOutcome:
    """The accumulation boundary's `engine.step()`: apply the update, or skip it when the step's
    loss is not finite. ZeRO >= 1 discards a step with non-finite gradients by itself and reports
    the norm it clipped with; stage 0 has to be told to skip, and its norm is taken here
    (DeepSpeed's stage-0 clipping discards its own)."""
    if engine.zero_optimization_stage() == 0:
        norm = replicated_grad_norm(engine.module) if loss_is_finite else math.nan
        if not math.isfinite(norm):  # nor a non-finite gradient (DeepSpeed would apply it)
            with skipped_update(engine):
                engine.step()
            return StepOutcome(applied=False, grad_norm=None)
        engine.step()
    else:
        engine.step()
        norm = grad_norm(engine)
    applied = engine.was_step_applied() and loss_is_finite
    return StepOutcome(applied=applied, grad_norm=norm if applied else None)


def set_lr(engine: Any, lr: float) -> None:
    """The schedule's lr into every param group, times the group's `lr_scale` (Muon's groups)."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def innermost_optimizer(opt: Any) -> Any:
    seen = 0
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer") and seen < 8:
        opt = opt.optimizer
        seen += 1
    return opt


@contextlib.contextmanager
def persistent_params_kept(engine: Any) -> Iterator[None]:
    """For the duration of a ZeRO-3 `save_checkpoint`: the persistent parameters (those below
    DeepSpeed's persistence threshold, which every rank holds whole) are put back from the tensors
    they held before the save instead of all-gathered again. DeepSpeed's save partitions every
    parameter first (so that the module state dict holds partitions only) and all-gathers the
    persistent ones afterwards, one collective per parameter: about 0.15 s for this bench's 163 on
    two CPU ranks over gloo, all of it loop stall. A save does not change a weight, so the tensors
    kept are what the all-gather would rebuild. Anything else (no ZeRO-3, NVMe-offloaded
    partitions, a DeepSpeed without these hooks) saves as DeepSpeed does."""
    opt = engine.optimizer
    persistent = list(getattr(opt, "persistent_parameters", None) or [])
    hooks = ("checkpoint_event_epilogue", "invalidate_secondary_tensor")
    if not persistent or not all(hasattr(opt, name) for name in hooks):
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # late: see the module docstring

    if any(getattr(p.ds_tensor, "final_location", None) == "nvme" for p in persistent):
        yield  # the epilogue's gather also reads NVMe partitions back
        return
    kept = [(p, p.data) for p in persistent if p.ds_status == ZeroParamStatus.AVAILABLE]

    def epilogue() -> None:
        opt.invalidate_secondary_tensor()  # as DeepSpeed's own epilogue, then its gather, from memory
        for p, data in kept:
            if p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                p.data, p.ds_status = data, ZeroParamStatus.AVAILABLE
        missing = [p for p in persistent if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if missing:  # not whole before the save: gathered as DeepSpeed would
            missing[0].all_gather(missing)

    opt.checkpoint_event_epilogue = epilogue  # this instance only, for this save
    try:
        yield
    finally:
        del opt.checkpoint_event_epilogue


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def shard_stats(engine: Any) -> dict[str, int]:
    """What this rank holds: optimizer state (Adam moments, partitioned at ZeRO >= 1), the
    optimizer's fp32 master parameters, and the module's parameters (partitioned at ZeRO-3).
    Call after the first optimizer step (Adam creates its state lazily)."""
    opt = innermost_optimizer(engine.optimizer)
    state_bytes = 0
    master_bytes = 0
    if isinstance(opt, torch.optim.Optimizer):
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    state_bytes += _tensor_bytes(value)
        for group in opt.param_groups:
            for p in group["params"]:
                master_bytes += _tensor_bytes(p)
    param_bytes = 0
    full_param_bytes = 0
    for p in engine.module.parameters():
        ds_tensor = getattr(p, "ds_tensor", None)
        if ds_tensor is not None:  # ZeRO-3: this rank's partition
            param_bytes += _tensor_bytes(ds_tensor)
            full_param_bytes += int(p.ds_numel) * ds_tensor.element_size()
        else:
            param_bytes += _tensor_bytes(p)
            full_param_bytes += _tensor_bytes(p)
    return {
        "optimizer_state_bytes": state_bytes,
        "optimizer_param_bytes": master_bytes,
        "param_bytes": param_bytes,
        "full_param_bytes": full_param_bytes,
    }


# ----------------------------------------------------------------------------- reading checkpoints back


@contextlib.contextmanager
def _quiet_and_safe(zero_to_fp32: Any) -> Iterator[io.StringIO]:
    """zero_to_fp32 prints progress to stdout and tqdm bars to stderr: capture both, and make
    its torch.load weights-only for the duration."""
    captured = io.StringIO()
    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)
    try:
        with (
            weights_only(zero_to_fp32),
            contextlib.redirect_stdout(captured),
            contextlib.redirect_stderr(captured),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            yield captured
    finally:
        ds_logger.setLevel(level)


def consolidated_state_dict(tag_dir: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """The full-precision weights of a DeepSpeed checkpoint tag saved at `zero_stage`, as
    DeepSpeed consolidates them, keyed like the engine's module (prefixed with `model.`).

    ZeRO 1-3: `get_fp32_state_dict_from_zero_checkpoint` (the fp32 master weights, merged from
    every rank's partition). Stage 0 has no partitions: the module state in
    mp_rank_00_model_states.pt is the whole model. (A bf16 run writes `bf16_zero_pp_rank_*`
    optimizer files at every stage, so the stage comes from the checkpoint's record, not its
    file names.)"""
    if not torch.cuda.is_available():  # without a GPU DeepSpeed would warn that it fell back to CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        if zero_stage >= 1:
            from deepspeed.utils import zero_to_fp32  # late: see the module docstring

            with _quiet_and_safe(zero_to_fp32):
                state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                    str(tag_dir.parent), tag=tag_dir.name
                )
        else:
            model_file = tag_dir / "mp_rank_00_model_states.pt"
            if not model_file.is_file():
                raise CheckpointError(
                    f"checkpoint {tag_dir} has neither ZeRO partitions nor {model_file.name}"
                )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                state = safe_torch_load(model_file)["module"]
    except CheckpointError:
        raise
    except Exception as exc:  # truncated zip, refused pickle global, DeepSpeed's own checks
        raise CheckpointError(f"cannot read checkpoint {tag_dir}: {_load_failure(exc)}") from exc
    return dict(state)


def _load_failure(exc: BaseException) -> str:
    """One line for a failed checkpoint read; a refused pickle names the object it wanted."""
    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" in text:
        match = re.search(r"GLOBAL (\S+)", text)
        what = match.group(1) if match else "an object that is not plain data"
        return f"it pickles {what}, which lmsys refuses to load (only tensors and plain data are unpickled)"
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
