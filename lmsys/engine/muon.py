"""Muon (optim=muon) through DeepSpeed's own `MuonWithAuxAdam`, under ZeRO 0-3.

Muon ("MomentUm Orthogonalized by Newton-Schulz", Keller Jordan 2024) steps a weight matrix by
the nearest semi-orthogonal matrix to its Nesterov momentum, found by 5 Newton-Schulz
iterations. It is defined for the hidden matrices only: here the 2-D weights inside the blocks
(attention's w_qkv and w_o, the MLP's matrices). Everything else (token embedding, position
table, unembedding, norm gains, biases) is stepped by AdamW inside the same optimizer, in the
param groups lmsys.engine.zero.param_groups gives AdamW (weight decay on matrices only).

Why lmsys builds the optimizer rather than naming `"type": "Muon"` in the DeepSpeed JSON:
DeepSpeed then tags parameters by name (Muon for every >= 2-D parameter whose name lacks "embed"
or "lm_head"), which would hand lmsys's learned position table (`positions.table`) to Muon.
Built here, the tags are lmsys's rule, and DeepSpeed's ZeRO optimizers still recognise the
optimizer as its Muon (they orthogonalize the whole gathered gradient of every Muon matrix,
whatever the partitioning; stage 0 does it in the optimizer's own step).

On the CPU path (no GPU; gloo) one thing in DeepSpeed's Muon does not fit, and is worked around:
its Newton-Schulz functions are wrapped in `torch.compile`, so every matrix shape builds C++
with inductor on the first step (tens of seconds on 2 cores, per rank). Where the run does
not compile (trainer.compile=auto on a CPU, or false) the eager functions underneath are
used (`eager_newton_schulz`): the same math, in fp32 on a CPU (DeepSpeed picks fp16/bf16 only
where the accelerator supports it).

The auxiliary AdamW is Muon's own inline update (torch ops, AdamW mode), not DeepSpeed's fused
or CPU Adam: those are built only through the JSON path. With the optimizer state offloaded
(deepspeed=zero3_offload, deepspeed.offload_optimizer=true) this same optimizer steps the
offloaded fp32 partitions on the CPU (DeepSpeed orthogonalizes the gathered gradients first);
the losses are those of the run without offload (tests/integration/training/test_muon.py).

optim.grad_clip must be 0 under Muon (lmsys.core.config): ZeRO 1-2 write the orthogonalized
update where the gradient was before clipping, so the reported "grad norm" there is the norm
of the Muon update and the AdamW gradients together, and a clip would shrink Muon's step.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from lmsys.core.config import OptimConfig

NS_METHOD = "gram"  # DeepSpeed's default: Newton-Schulz on the Gram matrix (fp32 on a CPU)


def layer_dims(p: nn.Parameter) -> int:
    """Dimensions of the parameter as a layer (ZeRO-3 partitions report 1-D)."""
    return len(p.ds_shape) if hasattr(p, "ds_shape") else p.dim()


def layer_numel(p: nn.Parameter) -> int:
    return int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel()


def is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    """Muon's share: the >= 2-D weights inside the blocks (attention and MLP projections)."""
    return (".blocks." in f".{name}") and layer_dims(p) >= 2


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's hidden matrices, largest first, AdamW's matrices, AdamW's vectors), trainable only;
    each parameter tagged `use_muon` (DeepSpeed's ZeRO optimizers read the tag). Largest first
    is the order MuonWithAuxAdam sorts its group into anyway (a stable sort, so a no-op here):
    lmsys.engine.reshard re-derives the optimizer's order from this function."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        p.use_muon = is_hidden_matrix(name, p)
        if p.use_muon:
            muon.append(p)
        else:
            (decay if layer_dims(p) >= 2 else no_decay).append(p)
    muon.sort(key=lambda p: tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape), reverse=True)
    return muon, decay, no_decay


def uses_muon(model: nn.Module) -> bool:
    """Whether `model`'s parameters were handed to Muon (tagged by split_parameters)."""
    return any(getattr(p, "use_muon", False) for p in model.parameters())


def muon_param_groups(model: nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """MuonWithAuxAdam's param groups: one Muon group (split_parameters' order), then AdamW with
    and without weight decay. `lr_scale` is each group's lr over optim.lr: the schedule scales
    every group alike (lmsys.engine.zero.set_lr)."""
    muon, decay, no_decay = split_parameters(model)
    adam = {"use_muon": False, "betas": (optim.beta1, optim.beta2), "eps": optim.eps, "lr": optim.lr}
    groups = [
        {
            "params": muon,
            "use_muon": True,
            "lr": optim.muon_lr,
            "lr_scale": optim.muon_lr / optim.lr,
            "momentum": optim.muon_momentum,
            "weight_decay": optim.muon_weight_decay,
            "ns_method": NS_METHOD,
        },
        {"params": decay, "weight_decay": optim.weight_decay, **adam},
        {"params": no_decay, "weight_decay": 0.0, **adam},
    ]
    return [g for g in groups if g["params"]]


def _compiled_on_first_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile(fn), made at the first call rather than now."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    call._torchdynamo_orig_callable = fn  # type: ignore[attr-defined]  # as torch.compile's wrapper
    return call


def import_muon_lazily() -> None:
    """Import DeepSpeed's Muon module with its torch.compile decorations deferred to their first
    call. DeepSpeed's ZeRO code imports the module in every engine, Muon or not (its optimizer
    check, and the ZeRO 1-2 gradient path at every step), and decorating imports inductor: about
    1.6 s of CPU per rank per launch, for functions only a Muon run calls. Where DeepSpeed differs
    (no such module or decorator), its own import stands."""
    import deepspeed.runtime.compiler as ds_compiler  # late: lmsys.engine.zero's docstring

    name = "deepspeed.runtime.zero.muon.original_muon"
    decorator = getattr(ds_compiler, "compile", None)
    if name in sys.modules or decorator is None:
        return
    ds_compiler.compile = lambda: _compiled_on_first_call
    try:
        importlib.import_module(name)
    except ImportError:  # a DeepSpeed without Muon
        pass
    finally:
        ds_compiler.compile = decorator


def eager_newton_schulz() -> None:
    """Run DeepSpeed's Muon math eagerly: its module-level functions are `torch.compile`
    wrappers; each is replaced by the function it wraps (process-wide, for the run's lifetime;
    the ZeRO optimizers import `muon_update` from the module at every step, so they see it)."""
    from deepspeed.runtime.zero.muon import original_muon  # late: lmsys.engine.zero's docstring

    for name in ("muon_update", "zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz"):
        fn = getattr(original_muon, name)
        setattr(original_muon, name, getattr(fn, "_torchdynamo_orig_callable", fn))


def build_muon(model: nn.Module, optim: OptimConfig, compiled: bool) -> tuple[Any, list[dict[str, Any]]]:
    """(DeepSpeed's MuonWithAuxAdam over `model`, its param groups). `compiled`: whether the run
    compiles (else the Newton-Schulz iteration runs eager)."""
    if not compiled:
        eager_newton_schulz()
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # late: as above

    groups = muon_param_groups(model, optim)
    return MuonWithAuxAdam(groups, adam_optimizer=None, adam_w_mode=True), groups
