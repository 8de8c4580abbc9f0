"""Per-call choice between the Triton kernels and their torch references.

`kernels` is the model's config value: "auto" runs Triton for CUDA tensors and torch elsewhere
(the CPU default), "triton" forces the kernels (on CPU through the Triton interpreter, which is
how CI tests the wiring), "torch" forces the references. The kernels are called through their
torch custom ops (`torch.ops.lmsys.*`, registered beside each kernel), so torch.compile traces
through them; the kernel modules are imported lazily so a CPU-only user never pays for a Triton import.
The loss from hidden states follows `model.loss_impl` (`linear_cross_entropy`): the fused Triton
kernel, the chunked torch path, or torch's own F.linear_cross_entropy (chunked, "torch").

The Llama family's pieces (SPEC section 11) follow the same setting: RMS norm and the fused
residual add + RMS norm (kernels.layer_norm.rms_norm / add_rms_norm), rotary positions
(kernels.rotary), the gated activation with silu, gelu or gelu_tanh (kernels.gated), and
grouped-query attention, whose key/value heads the flash-attention kernel reads per group
without repeating them.

Packed documents (`attention(..., documents=)`) run the flash-attention kernel with the
documents' bounds where the setting runs Triton (it skips every tile outside the documents), and
torch's SDPA with kernels.reference.document_mask elsewhere.

Entry points call `prepare_kernels(kernels, device)` once, before anything imports triton: it
selects the Triton CPU interpreter when "triton" is asked for without CUDA, so that a user never
has to set TRITON_INTERPRET=1 by hand. How Triton runs in the process is kernels.runtime's.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from kernels import runtime
from kernels.reference import (
    GATED_ACTIVATIONS,
    add_layer_norm_reference,
    chunked_linear_cross_entropy,
    document_mask,
    layer_norm_reference,
    repeat_kv,
    rms_norm_reference,
    rotary_reference,
)
from lmsys.core.console import command, warn
from lmsys.core.errors import ConfigError


def prepare_kernels(kernels: str, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
    """Make `model.kernels=<kernels>` runnable on `device`. Call it once per process, as early as
    the setting and the device are known and before anything imports triton (DeepSpeed's
    initialize does, for one).

    Only kernels="triton" without CUDA needs anything: the Triton CPU interpreter. Before triton
    is imported this requests it in os.environ (TRITON_INTERPRET=1: child processes inherit it); when
    triton is already imported for the interpreter there is nothing to do; when it was imported
    for compiled GPU code, which cannot be undone in this process, it raises one ConfigError
    saying how to start the process instead; with `dtype` bf16 it raises one ConfigError too (the
    interpreter cannot compute bf16 attention). "auto" and "torch" run torch ops on CPU, and on
    CUDA every setting runs as imported, with a warning when TRITON_INTERPRET would make the
    kernels run interpreted there.
    """
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda and kernels != "torch" and runtime.interpreter_requested():
        warn(
            command(),
            "TRITON_INTERPRET is set: the Triton kernels run in the Python interpreter, thousands of "
            "times slower than compiled; unset it on a GPU machine",
        )
    if kernels != "triton" or on_cuda:
        return
    if dtype == torch.bfloat16:  # the interpreter's bf16 matmuls return garbage, not an error
        raise ConfigError(
            f"model.kernels=triton with bf16 on {torch.device(device)}: the Triton CPU interpreter "
            "cannot compute bf16 attention; use fp32 there, or model.kernels=auto (torch ops)"
        )
    mode = runtime.triton_mode()
    if mode != "compiled":
        _warn_interpreted(str(torch.device(device)))
    if mode is None:
        runtime.request_interpreter()
    elif mode == "compiled":
        raise ConfigError(
            f"model.kernels=triton on {torch.device(device)} needs the Triton CPU interpreter, but "
            "triton was already imported in this process for compiled GPU kernels and that choice "
            "is fixed at import; start the process with TRITON_INTERPRET=1 in its environment, or "
            "use model.kernels=auto (torch ops on CPU)"
        )


@functools.cache  # once per process and device: lmsys-eval run= prepares every checkpoint
def _warn_interpreted(device: str) -> None:
    warn(
        command(),
        f"model.kernels=triton on {device} runs the Triton kernels in their CPU interpreter, a "
        "correctness mode about a thousand times slower than torch (minutes per training step even "
        "for the tiny model); model.kernels=auto uses torch ops on the CPU",
    )


# Kernels the self-check (lmsys/model/selfcheck.py) found wrong on this process's device: they run
# as their torch references from then on, whatever model.kernels says.
_FALLEN_BACK: set[str] = set()


def fall_back(kernel: str) -> None:
    """Run `kernel` ("attention", "layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm",
    "rotary", "gated", "linear_cross_entropy") as its torch reference in this process from now on."""
    _FALLEN_BACK.add(kernel)


def reset_fallbacks() -> None:
    _FALLEN_BACK.clear()


def use_triton(x: torch.Tensor, kernels: str, kernel: str | None = None) -> bool:
    if kernel in _FALLEN_BACK:
        return False
    if kernels == "triton":
        return True
    if kernels == "torch":
        return False
    return x.is_cuda


# ----------------------------------------------------------------------------- attention


def attention(
    q: torch.Tensor,  # (B, H, Tq, d_qk)
    k: torch.Tensor,  # (B, Hkv, Tk, d_qk), Hkv dividing H
    v: torch.Tensor,  # (B, Hkv, Tk, d_vo)
    *,
    causal: bool,
    scale: float,
    kernels: str = "auto",
    softmax: str = "row",
    key_mask: torch.Tensor | None = None,  # (B, Tk) bool: False at padding keys
    query_slots: torch.Tensor | None = None,  # (Tq,) the queries' key slots; None: the last Tq
    documents: torch.Tensor | None = None,  # (B, T) document ids of packed rows (Tq = Tk = T)
) -> torch.Tensor:  # (B, H, Tq, d_vo)
    """softmax(scale * Q K^T + M) V per head. With Tq < Tk (decoding with a KV cache) the queries
    are the last Tq positions, so the causal mask is aligned to the bottom-right corner, unless
    `query_slots` places them (a static cache: keys past them are not filled yet, and key_mask
    hides them). With a key_mask (a padded batch) the padding keys are hidden from every query
    (padded_attention). With fewer key/value heads than query heads (grouped-query attention)
    query head h reads key/value head h // (H / Hkv): torch's SDPA and the flash-attention kernel
    both do so themselves (enable_gqa; the kernel's grouped heads). With `documents` (packed rows,
    no cache) a query sees only the keys of its own document (`packed_attention`)."""
    groups = q.shape[1] // k.shape[1]
    if documents is not None:
        return packed_attention(
            q,
            k,
            v,
            documents,
            causal=causal,
            scale=scale,
            softmax=softmax,
            key_mask=key_mask,
            kernels=kernels,
        )
    if key_mask is not None:
        if softmax == "matrix":
            raise ValueError(
                "attention.softmax=matrix normalises over the whole matrix: it cannot take padding"
            )
        return padded_attention(q, k, v, key_mask, causal=causal, scale=scale, query_slots=query_slots)
    if query_slots is not None:
        raise ValueError("attention with query_slots needs the key_mask of the filled slots")
    if softmax == "matrix":
        return matrix_softmax_attention(
            q, repeat_kv(k, groups), repeat_kv(v, groups), causal=causal, scale=scale
        )
    same_length = q.shape[2] == k.shape[2]
    if same_length and use_triton(q, kernels, "attention"):
        from kernels.flash_attention import flash_attention  # the custom op (torch.compile traces it)

        return flash_attention(q, k, v, causal, scale)
    gqa = groups > 1
    if causal and q.shape[2] == 1:  # one query after its cache sees every key: no mask, fast path
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if causal and not same_length:
        t_q, t_k = q.shape[2], k.shape[2]
        query_pos = torch.arange(t_k - t_q, t_k, device=q.device)[:, None]  # (Tq, 1)
        visible = torch.arange(t_k, device=q.device)[None, :] <= query_pos  # (Tq, Tk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)


def packed_attention(
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, Hkv, T, d_qk)
    v: torch.Tensor,  # (B, Hkv, T, d_vo)
    documents: torch.Tensor,  # (B, T) document ids, non-decreasing along each row
    *,
    causal: bool,
    scale: float,
    softmax: str = "row",
    key_mask: torch.Tensor | None = None,
    kernels: str = "auto",
) -> torch.Tensor:  # (B, H, T, d_vo)
    """Attention of rows packed with documents, each token seeing only its own document.

    Where `kernels` runs Triton, the flash-attention kernel with the documents: it visits only
    the tiles inside the rows' documents, so the work grows with the sum of the squared document
    lengths. Elsewhere torch's SDPA with the mask of kernels.reference.document_mask (a boolean
    mask: the memory-efficient kernel on CUDA, the math one on CPU). Grouped-query heads are read
    in place by both."""
    if softmax == "matrix":
        raise ValueError(
            "attention.softmax=matrix normalises over the whole matrix: it cannot take documents"
        )
    if key_mask is not None or q.shape[2] != k.shape[2]:
        raise ValueError("attention with documents takes whole packed rows: no KV cache and no padding mask")
    if documents.shape != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"documents must be (B, T) = {(q.shape[0], q.shape[2])}, got {tuple(documents.shape)}"
        )
    if use_triton(q, kernels, "attention"):
        from kernels.flash_attention import flash_attention  # the custom op (torch.compile traces it)

        return flash_attention(q, k, v, causal, scale, documents)
    visible = document_mask(documents, causal)  # (B, 1, T, T)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)


def padded_attention(
    q: torch.Tensor,  # (B, H, Tq, d_qk): the last Tq of the Tk key slots
    k: torch.Tensor,  # (B, Hkv, Tk, d_qk)
    v: torch.Tensor,  # (B, Hkv, Tk, d_vo)
    key_mask: torch.Tensor,  # (B, Tk) bool: False at padding slots
    *,
    causal: bool,
    scale: float,
    query_slots: torch.Tensor | None = None,  # (Tq,) the queries' slots; None: the last Tq
) -> torch.Tensor:  # (B, H, Tq, d_vo)
    """Row-softmax attention of a padded batch, in torch (the flash kernel takes no mask).

    A padding key's score is -inf, so its softmax weight is exactly 0 and it adds nothing to any
    real query's output. A query that is itself padding would see no key at all (a 0/0 row of
    NaN whose 0 * NaN would then reach real rows through the values): it sees its own slot
    instead, which keeps it finite; its output is never read."""
    t_q, t_k = q.shape[2], k.shape[2]
    if query_slots is None:
        query_slots = torch.arange(t_k - t_q, t_k, device=q.device)
    query_slot = query_slots[:, None]  # (Tq, 1)
    key_slot = torch.arange(t_k, device=q.device)[None, :]  # (1, Tk)
    visible = key_mask[:, None, None, :]  # (B, 1, 1, Tk)
    if causal:
        visible = visible & (key_slot <= query_slot)  # (B, 1, Tq, Tk)
    visible = visible | (key_slot == query_slot)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)


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


def layer_norm(
    x: torch.Tensor,  # (..., N)
    weight: torch.Tensor | None,  # (N,)
    bias: torch.Tensor | None,  # (N,)
    *,
    eps: float,
    formula: str,
    kernels: str = "auto",
) -> torch.Tensor:
    """Row-wise normalisation with population statistics (SPEC section 5) and the optional affine:
    the Triton kernel, or its torch definition (kernels/reference.py); "none" is the identity,
    "rms" is `rms_norm` (a gain, no bias)."""
    if formula == "none":
        return x
    if formula == "rms":
        return rms_norm(x, weight, eps=eps, kernels=kernels)
    if use_triton(x, kernels, "layer_norm"):
        from kernels.layer_norm import layer_norm as triton_layer_norm  # the custom op: module docstring

        return triton_layer_norm(x, weight, bias, eps, formula)
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
    if formula == "rms":
        if use_triton(x, kernels, "add_rms_norm") and _rms_kernel_takes(x, weight):
            from kernels.layer_norm import add_rms_norm  # the custom op: module docstring

            return add_rms_norm(x, residual, weight, eps)
        summed = x + residual
        return rms_norm_reference(summed, weight, eps), summed
    if use_triton(x, kernels, "add_layer_norm"):
        from kernels.layer_norm import add_layer_norm as fused  # the custom op: module docstring

        return fused(x, residual, weight, bias, eps, formula)
    return add_layer_norm_reference(x, residual, weight, bias, eps, formula)


def rms_norm(
    x: torch.Tensor,  # (..., N)
    weight: torch.Tensor | None,  # (N,)
    *,
    eps: float,
    kernels: str = "auto",
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * g, statistics in fp32 (SPEC section 11): the Triton kernel (the
    layer norm's "rms" formula), or its torch definition."""
    if use_triton(x, kernels, "rms_norm") and _rms_kernel_takes(x, weight):
        from kernels.layer_norm import rms_norm as triton_rms_norm  # the custom op: module docstring

        return triton_rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def _rms_kernel_takes(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """The kernel returns x's dtype; the reference returns the gain's product type, so a gain of
    another dtype (an fp32 gain on bf16 activations) stays with the reference."""
    return weight is None or weight.dtype == x.dtype


# ----------------------------------------------------------------------------- the Llama family


def rotary(
    q: torch.Tensor,  # (B, H, T, d)
    k: torch.Tensor,  # (B, Hkv, T, d)
    cos: torch.Tensor,  # (T, d) or (B, T, d)
    sin: torch.Tensor,  # (T, d) or (B, T, d)
    *,
    kernels: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys rotated by their positions (SPEC section 11, the half-split layout): one
    Triton kernel for both (kernels.rotary), or the torch reference."""
    if use_triton(q, kernels, "rotary"):
        from kernels.rotary import rotary as triton_rotary  # the custom op: module docstring

        return triton_rotary(q, k, cos, sin)
    return rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "leaky_relu": F.leaky_relu,
}


def gated(
    gate: torch.Tensor,  # (..., d_ff) W_gate x
    up: torch.Tensor,  # (..., d_ff) W_up x
    *,
    activation: str,
    kernels: str = "auto",
) -> torch.Tensor:  # (..., d_ff)
    """phi(gate) * up, the gated feed-forward's hidden layer (SwiGLU with silu, GeGLU with gelu):
    one fused Triton kernel each way for silu, gelu and gelu_tanh (kernels.gated), torch for the
    other activations and under kernels=torch."""
    if activation in GATED_ACTIVATIONS and use_triton(gate, kernels, "gated"):
        from kernels.gated import gated as fused  # the custom op: module docstring

        return fused(gate, up, activation)
    return ACTIVATIONS[activation](gate) * up


# ----------------------------------------------------------------------------- the loss

# The dtypes the fused kernel takes (float64 models use the chunked torch path under auto).
_FUSED_LOSS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def loss_implementation(h: torch.Tensor, loss_impl: str, kernels: str) -> str:
    """What `model.loss_impl` means for hidden states `h`: "fused", "chunked", "torch" or "full" as
    set, and "auto" is fused where model.kernels runs Triton (CUDA tensors under "auto"), chunked
    elsewhere. Why not torch's F.linear_cross_entropy under auto (docs/model.md, `python -m
    tools.bench ce`): on a CPU lmsys's chunked path is faster than every chunking option of
    torch's (and as small); on CUDA the fused kernel is lmsys's, torch's op is a row of the same
    benchmark, and auto changes only where that benchmark on the device says so."""
    if loss_impl == "fused" and "linear_cross_entropy" in _FALLEN_BACK:
        return "chunked"  # the self-check found the kernel wrong on this device
    if loss_impl != "auto":
        return loss_impl
    fused = use_triton(h, kernels, "linear_cross_entropy") and h.dtype in _FUSED_LOSS_DTYPES
    return "fused" if fused else "chunked"


def linear_cross_entropy(
    h: torch.Tensor,  # (..., D) last hidden states
    weight: torch.Tensor,  # (V, D) unembedding (the tied embedding or its own matrix)
    targets: torch.Tensor,  # (...) ids
    weights: torch.Tensor | None,  # (...) loss weights
    bias: torch.Tensor | None,  # (V,)
    *,
    loss_impl: str,
    kernels: str = "auto",
) -> torch.Tensor:  # 0-dim fp32 (float64 for a float64 model)
    """-sum(w log softmax(h W^T + b)[t]) / sum(w) without the (tokens, V) logits: the Triton kernel
    ("fused"), the chunked torch path ("chunked") or torch's chunked op ("torch"); "full" is the
    model's own logits path."""
    impl = loss_implementation(h, loss_impl, kernels)
    if impl == "torch":
        return torch_linear_cross_entropy(h, weight, targets, weights, bias)
    if impl == "fused":
        if not h.is_cuda:
            prepare_interpreted_loss(h, kernels)
        # imports triton, so only when the kernel runs (the module docstring says why)
        from kernels.linear_cross_entropy import linear_cross_entropy as fused  # the custom op

        return fused(h, weight, targets, weights, bias)
    if impl != "chunked":
        raise ValueError(f"ops.linear_cross_entropy computes the fused or chunked loss, not {impl!r}")
    return chunked_linear_cross_entropy(h, weight, targets, weights, bias)


def torch_linear_cross_entropy(
    h: torch.Tensor,  # (..., D)
    weight: torch.Tensor,  # (V, D)
    targets: torch.Tensor,  # (...)
    weights: torch.Tensor | None,  # (...)
    bias: torch.Tensor | None,  # (V,)
    options: torch.nn.LinearCrossEntropyOptions | None = None,
) -> torch.Tensor:  # 0-dim fp32 (float64 for float64 inputs)
    """model.loss_impl=torch: torch's own F.linear_cross_entropy, chunked (its automatic chunking
    unless `options` say otherwise), per token, then lmsys's weighted mean."""
    per_token = F.linear_cross_entropy(
        h.reshape(-1, h.shape[-1]),  # (N, D)
        weight,
        targets.reshape(-1),  # (N,)
        linear_bias=bias,
        reduction="none",
        options=torch.nn.LinearCrossEntropyOptions() if options is None else options,
    )  # (N,)
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    per_token = per_token.to(acc)
    if weights is None:
        return per_token.mean()
    w = weights.reshape(-1).to(acc)  # (N,)
    return (per_token * w).sum() / w.sum()


def prepare_interpreted_loss(h: torch.Tensor, kernels: str) -> None:
    """The fused loss on a CPU tensor runs in the Triton interpreter: select it if triton is not
    imported yet (as prepare_kernels does for model.kernels=triton), or say in one line why not."""
    device = str(h.device)
    if h.dtype == torch.bfloat16:
        raise ConfigError(
            f"model.loss_impl=fused with bf16 on {device}: the Triton CPU interpreter cannot multiply bf16; "
            "use model.loss_impl=chunked there"
        )
    mode = runtime.triton_mode()
    if mode == "compiled":
        raise ConfigError(
            f"model.loss_impl=fused on {device} needs the Triton CPU interpreter, but triton was already "
            "imported in this process for compiled GPU kernels (DeepSpeed imports it); set "
            "model.kernels=triton (lmsys then selects the interpreter first) or TRITON_INTERPRET=1 in the "
            "environment, or use model.loss_impl=chunked"
        )
    if mode is None:
        runtime.request_interpreter()
    if kernels != "triton":  # with model.kernels=triton, prepare_kernels has said it already
        _warn_interpreted_loss(device)


@functools.cache  # once per process and device
def _warn_interpreted_loss(device: str) -> None:
    warn(
        command(),
        f"model.loss_impl=fused on {device} runs the Triton kernel in its CPU interpreter, a correctness "
        "mode far slower than torch; model.loss_impl=auto uses the chunked torch path on the CPU",
    )
