"""Per-call choice between the Triton kernels and their torch references.

`kernels` is the model's config value: "auto" runs Triton for CUDA tensors and torch elsewhere
(the CPU default), "triton" forces the kernels (on CPU through the Triton interpreter, which is
how CI tests the wiring), "torch" forces the references. The kernels are imported lazily so a
CPU-only user never pays for a Triton import.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def use_triton(x: torch.Tensor, kernels: str) -> bool:
    if kernels == "triton":
        return True
    if kernels == "torch":
        return False
    return x.is_cuda


# ----------------------------------------------------------------------------- attention


def attention(
    q: torch.Tensor,  # (B, H, Tq, d_qk)
    k: torch.Tensor,  # (B, H, Tk, d_qk)
    v: torch.Tensor,  # (B, H, Tk, d_vo)
    *,
    causal: bool,
    scale: float,
    kernels: str = "auto",
    softmax: str = "row",
) -> torch.Tensor:  # (B, H, Tq, d_vo)
    """softmax(scale * Q K^T + M) V per head. With Tq < Tk (decoding with a KV cache) the queries
    are the last Tq positions, so the causal mask is aligned to the bottom-right corner."""
    if softmax == "matrix":
        return matrix_softmax_attention(q, k, v, causal=causal, scale=scale)
    same_length = q.shape[2] == k.shape[2]
    if same_length and use_triton(q, kernels):
        from kernels import flash_attention

        return flash_attention(q, k, v, causal=causal, scale=scale)
    if causal and q.shape[2] == 1:  # one query after its cache sees every key: no mask, fast path
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if causal and not same_length:
        t_q, t_k = q.shape[2], k.shape[2]
        query_pos = torch.arange(t_k - t_q, t_k, device=q.device)[:, None]  # (Tq, 1)
        visible = torch.arange(t_k, device=q.device)[None, :] <= query_pos  # (Tq, Tk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def matrix_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> torch.Tensor:
    """The literal reading of seeds 000/003: softmax normalised over the whole (masked) T x T
    matrix of each head, not row by row. A reference option only: it is not autoregressive."""
    scores = scale * (q @ k.transpose(-2, -1))  # (B, H, Tq, Tk)
    if causal:
        t_q, t_k = scores.shape[-2:]
        hidden = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).triu(t_k - t_q + 1)
        scores = scores.masked_fill(hidden, -math.inf)
    weights = torch.softmax(scores.flatten(-2), dim=-1).view_as(scores)
    return weights @ v


# ----------------------------------------------------------------------------- normalisation


def layer_norm_reference(
    x: torch.Tensor,  # (..., N)
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    formula: str,
) -> torch.Tensor:
    """Row-wise normalisation with population statistics (SPEC section 5), in x's dtype."""
    if formula == "none":
        return x
    if formula == "sqrt_var_eps":
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    mu = x.mean(dim=-1, keepdim=True)
    centred = x - mu
    sigma = centred.pow(2).mean(dim=-1, keepdim=True).sqrt()
    if formula == "std_plus_eps":
        y = centred / (sigma + eps)
    elif formula == "exact":  # no eps: a constant row is 0/0 = NaN by the seed's definition
        y = centred / sigma
    else:
        raise ValueError(f"unknown normalisation formula {formula!r}")
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    eps: float,
    formula: str,
    kernels: str = "auto",
) -> torch.Tensor:
    if formula == "none":
        return x
    if use_triton(x, kernels):
        from kernels import layer_norm as triton_layer_norm

        return triton_layer_norm(x, weight, bias, eps=eps, formula=formula)
    return layer_norm_reference(x, weight, bias, eps, formula)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    eps: float,
    formula: str,
    kernels: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LN(x + residual), x + residual): one fused pass on GPU, two ops in torch."""
    if formula == "none":
        summed = x + residual
        return summed, summed
    if use_triton(x, kernels):
        from kernels import add_layer_norm as triton_add_layer_norm

        return triton_add_layer_norm(x, residual, weight, bias, eps=eps, formula=formula)
    summed = x + residual
    return layer_norm_reference(summed, weight, bias, eps, formula), summed
