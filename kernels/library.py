"""The Triton kernels as torch custom ops (`torch.ops.lmsys.*`), so torch.compile traces through
them: dynamo sees one opaque op with a fake (shape-only) implementation instead of Python that
launches a kernel, and the backward is registered with the op rather than hidden in an
autograd.Function.

    flash_attention(q, k, v, causal, scale) -> o               lmsys::flash_attention_fwd / _bwd
    layer_norm(x, weight, bias, eps, formula) -> y             lmsys::layer_norm_fwd / _bwd
    add_layer_norm(x, residual, weight, bias, eps, formula)    lmsys::add_layer_norm_fwd, _bwd
        -> (normed, summed)

Each kernel is two ops, forward and backward: the forward returns what the backward needs (the
attention's log-sum-exp, the norm's row statistics) as extra outputs, `register_autograd` saves
them, and the backward op launches the backward kernels. The ops run on any device the kernels
run on (CUDA, or CPU tensors under the Triton interpreter). Optional tensors are `Tensor?`
inputs; an absent gradient comes back as an empty tensor (a custom op's outputs cannot be None)
and is turned into None here.

To register another kernel (e.g. the fused linear cross-entropy): a forward op returning its
saved tensors, a backward op, a fake for each (`_like` helpers below), `register_autograd` on
the forward, and a public function that returns the forward's first output; then call it from
lmsys/ops.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

NAMESPACE = "lmsys"
_EMPTY = (0,)  # the shape that stands for "no gradient" (no weight, no bias)


def _none_if_empty(t: Tensor, like: Tensor | None) -> Tensor | None:
    return None if like is None else t


# ----------------------------------------------------------------------------- attention


@torch.library.custom_op(f"{NAMESPACE}::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(o (B, H, T, d_vo), lse (B, H, T) fp32)."""
    from kernels.flash_attention import flash_attention_forward  # imports triton: only when run

    return flash_attention_forward(q, k, v, causal, scale)


@flash_attention_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    b, h, t, _ = q.shape
    return q.new_empty((b, h, t, v.shape[3])), q.new_empty((b, h, t), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    from kernels.flash_attention import flash_attention_backward  # imports triton: only when run

    return flash_attention_backward(do, q, k, v, o, lse, causal, scale)


@flash_attention_bwd.register_fake
def _(do, q, k, v, o, lse, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale = causal, scale


def _attention_backward(ctx, do: Tensor, _dlse: Tensor | None):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_bwd(do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


flash_attention_fwd.register_autograd(_attention_backward, setup_context=_attention_setup)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    """softmax(scale q k^T [causal]) v -> (B, H, T, d_vo), through the custom op."""
    return flash_attention_fwd(q, k, v, causal, scale)[0]


# ----------------------------------------------------------------------------- layer norm


def _stats_like(x: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1] if x.dim() else 1
    return x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, formula: str
) -> tuple[Tensor, Tensor, Tensor]:
    """(y like x, mean (M,) fp32, rstd (M,) fp32)."""
    from kernels.layer_norm import layer_norm_forward  # imports triton: only when run

    y, _, mean, rstd = layer_norm_forward(x, weight, bias, eps, formula)
    return y, mean, rstd


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps, formula):
    return torch.empty_like(x), _stats_like(x), _stats_like(x)


@torch.library.custom_op(f"{NAMESPACE}::add_layer_norm_fwd", mutates_args=())
def add_layer_norm_fwd(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, formula: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(normed like x, summed = x + residual, mean (M,) fp32, rstd (M,) fp32)."""
    from kernels.layer_norm import layer_norm_forward  # imports triton: only when run

    normed, summed, mean, rstd = layer_norm_forward(x, weight, bias, eps, formula, residual=residual)
    return normed, summed, mean, rstd


@add_layer_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, formula):
    return torch.empty_like(x), torch.empty_like(x), _stats_like(x), _stats_like(x)


@torch.library.custom_op(f"{NAMESPACE}::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    formula: str,
    dsummed: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias); dweight / dbias empty when there is no weight / bias."""
    from kernels.layer_norm import layer_norm_backward  # imports triton: only when run

    dx, dweight, dbias = layer_norm_backward(dy, x, mean, rstd, weight, bias, eps, formula, dsummed)
    empty = x.new_empty(_EMPTY)
    return dx, dweight if dweight is not None else empty, dbias if dbias is not None else empty.clone()


@layer_norm_bwd.register_fake
def _(dy, x, mean, rstd, weight, bias, eps, formula, dsummed):
    dweight = torch.empty_like(weight) if weight is not None else x.new_empty(_EMPTY)
    dbias = torch.empty_like(bias) if bias is not None else x.new_empty(_EMPTY)
    return torch.empty_like(x), dweight, dbias


def _layer_norm_setup(ctx, inputs, output) -> None:
    x, weight, bias, eps, formula = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.eps, ctx.formula = eps, formula


def _layer_norm_backward(ctx, dy: Tensor, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = layer_norm_bwd(
        dy.contiguous(), x, mean, rstd, weight, bias, ctx.eps, ctx.formula, None
    )
    return dx, _none_if_empty(dweight, weight), _none_if_empty(dbias, bias), None, None


layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


def _add_layer_norm_setup(ctx, inputs, output) -> None:
    _, _, weight, bias, eps, formula = inputs
    _, summed, mean, rstd = output
    ctx.save_for_backward(summed, weight, bias, mean, rstd)
    ctx.eps, ctx.formula = eps, formula


def _add_layer_norm_backward(ctx, dnormed, dsummed, _dmean, _drstd):
    summed, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = layer_norm_bwd(
        dnormed.contiguous(), summed, mean, rstd, weight, bias, ctx.eps, ctx.formula, dsummed.contiguous()
    )
    # x and residual get the same gradient
    return dx, dx, _none_if_empty(dweight, weight), _none_if_empty(dbias, bias), None, None


add_layer_norm_fwd.register_autograd(_add_layer_norm_backward, setup_context=_add_layer_norm_setup)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, formula: str) -> Tensor:
    """The layer-norm kernel through its custom op."""
    return layer_norm_fwd(x, weight, bias, eps, formula)[0]


def add_layer_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, formula: str
) -> tuple[Tensor, Tensor]:
    """(LN(x + residual), x + residual) through the fused kernel's custom op."""
    normed, summed, _, _ = add_layer_norm_fwd(x, residual, weight, bias, eps, formula)
    return normed, summed
