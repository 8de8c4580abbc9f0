"""The functions the kernels compute, in plain torch ops: what the kernel tests compare with, and
what lmsys runs where the kernels do not (CPU tensors, model.kernels=torch).

Importing this module imports torch only, never triton: lmsys imports it at start-up, before it
has decided how Triton must run (lmsys.ops.prepare_kernels).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# The row normalisations of SPEC section 5 (docs/SPEC.md), by name (kernels/layer_norm.py's
# docstring has the formulas).
LAYER_NORM_FORMULAS = ("sqrt_var_eps", "std_plus_eps", "exact")


def layer_norm_reference(
    x: torch.Tensor,  # (..., N)
    weight: torch.Tensor | None = None,  # (N,)
    bias: torch.Tensor | None = None,  # (N,)
    eps: float = 1e-5,
    formula: str = "sqrt_var_eps",
) -> torch.Tensor:  # (..., N) in x's dtype
    """Row-wise normalisation with population statistics, then the optional affine, computed in
    fp32 (float64 stays float64) and returned in x's dtype. Differentiable by autograd.
    "sqrt_var_eps" is torch's own F.layer_norm; "exact" divides by sqrt(var) with no eps, so a
    constant row gives NaN, as the formula says."""
    if formula not in LAYER_NORM_FORMULAS:
        raise ValueError(f"unknown layer-norm formula {formula!r}; valid: {', '.join(LAYER_NORM_FORMULAS)}")
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    wf = weight.to(compute) if weight is not None else None
    bf = bias.to(compute) if bias is not None else None
    if formula == "sqrt_var_eps":
        return F.layer_norm(xf, xf.shape[-1:], wf, bf, eps).to(x.dtype)
    xc = xf - xf.mean(dim=-1, keepdim=True)
    sigma = (xc * xc).mean(dim=-1, keepdim=True).sqrt()  # population standard deviation
    y = xc / (sigma + eps) if formula == "std_plus_eps" else xc / sigma
    if wf is not None:
        y = y * wf
    if bf is not None:
        y = y + bf
    return y.to(x.dtype)


def add_layer_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    formula: str = "sqrt_var_eps",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm_reference(x + residual, ...), x + residual)."""
    summed = x + residual
    return layer_norm_reference(summed, weight, bias, eps, formula), summed


def attention_reference(
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H, T, d_qk)
    v: torch.Tensor,  # (B, H, T, d_vo)
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:  # (B, H, T, d_vo)
    """softmax(scale * q k^T [causal mask]) v in fp32 matmuls (float64 stays float64),
    materialising the (T, T) matrix; returned in the input dtype. scale=None: 1/sqrt(d_qk)."""
    d_qk, T = q.shape[-1], q.shape[-2]
    sm_scale = 1.0 / math.sqrt(d_qk) if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (q.to(compute) @ k.to(compute).transpose(-2, -1)) * sm_scale  # (B, H, T, T)
    if causal:
        visible = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # key j <= query i
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1)  # (B, H, T, T)
    return (p @ v.to(compute)).to(q.dtype)  # (B, H, T, d_vo)
