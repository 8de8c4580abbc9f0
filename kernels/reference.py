"""The functions the kernels compute, in plain torch ops: what the kernel tests compare with, and
what lmsys runs where the kernels do not (CPU tensors, model.kernels=torch).

Importing this module imports torch only, never triton: lmsys imports it at start-up, before it
has decided how Triton must run (lmsys.model.ops.prepare_kernels).
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


# ---------------------------------------------------------------------------------------------
# Packed documents: several documents in one row, each attending only to itself
# ---------------------------------------------------------------------------------------------
#
# `documents` (B, T) names each token's document: integers, non-decreasing along a row, so each
# document is a contiguous run of tokens. Query i may see key j only when both are of the same
# document (and j <= i when causal): a packed row then computes what each of its documents
# computes alone. Every query sees at least its own key, so no softmax row is empty. A kernel
# that knows the documents' boundaries may skip every tile of the (T, T) matrix outside them.


def document_mask(
    documents: torch.Tensor,  # (B, T) integer document ids, non-decreasing along each row
    causal: bool = True,
) -> torch.Tensor:  # (B, 1, T, T) bool: True where query i may see key j
    """The visibility of packed documents: same document, and key j <= query i when causal.
    The head dimension is 1, to broadcast over the heads."""
    same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
    if causal:
        t = documents.shape[1]
        same = same & torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    return same[:, None]


def document_attention_reference(
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H, T, d_qk)
    v: torch.Tensor,  # (B, H, T, d_vo)
    documents: torch.Tensor,  # (B, T) integer document ids, non-decreasing along each row
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:  # (B, H, T, d_vo)
    """softmax(scale * q k^T + M) v with M = -inf wherever `document_mask` hides a key, in fp32
    matmuls (float64 stays float64), materialising the (T, T) matrix; returned in the input dtype.
    With every token in one document it is attention_reference. scale=None: 1/sqrt(d_qk)."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (q.to(compute) @ k.to(compute).transpose(-2, -1)) * sm_scale  # (B, H, T, T)
    s = s.masked_fill(~document_mask(documents, causal), float("-inf"))
    p = torch.softmax(s, dim=-1)  # (B, H, T, T)
    return (p @ v.to(compute)).to(q.dtype)  # (B, H, T, d_vo)


# ---------------------------------------------------------------------------------------------
# The Llama family's pieces (SPEC section 11): RMS norm, rotary positions, grouped-query
# attention's shared key/value heads
# ---------------------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor,  # (..., N)
    weight: torch.Tensor | None = None,  # (N,)
    eps: float = 1e-6,
) -> torch.Tensor:  # (..., N) in x's dtype
    """x / sqrt(mean(x^2) + eps) * g: the statistics and the division in fp32 (float64 stays
    float64), the result rounded to x's dtype before the gain multiplies it (transformers'
    LlamaRMSNorm, so bf16 models round where theirs do). Differentiable by autograd."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    return normed if weight is None else weight * normed


def rotate_half(x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., d)
    """(x1, x2) -> (-x2, x1) for the two halves of the last dimension: dimension i pairs with
    i + d/2 (the half-split layout of transformers' Llama, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(
    x: torch.Tensor,  # (B, H, T, d) queries or keys
    cos: torch.Tensor,  # (T, d) or (B, T, d): cos(p * f_i) at both dimensions of pair i
    sin: torch.Tensor,  # (T, d) or (B, T, d)
) -> torch.Tensor:  # (B, H, T, d)
    """x * cos + rotate_half(x) * sin: each pair (i, i + d/2) of a head rotated by the angle
    p * f_i of its token's position p. cos/sin per row (B, T, d) give each row its positions."""
    if cos.dim() == 3:  # one table per batch row: broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


# The activations of the gated feed-forward's fused kernel (kernels/gated.py): SwiGLU, GeGLU.
GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_GATED_PHI = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def gated_reference(
    gate: torch.Tensor,  # (..., N) W_gate x
    up: torch.Tensor,  # (..., N) W_up x
    activation: str = "silu",
) -> torch.Tensor:  # (..., N)
    """phi(gate) * up, the gated feed-forward's hidden layer, in the inputs' dtype."""
    return _GATED_PHI[activation](gate) * up


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:  # (B, Hkv, T, d) -> (B, Hkv * n_rep, T, d)
    """Each key/value head repeated for the n_rep query heads of its group (head h reads key/value
    head h // n_rep)."""
    if n_rep == 1:
        return x
    b, h_kv, t, d = x.shape
    return x[:, :, None].expand(b, h_kv, n_rep, t, d).reshape(b, h_kv * n_rep, t, d)


