"""The Triton kernels as torch custom ops (`torch.ops.lmsys.*`), so torch.compile traces through
them: dynamo sees one opaque op with a fake (shape-only) implementation instead of Python that
launches a kernel, and the backward is registered with the op rather than hidden in an
autograd.Function.

    flash_attention(q, k, v, causal, scale) -> o               lmsys::flash_attention_fwd / _bwd
    layer_norm(x, weight, bias, eps, formula) -> y             lmsys::layer_norm_fwd / _bwd
    add_layer_norm(x, residual, weight, bias, eps, formula)    lmsys::add_layer_norm_fwd, _bwd
        -> (normed, summed)
    linear_cross_entropy(h, weight, targets, weights, bias)    lmsys::linear_cross_entropy_fwd
        -> loss      (its backward only scales the gradient sums the forward formed: plain torch)

Each kernel is two ops, forward and backward: the forward returns what the backward needs (the
attention's log-sum-exp, the norm's row statistics) as extra outputs, `register_autograd` saves
them, and the backward op launches the backward kernels. The ops run on any device the kernels
run on (CUDA, or CPU tensors under the Triton interpreter). Optional tensors are `Tensor?`
inputs; an absent gradient comes back as an empty tensor (a custom op's outputs cannot be None)
and is turned into None here.

To register another kernel: a forward op returning its
saved tensors, a backward op, a fake for each (`_like` helpers below), `register_autograd` on
the forward, and a public function that returns the forward's first output; then call it from
lmsys/model/ops.py.
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


# ----------------------------------------------------------------------------- linear cross-entropy


@torch.library.custom_op(f"{NAMESPACE}::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    weights: Tensor | None,
    bias: Tensor | None,
    need_h: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, S, G W, G^T h, 1^T G) for h (N, D): the fused kernel's forward, with the fp32
    gradient sums it forms while the logits exist (empty where not needed)."""
    from kernels.linear_cross_entropy import linear_cross_entropy_forward  # imports triton

    loss, denominator, sums = linear_cross_entropy_forward(
        h, weight, targets, weights, bias, needs=(need_h, need_w, need_b)
    )
    empty = h.new_empty(_EMPTY, dtype=torch.float32)
    return (loss, denominator, *(s if s is not None else empty.clone() for s in sums))


@linear_cross_entropy_fwd.register_fake
def _(h, weight, targets, weights, bias, need_h, need_w, need_b):
    f32 = torch.float32
    scalar = h.new_empty((), dtype=f32)
    dh = h.new_empty(h.shape if need_h else _EMPTY, dtype=f32)
    dw = h.new_empty(weight.shape if need_w else _EMPTY, dtype=f32)
    db = h.new_empty((weight.shape[0],) if need_b and bias is not None else _EMPTY, dtype=f32)
    return scalar, scalar.clone(), dh, dw, db


def _lce_setup(ctx, inputs, output) -> None:
    h, weight, _, _, bias, need_h, need_w, need_b = inputs
    _, denominator, dh, dw, db = output
    ctx.save_for_backward(denominator, dh, dw, db)
    ctx.needs = (need_h, need_w, need_b and bias is not None)
    ctx.specs = tuple(
        (t.shape, t.dtype) if t is not None and need else None
        for t, need in zip((h, weight, bias), ctx.needs, strict=True)
    )


def _lce_backward(ctx, grad_loss, _ds, _ddh, _ddw, _ddb):
    from kernels.reference import lce_scale_gradients  # torch only

    denominator, *sums = ctx.saved_tensors
    sums = tuple(s if need else None for s, need in zip(sums, ctx.needs, strict=True))
    dh, dweight, dbias = lce_scale_gradients(grad_loss, denominator, sums, ctx.specs)
    return dh, dweight, None, None, dbias, None, None, None


linear_cross_entropy_fwd.register_autograd(_lce_backward, setup_context=_lce_setup)


def linear_cross_entropy(
    h: Tensor,  # (..., D)
    weight: Tensor,  # (V, D)
    targets: Tensor,  # (...)
    weights: Tensor | None,  # (...)
    bias: Tensor | None,  # (V,)
) -> Tensor:  # 0-dim fp32
    """The fused linear cross-entropy through its custom op (the gradient sums are formed in the
    forward only for the inputs that need a gradient)."""
    grad = torch.is_grad_enabled()
    need = [grad and t is not None and t.requires_grad for t in (h, weight, bias)]
    d = h.shape[-1]
    flat_weights = weights.reshape(-1) if weights is not None else None
    return linear_cross_entropy_fwd(h.reshape(-1, d), weight, targets.reshape(-1), flat_weights, bias, *need)[
        0
    ]