# ---------------------------------------------------------------------------------------------
# Linear cross-entropy: the loss of SPEC section 8 from hidden states and the unembedding
# ---------------------------------------------------------------------------------------------
#
# For token i with hidden state h_i (D,), logits z_i = h_i W^T + b (V,), target t_i and loss
# weight w_i:  loss = sum_i w_i (lse(z_i) - z_i[t_i]) / S,  S = sum_i w_i  (weights=None: w_i = 1).
# S is clamped to the smallest normal number, so all-zero weights give 0 and zero gradients, and
# a target whose weight is 0 is never read (it may be any id). With an incoming gradient g:
#
#   G_ij = w_i (softmax(z_i)_j - [j == t_i])       (N, V), one chunk of rows at a time
#   dh = g/S * G W,   dW = g/S * G^T h,   db = g/S * sum_i G_i
#
# G depends on the inputs only, so both implementations (the chunked torch path below and the
# Triton kernels of kernels/linear_cross_entropy.py) form it while a chunk's logits are at hand,
# during the forward when an input needs a gradient, and accumulate the three fp32 sums; the
# backward only scales them by g/S. That is three GEMMs over the logits, as the unfused path
# does, and no (N, V) tensor ever exists.

# Logits per chunk of the chunked paths: 2^25 fp32 values, 128 MiB (667 tokens at GPT-2's vocabulary).
LCE_LOGITS_BUDGET = 1 << 25


def lce_default_chunk(n: int, v: int) -> int:
    """Tokens per chunk of the chunked torch path: as many as LCE_LOGITS_BUDGET logits allow."""
    return max(1, min(n, LCE_LOGITS_BUDGET // max(v, 1)))


def check_linear_cross_entropy_inputs(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor | None,
    bias: torch.Tensor | None,
    chunk: int | None,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """One TypeError / ValueError naming the first argument outside the contract (shapes, dtypes,
    devices, chunk). Target ids are checked separately (`check_targets`: it reads them)."""
    for name, t in (("h", h), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear_cross_entropy: {name} must be a torch.Tensor, got {type(t).__name__}")
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    if h.dtype not in dtypes:
        raise TypeError(f"linear_cross_entropy: h has unsupported dtype {h.dtype}; supported: {names}")
    if h.dim() < 1 or h.shape[-1] < 1:
        raise ValueError(f"linear_cross_entropy: h must be (..., D) with D >= 1, got {tuple(h.shape)}")
    if weight.dim() != 2 or weight.shape[1] != h.shape[-1] or weight.shape[0] < 1:
        raise ValueError(
            f"linear_cross_entropy: weight must be (V, D) = (V, {h.shape[-1]}) with V >= 1, got "
            f"{tuple(weight.shape)}"
        )
    if weight.dtype != h.dtype:
        raise TypeError(f"linear_cross_entropy: h is {h.dtype} but weight is {weight.dtype}; they must match")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"linear_cross_entropy: targets must hold integer ids, got {targets.dtype}")
    if targets.shape != h.shape[:-1]:
        raise ValueError(
            f"linear_cross_entropy: targets must have h's leading shape {tuple(h.shape[:-1])}, "
            f"got {tuple(targets.shape)}"
        )
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or not weights.dtype.is_floating_point:
            raise TypeError("linear_cross_entropy: weights must be a floating-point torch.Tensor or None")
        if weights.shape != h.shape[:-1]:
            raise ValueError(
                f"linear_cross_entropy: weights must have h's leading shape {tuple(h.shape[:-1])}, "
                f"got {tuple(weights.shape)}"
            )
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"linear_cross_entropy: bias must be a ({weight.shape[0]},) tensor or None")
        if bias.dtype != weight.dtype:
            raise TypeError(f"linear_cross_entropy: bias is {bias.dtype} but weight is {weight.dtype}")
    for name, t in (("weight", weight), ("targets", targets), ("weights", weights), ("bias", bias)):
        if t is not None and t.device != h.device:
            raise ValueError(f"linear_cross_entropy: h is on {h.device} but {name} is on {t.device}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"linear_cross_entropy: chunk must be a token count >= 1 or None, got {chunk!r}")


def check_targets(targets: torch.Tensor, weights: torch.Tensor | None, v: int) -> None:
    """Every target with a nonzero weight is an id in [0, V) (one host synchronisation). Not
    under torch.compile, where a data-dependent raise would break the graph: there the gather of
    an out-of-range id fails instead, with torch's message."""
    if torch.compiler.is_compiling():
        return
    bad = (targets < 0) | (targets >= v)
    if weights is not None:
        bad &= weights != 0
    if bool(bad.any()):
        first = int(targets[bad][0])
        raise ValueError(
            f"linear_cross_entropy: target id {first} is outside the vocabulary [0, {v}) and has a "
            "nonzero weight (a target of weight 0 may be any id)"
        )


def linear_cross_entropy_reference(
    h: torch.Tensor,  # (..., D)
    weight: torch.Tensor,  # (V, D)
    targets: torch.Tensor,  # (...) ids
    weights: torch.Tensor | None = None,  # (...) loss weights
    bias: torch.Tensor | None = None,  # (V,)
) -> torch.Tensor:  # 0-dim, fp32 (float64 for float64 inputs)
    """The definition, materialising the (N, V) logits: -sum(w log softmax(h W^T + b)[t]) / sum(w),
    computed in fp32 (float64 stays float64). Differentiable by autograd."""
    compute = torch.promote_types(h.dtype, torch.float32)
    d = h.shape[-1]
    logits = h.reshape(-1, d).to(compute) @ weight.to(compute).T  # (N, V)
    if bias is not None:
        logits = logits + bias.to(compute)
    t = targets.reshape(-1).long()  # (N,)
    w = torch.ones_like(t, dtype=compute) if weights is None else weights.reshape(-1).to(compute)
    nll = F.cross_entropy(logits, torch.where(w != 0, t, 0), reduction="none")  # (N,)
    return torch.where(w != 0, w * nll, 0.0).sum() / w.sum().clamp_min(torch.finfo(compute).tiny)


def lce_scale_gradients(
    grad_loss: torch.Tensor,  # 0-dim
    denominator: torch.Tensor,  # 0-dim: max(sum(w), tiny)
    sums: tuple[torch.Tensor | None, ...],  # fp32 (or float64) G W, G^T h, 1^T G (None: not needed)
    specs: tuple[tuple[torch.Size, torch.dtype] | None, ...],  # each gradient's (shape, dtype): its input's
) -> tuple[torch.Tensor | None, ...]:
    """The backward of both chunked paths: each sum times g/S, in its input's shape and dtype."""
    out = []
    for total, spec in zip(sums, specs):
        if total is None or spec is None:
            out.append(None)
            continue
        scale = grad_loss.to(total.dtype) / denominator.to(total.dtype)
        out.append((total * scale).to(spec[1]).view(spec[0]))
    return tuple(out)


def lce_gradient_specs(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[tuple[torch.Size, torch.dtype] | None, ...]:
    """(shape, dtype) of dh, dweight, dbias: what the backward casts the fp32 sums to."""
    bias_spec = (bias.shape, bias.dtype) if bias is not None else None
    return (h.shape, h.dtype), (weight.shape, weight.dtype), bias_spec


def _chunked_forward(
    h: torch.Tensor,  # (N, D)
    weight: torch.Tensor,  # (V, D)
    targets: torch.Tensor,  # (N,) int64
    weights: torch.Tensor | None,  # (N,)
    bias: torch.Tensor | None,  # (V,)
    chunk: int,
    needs: tuple[bool, bool, bool],  # gradients wanted for (h, weight, bias)
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """(loss, S, (G W, G^T h, 1^T G)) one chunk of `chunk` tokens at a time, in fp32 (float64
    stays float64). Each chunk's logits are computed once, into one reused (chunk, V) buffer."""
    (n, d), v = h.shape, weight.shape[0]
    compute = torch.promote_types(h.dtype, torch.float32)
    w_all = weights.to(compute) if weights is not None else None  # (N,)
    t_all = torch.where(w_all != 0, targets, 0) if w_all is not None else targets  # ids safe to gather
    denominator = w_all.sum() if w_all is not None else torch.tensor(float(n), dtype=compute)
    denominator = denominator.to(h.device).clamp_min(torch.finfo(compute).tiny)
    wc, bc = weight.to(compute), bias.to(compute) if bias is not None else None
    need_h, need_w, need_b = needs
    dh = torch.empty((n, d), dtype=compute, device=h.device) if need_h else None  # G W
    dw = torch.zeros((v, d), dtype=compute, device=h.device) if need_w else None  # G^T h
    db = torch.zeros((v,), dtype=compute, device=h.device) if need_b else None  # 1^T G
    total = torch.zeros((), dtype=compute, device=h.device)
    buffer = torch.empty((min(chunk, n), v), dtype=compute, device=h.device)  # (C, V)
    arange = torch.arange(min(chunk, n), device=h.device)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        hc, tc = h[start:end].to(compute), t_all[start:end]  # (c, D), (c,)
        z = torch.mm(hc, wc.T, out=buffer[: end - start])  # (c, V) logits
        if bc is not None:
            z += bc
        z_target = z.gather(1, tc[:, None])[:, 0]  # (c,)
        z_max = z.amax(dim=1, keepdim=True)  # (c, 1)
        p = z.sub_(z_max).exp_()  # (c, V) exp(z - max), in place
        sum_exp = p.sum(dim=1)  # (c,)
        nll = z_max[:, 0] + sum_exp.log() - z_target  # (c,) lse - z[t]
        wc_rows = w_all[start:end] if w_all is not None else None
        total += torch.where(wc_rows != 0, wc_rows * nll, 0.0).sum() if wc_rows is not None else nll.sum()
        if not any(needs):
            continue
        # G = w (softmax - onehot) in place: one pass scales by w / sum_exp, then w at the targets.
        row_w = wc_rows if wc_rows is not None else torch.ones_like(sum_exp)
        p.mul_((row_w / sum_exp)[:, None])
        p[arange[: end - start], tc] -= row_w
        if need_h:
            torch.mm(p, wc, out=dh[start:end])
        if need_w:
            dw.addmm_(p.T, hc)
        if need_b:
            db += p.sum(dim=0)
    return total / denominator, denominator, (dh, dw, db)


class ChunkedLinearCrossEntropyFunction(torch.autograd.Function):
    """linear_cross_entropy in torch ops, chunk by chunk: no (N, V) tensor ever exists."""

    @staticmethod
    def forward(ctx, h, weight, targets, weights, bias, chunk):
        d, v = h.shape[-1], weight.shape[0]
        t = targets.reshape(-1).long()  # (N,)
        w = weights.reshape(-1) if weights is not None else None  # (N,)
        check_targets(t, w, v)
        h2 = h.reshape(-1, d)  # (N, D)
        wanted = ctx.needs_input_grad
        needs = (wanted[0], wanted[1], bias is not None and wanted[4])  # gradients for (h, weight, bias)
        loss, denominator, sums = _chunked_forward(
            h2, weight, t, w, bias, chunk or lce_default_chunk(h2.shape[0], v), needs
        )
        ctx.save_for_backward(denominator, *sums)
        ctx.specs = lce_gradient_specs(h, weight, bias)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        denominator, *sums = ctx.saved_tensors
        dh, dw, db = lce_scale_gradients(grad_loss, denominator, tuple(sums), ctx.specs)
        return dh, dw, None, None, db, None


def chunked_linear_cross_entropy(
    h: torch.Tensor,  # (..., D)
    weight: torch.Tensor,  # (V, D): the tied embedding or the untied unembedding
    targets: torch.Tensor,  # (...) ids in [0, V) (any id where the weight is 0)
    weights: torch.Tensor | None = None,  # (...) loss weights
    bias: torch.Tensor | None = None,  # (V,)
    *,
    chunk: int | None = None,  # tokens per chunk; None: lce_default_chunk
) -> torch.Tensor:  # 0-dim, fp32 (float64 for float64 inputs)
    """-sum(w log softmax(h W^T + b)[t]) / sum(w) in torch ops, `chunk` tokens at a time, the
    gradients formed in the forward (see the math above): the CPU path of lmsys's loss."""
    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    check_linear_cross_entropy_inputs(h, weight, targets, weights, bias, chunk, dtypes)
    return ChunkedLinearCrossEntropyFunction.apply(h, weight, targets, weights, bias, chunk)
