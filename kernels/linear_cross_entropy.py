"""Fused linear cross-entropy: the loss of SPEC section 8 from hidden states, in Triton kernels,
without materialising the (N, V) logits.

    linear_cross_entropy(h, weight, targets, weights=None, bias=None, *, chunk=None) -> loss
    h: (..., D)  weight: (V, D)  targets: (...) ids  weights: (...) loss weights  bias: (V,) or None
    loss = -sum_i w_i log softmax(h_i W^T + b)[t_i] / sum_i w_i        a 0-dim fp32 tensor

`weight` is the tied embedding or the untied unembedding; weights=None weighs every token 1; a
target whose weight is 0 may be any id (it is never read); all-zero weights give 0 and zero
gradients. Differentiable in h, weight and bias. fp32, fp16 and bf16 inputs (all three alike),
fp32 accumulation everywhere; under the Triton CPU interpreter fp32 and fp16 only (its bf16
tl.dot is wrong), as for the other kernels.

How: the tokens are processed in chunks of C rows (`chunk`; default `default_chunk`: about 2^25
logits per chunk) and the vocabulary in blocks of BLOCK_V columns. Per chunk, four kernels:

    _lce_fwd_kernel      logits tile z = h W^T + b (a GEMM over D), the tile's online-softmax
                         partials (row max, sum of exp) and the target's logit; with gradients,
                         the tile is stored to a (C, V) fp32 buffer
    _lce_lse_kernel      per row: lse from the partials, the loss term w (lse - z[t]); with
                         gradients, overwrites the row with G = w (softmax - onehot) in place
    _lce_bwd_dh_kernel   G W for the chunk's rows (a GEMM over V, split over V so the device
                         fills; fp32 partials summed in a fixed order)
    _lce_bwd_dw_kernel   G^T h added to the fp32 dW (and 1^T G to db) tile by tile: each program
                         owns its tile, so the accumulation over chunks is deterministic

The gradient pieces are formed in the forward, while the chunk's logits exist (the math in
kernels/reference.py): the backward only scales the fp32 sums by g / sum(w). Three GEMMs over
the logits, as the unfused path, and at most C x V logits alive at once. A forward without
gradients (evaluation) runs the first two kernels only and stores no logits.

Launch geometry is fixed per dtype, not timed: one candidate per kernel (`CONFIGS`, pruned for the
device by `kernels.runtime.prune_configs`), the fp16/bf16 tiles compiled spill-free and launchable
on sm_80 and sm_90 by `python -m tools.inspect`; under the interpreter `INTERPRETER_TILES`.
Layering as in the other kernel files: kernels -> `chunk_launches` (KernelLaunch records the
inspector compiles) -> `linear_cross_entropy_forward` / `_backward` -> the custom op
beside them (`lmsys::linear_cross_entropy_fwd`, its fake, `register_autograd`) ->
`linear_cross_entropy`, which checks the inputs and calls the op: the one path for callers and
tests alike. The torch definition (`linear_cross_entropy_reference`) and the chunked torch path
(`chunked_linear_cross_entropy`) are in kernels/reference.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.reference import (  # noqa: F401  (the tests import the references from here too)
    LCE_LOGITS_BUDGET,
    check_linear_cross_entropy_inputs,
    check_targets,
    chunked_linear_cross_entropy,
    lce_gradient_specs,
    lce_scale_gradients,
    linear_cross_entropy_reference,
)

__all__ = [
    "linear_cross_entropy",
    "linear_cross_entropy_fwd",
    "linear_cross_entropy_forward",
    "linear_cross_entropy_backward",
    "chunk_launches",
    "default_chunk",
    "linear_cross_entropy_reference",
    "chunked_linear_cross_entropy",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KERNEL_NAMES = ("lce_fwd", "lce_lse", "lce_bwd_dh", "lce_bwd_dw")
# Row stride of the (C, V) logits buffer: V rounded up to 16 values (64 bytes), so every row
# starts aligned and the compiler vectorises its loads (GPT-2's V = 50,257 is odd).
_ROW_ALIGN = 16


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------
#
# Per token i: z_i = h_i W^T + b (V,), lse_i = log sum_j exp(z_ij),
#   loss = sum_i w_i (lse_i - z_i[t_i]) / S,  S = max(sum_i w_i, tiny).
#
# Online log-sum-exp over vocabulary blocks: tile (i, b) gives m_ib = max_{j in b} z_ij and
# s_ib = sum_{j in b} exp(z_ij - m_ib); then M_i = max_b m_ib and
#   lse_i = M_i + log sum_b s_ib exp(m_ib - M_i).
# Every term is exp of a non-positive number: no overflow whatever the logits' size.
#
# The VJP (kernels/reference.py has the derivation): with G_ij = w_i (softmax(z_i)_j - [j == t_i]),
#   dh = g/S * G W,   dW = g/S * G^T h,   db = g/S * 1^T G.
# Rows of weight 0 are all-zero rows of G; softmax(z_i)_j = exp(z_ij - lse_i) <= 1.


@triton.jit
def _lce_fwd_kernel(
    H,  # *T: (C, D) hidden states of the chunk, unit column stride
    W,  # *T: (V, D) unembedding, unit column stride
    Bias,  # *T: (V,) unembedding bias (read only if HAS_BIAS)
    Tgt,  # *int: (C,) target ids (any id where the weight is 0)
    Z,  # *fp32: (C, V) out: logits (written only if STORE_LOGITS), row stride stride_z
    M_part,  # *fp32: (C, NB) out: max of each row over vocabulary block b
    S_part,  # *fp32: (C, NB) out: sum over block b of exp(z - that max)
    Z_tgt,  # *fp32: (C,) out: the target's logit (written by the block holding it)
    stride_h,  # int: row stride of H, in elements
    stride_w,  # int: row stride of W
    stride_z,  # int: row stride of Z
    stride_p,  # int: row stride of M_part and S_part
    n_rows,  # int: rows of this chunk (C or the last chunk's remainder)
    V,  # int: vocabulary size
    D,  # int: hidden width
    HAS_BIAS: tl.constexpr,  # add Bias
    STORE_LOGITS: tl.constexpr,  # write the tile to Z (gradients follow)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), ignored for fp16/bf16
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_V: tl.constexpr,  # vocabulary columns per tile
    BLOCK_K: tl.constexpr,  # reduction step over D
):
    """Program (p, b): logits of rows [p BLOCK_M, ...) x vocabulary block b, their partials and
    the target logits that fall in block b. Grid: (cdiv(n_rows, BLOCK_M), NB)."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_V >= 16 and BLOCK_K >= 16, "tl.dot needs tiles of >= 16")
    pid_m = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    row_mask = rows < n_rows
    col_mask = cols < V
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)  # fp32 accumulation of h W^T
    for k0 in range(0, D, BLOCK_K):
        k_mask = (k0 + ks) < D
        h = tl.load(
            H + rows64[:, None] * stride_h + (k0 + ks)[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        w_t = tl.load(
            W + cols64[None, :] * stride_w + (k0 + ks)[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # (BLOCK_K, BLOCK_V): W's tile, transposed by the addressing
        acc = tl.dot(h, w_t, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if STORE_LOGITS:
        tl.store(
            Z + rows64[:, None] * stride_z + cols64[None, :],
            acc,
            mask=row_mask[:, None] & col_mask[None, :],
        )
    z = tl.where(col_mask[None, :], acc, float("-inf"))  # padding columns take no part
    m = tl.max(z, axis=1)  # (BLOCK_M,) finite: every block has at least one real column
    s = tl.sum(tl.exp(z - m[:, None]), axis=1)  # (BLOCK_M,)
    tl.store(M_part + rows64 * stride_p + pid_v, m, mask=row_mask)
    tl.store(S_part + rows64 * stride_p + pid_v, s, mask=row_mask)
    t = tl.load(Tgt + rows, mask=row_mask, other=-1).to(tl.int64)  # (BLOCK_M,)
    hit = cols64[None, :] == t[:, None]  # (BLOCK_M, BLOCK_V): at most one column per row
    z_t = tl.sum(tl.where(hit, acc, 0.0), axis=1)  # (BLOCK_M,)
    in_block = (t >= pid_v * BLOCK_V) & (t < pid_v * BLOCK_V + BLOCK_V) & (t < V)
    tl.store(Z_tgt + rows, z_t, mask=row_mask & in_block)


@triton.jit
def _lce_lse_kernel(
    Z,  # *fp32: (C, V) logits; overwritten with G = w (softmax - onehot) if WRITE_GRAD
    M_part,  # *fp32: (C, NB) row max per vocabulary block
    S_part,  # *fp32: (C, NB) sum of exp per vocabulary block
    Z_tgt,  # *fp32: (C,) target logits
    Tgt,  # *int: (C,) target ids
    Wts,  # *fp32: (C,) loss weights (read only if HAS_WEIGHTS; else every weight is 1)
    Loss,  # *fp32: (C,) out: w (lse - z[t]), 0 where w = 0
    stride_z,  # int: row stride of Z
    stride_p,  # int: row stride of M_part and S_part
    V,  # int: vocabulary size
    n_blocks,  # int: vocabulary blocks NB of the forward kernel
    HAS_WEIGHTS: tl.constexpr,  # per-token loss weights given
    WRITE_GRAD: tl.constexpr,  # overwrite Z with G
    BLOCK_P: tl.constexpr,  # partials combined per step
    BLOCK_V: tl.constexpr,  # columns of Z per step
):
    """Program i: row i of the chunk. Grid: (n_rows,)."""
    row = tl.program_id(0).to(tl.int64)
    # lse from the partials, as running fp32 scalars: m_run = max so far, s_run = sum of exp(. - m_run).
    m_run = float("-inf")
    s_run = 0.0
    offs = tl.arange(0, BLOCK_P)
    for p0 in range(0, n_blocks, BLOCK_P):
        mask = (p0 + offs) < n_blocks
        m = tl.load(M_part + row * stride_p + p0 + offs, mask=mask, other=float("-inf"))
        s = tl.load(S_part + row * stride_p + p0 + offs, mask=mask, other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))  # finite from the first step on
        s_run = s_run * tl.exp(m_run - m_new) + tl.sum(s * tl.exp(m - m_new), axis=0)
        m_run = m_new
    lse = m_run + tl.log(s_run)
    w = 1.0
    if HAS_WEIGHTS:
        w = tl.load(Wts + row)
    z_t = tl.load(Z_tgt + row)
    # where, not a product: a weight-0 row's target logit was never written (any id is allowed)
    tl.store(Loss + row, tl.where(w != 0.0, w * (lse - z_t), 0.0))
    if WRITE_GRAD:
        t = tl.load(Tgt + row).to(tl.int64)
        cols = tl.arange(0, BLOCK_V)
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            mask = c < V
            z = tl.load(Z + row * stride_z + c, mask=mask, other=0.0)
            g = tl.exp(z - lse) - tl.where(c == t, 1.0, 0.0)  # softmax - onehot, fp32
            # Same program, same addresses, same layout as the load: each value is overwritten by
            # the thread that read it.
            tl.store(Z + row * stride_z + c, w * g, mask=mask)


@triton.jit
def _lce_bwd_dh_kernel(
    G,  # *fp32: (C, V) G of the chunk
    W,  # *T: (V, D) unembedding
    DH_part,  # *fp32: (SPLIT, C, D) out: G W over each slice of the vocabulary
    stride_g,  # int: row stride of G
    stride_w,  # int: row stride of W
    stride_ps,  # int: slice stride of DH_part
    stride_pm,  # int: row stride of DH_part
    n_rows,  # int: rows of this chunk
    V,  # int: vocabulary size
    D,  # int: hidden width
    v_per_split,  # int: vocabulary columns per slice, a multiple of BLOCK_V
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_D: tl.constexpr,  # hidden columns per tile
    BLOCK_V: tl.constexpr,  # reduction step over the vocabulary
):
    """Program (p, q, s): rows block p, hidden block q, vocabulary slice s of G W. The slices'
    fp32 partials are summed afterwards in a fixed order. Grid: (cdiv(n_rows, BLOCK_M),
    cdiv(D, BLOCK_D), SPLIT)."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_D >= 16 and BLOCK_V >= 16, "tl.dot needs tiles of >= 16")
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    dcols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    row_mask = rows < n_rows
    d_mask = dcols < D
    rows64 = rows.to(tl.int64)
    vs = tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    v_begin = pid_s * v_per_split
    v_end = tl.minimum(V, v_begin + v_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)  # fp32 accumulation of G W
    for v0 in range(v_begin, v_end, BLOCK_V):
        v_mask = (v0 + vs) < v_end
        g = tl.load(
            G + rows64[:, None] * stride_g + (v0 + vs)[None, :],
            mask=row_mask[:, None] & v_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_V) fp32
        w = tl.load(
            W + (v0 + vs).to(tl.int64)[:, None] * stride_w + dcols[None, :],
            mask=v_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # (BLOCK_V, BLOCK_D)
        acc = tl.dot(g.to(w.dtype), w, acc, input_precision=DOT_PRECISION)
    tl.store(
        DH_part + pid_s * stride_ps + rows64[:, None] * stride_pm + dcols[None, :],
        acc,
        mask=row_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _lce_bwd_dw_kernel(
    G,  # *fp32: (C, V) G of the chunk
    H,  # *T: (C, D) hidden states of the chunk
    DW,  # *fp32: (V, D) in/out: G^T h summed over the chunks so far
    DB,  # *fp32: (V,) in/out: 1^T G summed over the chunks so far (only if HAS_BIAS)
    stride_g,  # int: row stride of G
    stride_h,  # int: row stride of H
    stride_dw,  # int: row stride of DW
    n_rows,  # int: rows of this chunk
    V,  # int: vocabulary size
    D,  # int: hidden width
    HAS_BIAS: tl.constexpr,  # also accumulate DB (programs of the first hidden block write it)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs
    BLOCK_V: tl.constexpr,  # vocabulary rows per tile
    BLOCK_D: tl.constexpr,  # hidden columns per tile
    BLOCK_M: tl.constexpr,  # reduction step over the chunk's tokens
):
    """Program (b, q): the (BLOCK_V, BLOCK_D) tile of DW, plus this chunk's G^T h over all its
    tokens. One program per tile and chunks in order: deterministic, no atomics. Grid:
    (cdiv(V, BLOCK_V), cdiv(D, BLOCK_D))."""
    tl.static_assert(BLOCK_M >= 16 and BLOCK_D >= 16 and BLOCK_V >= 16, "tl.dot needs tiles of >= 16")
    pid_v = tl.program_id(0)
    pid_d = tl.program_id(1)
    vrows = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    dcols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    v_mask = vrows < V
    d_mask = dcols < D
    vrows64 = vrows.to(tl.int64)
    tile = DW + vrows64[:, None] * stride_dw + dcols[None, :]
    tile_mask = v_mask[:, None] & d_mask[None, :]
    acc = tl.load(tile, mask=tile_mask, other=0.0)  # (BLOCK_V, BLOCK_D) fp32: earlier chunks' sum
    db = tl.zeros((BLOCK_V,), dtype=tl.float32)
    ms = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    for m0 in range(0, n_rows, BLOCK_M):
        m_mask = (m0 + ms) < n_rows
        tokens64 = (m0 + ms).to(tl.int64)
        g_t = tl.load(
            G + tokens64[None, :] * stride_g + vrows64[:, None],
            mask=v_mask[:, None] & m_mask[None, :],
            other=0.0,
        )  # (BLOCK_V, BLOCK_M) fp32: G's tile, transposed by the addressing
        h = tl.load(
            H + tokens64[:, None] * stride_h + dcols[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_D)
        acc = tl.dot(g_t.to(h.dtype), h, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            db += tl.sum(g_t, axis=1)
    tl.store(tile, acc, mask=tile_mask)
    if HAS_BIAS:
        if pid_d == 0:
            tl.store(DB + vrows, tl.load(DB + vrows, mask=v_mask, other=0.0) + db, mask=v_mask)


# ---------------------------------------------------------------------------------------------
# Launch geometry
# ---------------------------------------------------------------------------------------------


# The candidate tilings of each kernel, by input width (16-bit: fp16 / bf16): {kernel name: [constexpr
# blocks and launch options]}, one each: a fixed geometry, launched as it is, not timed. The 16-bit
# GPU tiles put a 128 x 128 fp32 accumulator on 8 warps (64 values per thread) with 3 pipeline
# stages; fp32 inputs use IEEE dots on FMA units, where big tiles gain nothing. The interpreter
# pays a fixed cost per program, so its tiles are large (few programs, each a big numpy op): 5-6x
# faster than 16-row tiles at a training shape of 128 tokens x 512 words. Tests that need many
# blocks at small shapes swap in smaller ones through INTERPRETER_TILES.
CONFIGS: dict[str, dict[str, list[dict[str, int]]]] = {
    "16-bit": {
        "lce_fwd": [{"BLOCK_M": 128, "BLOCK_V": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}],
        "lce_lse": [{"BLOCK_V": 2048, "num_warps": 8}],
        "lce_bwd_dh": [{"BLOCK_M": 128, "BLOCK_D": 128, "BLOCK_V": 64, "num_warps": 8, "num_stages": 3}],
        "lce_bwd_dw": [{"BLOCK_V": 128, "BLOCK_D": 128, "BLOCK_M": 64, "num_warps": 8, "num_stages": 3}],
    },
    "fp32": {
        "lce_fwd": [{"BLOCK_M": 64, "BLOCK_V": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}],
        "lce_lse": [{"BLOCK_V": 2048, "num_warps": 8}],
        "lce_bwd_dh": [{"BLOCK_M": 64, "BLOCK_D": 64, "BLOCK_V": 32, "num_warps": 4, "num_stages": 2}],
        "lce_bwd_dw": [{"BLOCK_V": 64, "BLOCK_D": 64, "BLOCK_M": 32, "num_warps": 4, "num_stages": 2}],
    },
}
INTERPRETER_TILES: dict[str, dict[str, int]] = {
    "lce_fwd": {"BLOCK_M": 64, "BLOCK_V": 64, "BLOCK_K": 32},
    "lce_lse": {"BLOCK_V": 2048},
    "lce_bwd_dh": {"BLOCK_M": 64, "BLOCK_D": 64, "BLOCK_V": 32},
    "lce_bwd_dw": {"BLOCK_V": 64, "BLOCK_D": 64, "BLOCK_M": 32},
}
_MAX_BLOCK_P = 1024  # partials combined per step by _lce_lse_kernel


def _shared_bytes(name: str, dtype: torch.dtype) -> Callable[[triton.Config], int]:
    """Shared memory a tiling of kernel `name` needs, estimated from the tiles its loop streams
    (`num_stages` copies of each; G is fp32), or for the row kernel its reductions' scratch (two
    fp32 values per warp): an upper bound of what the compiler allocates."""
    if name == "lce_lse":
        return lambda c: 2 * 4 * c.num_warps
    elem = torch.empty((), dtype=dtype).element_size()
    streamed = {  # bytes of one loop step's tiles
        "lce_fwd": lambda b: (b["BLOCK_M"] + b["BLOCK_V"]) * b["BLOCK_K"] * elem,
        "lce_bwd_dh": lambda b: b["BLOCK_M"] * b["BLOCK_V"] * 4 + b["BLOCK_V"] * b["BLOCK_D"] * elem,
        "lce_bwd_dw": lambda b: b["BLOCK_V"] * b["BLOCK_M"] * 4 + b["BLOCK_M"] * b["BLOCK_D"] * elem,
    }[name]
    return lambda c: c.num_stages * streamed(c.kwargs)


def tiles(dtype: torch.dtype, device: runtime.DeviceLimits | None = None) -> dict[str, dict[str, int]]:
    """The tiling of every kernel for inputs of `dtype`: the interpreter's under the interpreter,
    else the first candidate that fits `device` (`runtime.prune_configs`; None: the first)."""
    if runtime.interpreting():
        return {name: dict(t) for name, t in INTERPRETER_TILES.items()}
    chosen = {}
    for name, candidates in CONFIGS["fp32" if dtype == torch.float32 else "16-bit"].items():
        configs = [runtime.config(t) for t in candidates]
        if device is not None:
            configs = runtime.prune_configs(configs, device, _shared_bytes(name, dtype))
        chosen[name] = {
            **configs[0].kwargs,
            "num_warps": configs[0].num_warps,
            "num_stages": configs[0].num_stages,
        }
    return chosen


def default_chunk(n: int, v: int, block_m: int = 128) -> int:
    """Tokens per chunk: a power of two with about LCE_LOGITS_BUDGET logits (2^25 fp32: 128 MiB;
    512 tokens at GPT-2's vocabulary), at least one row tile, at most what the tokens need."""
    budget = max(1, LCE_LOGITS_BUDGET // max(v, 1))
    chunk = max(block_m, 1 << (budget.bit_length() - 1))
    return max(1, min(chunk, triton.next_power_of_2(max(n, 1))))


def _dh_split(c: int, d: int, v: int, t: dict[str, int], sm_count: int | None) -> tuple[int, int]:
    """(SPLIT, columns per slice) of G W: the vocabulary is split until about two programs per SM
    (four under the interpreter) have work; a chunk alone has few row x hidden tiles."""
    tiles_md = triton.cdiv(c, t["BLOCK_M"]) * triton.cdiv(d, t["BLOCK_D"])
    target = 2 * sm_count if sm_count is not None else 4
    split = max(1, min(triton.cdiv(v, t["BLOCK_V"]), triton.cdiv(target, tiles_md)))
    per_split = triton.cdiv(triton.cdiv(v, split), t["BLOCK_V"]) * t["BLOCK_V"]
    return triton.cdiv(v, per_split), per_split


@dataclass
class ChunkBuffers:
    """The per-chunk scratch, allocated once for C rows and reused by every chunk."""

    logits: torch.Tensor | None  # (C, V) fp32 view of a (C, V rounded up to 16) buffer; then G
    m_part: torch.Tensor  # (C, NB) fp32 row max per vocabulary block
    s_part: torch.Tensor  # (C, NB) fp32 sum of exp per vocabulary block
    z_target: torch.Tensor  # (C,) fp32 target logits
    dh_part: torch.Tensor | None  # (SPLIT, C, D) fp32 slices of G W
    dh_split: int
    v_per_split: int
    tiles: dict[str, dict[str, int]]  # the kernels' tiling, which the buffers' shapes follow


def chunk_buffers(
    c: int, d: int, v: int, dtype: torch.dtype, device: torch.device | str, needs_dh: bool, grads: bool,
    gpu: runtime.DeviceLimits | None,
) -> ChunkBuffers:  # fmt: skip
    """Scratch for chunks of `c` rows (`grads`: any gradient wanted; `needs_dh`: dh among them)
    on `gpu` (None: the interpreter)."""
    t = tiles(dtype, gpu)
    n_blocks = triton.cdiv(v, t["lce_fwd"]["BLOCK_V"])
    align = lambda x: triton.cdiv(x, _ROW_ALIGN) * _ROW_ALIGN
    logits = None
    if grads:
        logits = torch.empty((c, align(v)), dtype=torch.float32, device=device)[:, :v]
    split, per_split = _dh_split(c, d, v, t["lce_bwd_dh"], gpu.sm_count if gpu is not None else None)
    dh_part = torch.empty((split, c, d), dtype=torch.float32, device=device) if needs_dh else None
    return ChunkBuffers(
        logits=logits,
        m_part=torch.empty((c, align(n_blocks)), dtype=torch.float32, device=device)[:, :n_blocks],
        s_part=torch.empty((c, align(n_blocks)), dtype=torch.float32, device=device)[:, :n_blocks],
        z_target=torch.empty((c,), dtype=torch.float32, device=device),
        dh_part=dh_part,
        dh_split=split,
        v_per_split=per_split,
        tiles=t,
    )


def chunk_launches(
    h: torch.Tensor,  # (c, D) this chunk's hidden states, unit column stride
    weight: torch.Tensor,  # (V, D) unit column stride
    bias: torch.Tensor | None,  # (V,) contiguous
    targets: torch.Tensor,  # (c,) ids
    weights: torch.Tensor | None,  # (c,) fp32 loss weights
    loss: torch.Tensor,  # (c,) fp32 out: per-token loss terms
    buffers: ChunkBuffers,
    dw: torch.Tensor | None,  # (V, D) fp32 in/out: G^T h so far (None: not wanted)
    db: torch.Tensor | None,  # (V,) fp32 in/out: 1^T G so far (None: not wanted)
    needs_dh: bool,  # G W into buffers.dh_part
) -> list[runtime.KernelLaunch]:
    """The launches of one chunk, in order: logits and partials, lse and G, then G W and G^T h
    (those two only when gradients are wanted). The rows beyond the chunk's are masked."""
    c, d = h.shape
    v = weight.shape[0]
    grads = buffers.logits is not None
    precision = "ieee" if h.dtype == torch.float32 else "tf32"
    logits = buffers.logits if grads else buffers.m_part  # any fp32 pointer when not stored
    fwd, lse, dh_t, dw_t = (buffers.tiles[name] for name in KERNEL_NAMES)
    n_blocks = buffers.m_part.shape[1]
    launches = [
        runtime.KernelLaunch(
            name="lce_fwd",
            kernel=_lce_fwd_kernel,
            grid=(triton.cdiv(c, fwd["BLOCK_M"]), n_blocks),
            args=(
                h,
                weight,
                bias if bias is not None else weight,
                targets,
                logits,
                buffers.m_part,
                buffers.s_part,
                buffers.z_target,
                h.stride(0),
                weight.stride(0),
                logits.stride(0),
                buffers.m_part.stride(0),
                c,
                v,
                d,
            ),
            kwargs={"HAS_BIAS": bias is not None, "STORE_LOGITS": grads, "DOT_PRECISION": precision},
            configs=[runtime.config(fwd)],
        ),
        runtime.KernelLaunch(
            name="lce_lse",
            kernel=_lce_lse_kernel,
            grid=(c,),
            args=(
                logits,
                buffers.m_part,
                buffers.s_part,
                buffers.z_target,
                targets,
                weights if weights is not None else buffers.z_target,
                loss,
                logits.stride(0),
                buffers.m_part.stride(0),
                v,
                n_blocks,
            ),
            kwargs={
                "HAS_WEIGHTS": weights is not None,
                "WRITE_GRAD": grads,
                "BLOCK_P": min(_MAX_BLOCK_P, triton.next_power_of_2(n_blocks)),
            },
            configs=[runtime.config(lse)],
        ),
    ]
    if grads and needs_dh:
        part = buffers.dh_part
        launches.append(
            runtime.KernelLaunch(
                name="lce_bwd_dh",
                kernel=_lce_bwd_dh_kernel,
                grid=(triton.cdiv(c, dh_t["BLOCK_M"]), triton.cdiv(d, dh_t["BLOCK_D"]), buffers.dh_split),
                args=(
                    logits,
                    weight,
                    part,
                    logits.stride(0),
                    weight.stride(0),
                    part.stride(0),
                    part.stride(1),
                    c,
                    v,
                    d,
                    buffers.v_per_split,
                ),
                kwargs={"DOT_PRECISION": precision},
                configs=[runtime.config(dh_t)],
            )
        )
    if grads and dw is not None:
        launches.append(
            runtime.KernelLaunch(
                name="lce_bwd_dw",
                kernel=_lce_bwd_dw_kernel,
                grid=(triton.cdiv(v, dw_t["BLOCK_V"]), triton.cdiv(d, dw_t["BLOCK_D"])),
                args=(
                    logits,
                    h,
                    dw,
                    db if db is not None else dw,
                    logits.stride(0),
                    h.stride(0),
                    dw.stride(0),
                    c,
                    v,
                    d,
                ),
                kwargs={"HAS_BIAS": db is not None, "DOT_PRECISION": precision},
                configs=[runtime.config(dw_t)],
            )
        )
    return launches


# ---------------------------------------------------------------------------------------------
# Host side: checks, launchers
# ---------------------------------------------------------------------------------------------


def _check(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor | None,
    bias: torch.Tensor | None,
    chunk: int | None,
) -> None:
    check_linear_cross_entropy_inputs(h, weight, targets, weights, bias, chunk, SUPPORTED_DTYPES)
    if h.device.type != "cuda" and not runtime.interpreting():
        raise ValueError(
            f"linear_cross_entropy: Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for the CPU "
            f"interpreter (set before triton is imported); got tensors on {h.device}"
        )
    if h.device.type == "cpu" and h.dtype == torch.bfloat16:
        # The interpreter's bf16 tl.dot returns garbage, not an error of its own.
        raise TypeError(
            "linear_cross_entropy: torch.bfloat16 is not supported on CPU tensors (the Triton interpreter "
            "cannot multiply bf16); use torch.float32 or torch.float16 on CPU, bf16 on CUDA"
        )


def linear_cross_entropy_forward(
    h: torch.Tensor,  # (N, D)
    weight: torch.Tensor,  # (V, D)
    targets: torch.Tensor,  # (N,) ids
    weights: torch.Tensor | None = None,  # (N,) loss weights
    bias: torch.Tensor | None = None,  # (V,)
    *,
    chunk: int | None = None,
    needs: tuple[bool, bool, bool] = (False, False, False),  # gradients wanted for (h, weight, bias)
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """Launch the kernels chunk by chunk. Returns (loss, S, (G W, G^T h, 1^T G)): the 0-dim fp32
    loss, its denominator S = max(sum(w), tiny), and the fp32 gradient sums of `needs` (else None)."""
    _check(h, weight, targets, weights, bias, chunk)
    n, d = h.shape
    v = weight.shape[0]
    w_all = weights.float().contiguous() if weights is not None else None  # (N,)
    check_targets(targets, w_all, v)
    device = h.device
    denominator = (w_all.sum() if w_all is not None else torch.tensor(float(n), device=device)).clamp_min(
        torch.finfo(torch.float32).tiny
    )
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    grads = need_h or need_w or need_b
    h = h if h.stride(-1) == 1 else h.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    targets = targets.contiguous()
    gpu = runtime.device_limits(device)
    c = chunk or default_chunk(n, v, tiles(h.dtype, gpu)["lce_fwd"]["BLOCK_M"])
    dh = torch.empty((n, d), dtype=torch.float32, device=device) if need_h else None  # G W
    dw = torch.zeros((v, d), dtype=torch.float32, device=device) if (need_w or need_b) else None  # G^T h
    db = torch.zeros((v,), dtype=torch.float32, device=device) if need_b else None  # 1^T G
    per_token = torch.zeros((n,), dtype=torch.float32, device=device)  # w (lse - z[t])
    if n > 0:
        buffers = chunk_buffers(min(c, n), d, v, h.dtype, device, need_h, grads, gpu)
        for start in range(0, n, c):
            end = min(n, start + c)
            launches = chunk_launches(
                h[start:end],
                weight,
                bias,
                targets[start:end],
                w_all[start:end] if w_all is not None else None,
                per_token[start:end],
                buffers,
                dw,
                db,
                need_h,
            )
            for launch in launches:
                launch.run()
            if need_h:  # the slices of G W in a fixed order: deterministic
                torch.sum(buffers.dh_part[:, : end - start], dim=0, out=dh[start:end])
    loss = per_token.sum() / denominator
    return loss, denominator, (dh, dw if need_w else None, db)


def linear_cross_entropy_backward(
    grad_loss: torch.Tensor,  # 0-dim
    denominator: torch.Tensor,  # 0-dim fp32: S from the forward
    sums: tuple[torch.Tensor | None, ...],  # fp32 (G W, G^T h, 1^T G) from the forward
    specs: tuple[tuple[torch.Size, torch.dtype] | None, ...],  # (shape, dtype) of h, weight, bias
) -> tuple[torch.Tensor | None, ...]:
    """(dh, dweight, dbias) = g/S times the forward's sums, in the inputs' shapes and dtypes."""
    return lce_scale_gradients(grad_loss, denominator, sums, specs)


# ---------------------------------------------------------------------------------------------
# The custom op and the public function
# ---------------------------------------------------------------------------------------------
# `lmsys::linear_cross_entropy_fwd` returns the loss, its denominator and the fp32 gradient sums
# the forward forms while the logits exist (an empty tensor for a sum not needed: a custom op
# cannot return None); `register_autograd` saves them, and the backward only scales them
# (`linear_cross_entropy_backward`, plain torch: no backward op).

_EMPTY = (0,)  # the shape that stands for "not needed"


@torch.library.custom_op("lmsys::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(
    h: torch.Tensor,  # (N, D)
    weight: torch.Tensor,  # (V, D)
    targets: torch.Tensor,  # (N,)
    weights: torch.Tensor | None,  # (N,)
    bias: torch.Tensor | None,  # (V,)
    chunk: int,  # tokens per chunk; 0: default_chunk
    need_h: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, S, G W, G^T h, 1^T G): `linear_cross_entropy_forward` as an op, the sums formed
    only for the inputs that need a gradient (empty otherwise)."""
    loss, denominator, sums = linear_cross_entropy_forward(
        h, weight, targets, weights, bias, chunk=chunk or None, needs=(need_h, need_w, need_b)
    )
    empty = h.new_empty(_EMPTY, dtype=torch.float32)
    return (loss, denominator, *(s if s is not None else empty.clone() for s in sums))


@linear_cross_entropy_fwd.register_fake
def _(h, weight, targets, weights, bias, chunk, need_h, need_w, need_b):
    f32 = torch.float32
    scalar = h.new_empty((), dtype=f32)
    dh = h.new_empty(h.shape if need_h else _EMPTY, dtype=f32)
    dw = h.new_empty(weight.shape if need_w else _EMPTY, dtype=f32)
    db = h.new_empty((weight.shape[0],) if need_b and bias is not None else _EMPTY, dtype=f32)
    return scalar, scalar.clone(), dh, dw, db


def _lce_setup(ctx, inputs, output) -> None:
    h, weight, _, _, bias, _, need_h, need_w, need_b = inputs
    _, denominator, dh, dw, db = output
    ctx.save_for_backward(denominator, dh, dw, db)
    ctx.needs = (need_h, need_w, need_b and bias is not None)
    ctx.specs = tuple(
        spec if need else None
        for spec, need in zip(lce_gradient_specs(h, weight, bias), ctx.needs, strict=True)
    )


def _lce_backward(ctx, grad_loss, _ds, _ddh, _ddw, _ddb):
    denominator, *sums = ctx.saved_tensors
    sums = tuple(s if need else None for s, need in zip(sums, ctx.needs, strict=True))
    dh, dweight, dbias = linear_cross_entropy_backward(grad_loss, denominator, sums, ctx.specs)
    return dh, dweight, None, None, dbias, None, None, None, None


linear_cross_entropy_fwd.register_autograd(_lce_backward, setup_context=_lce_setup)


def linear_cross_entropy(
    h: torch.Tensor,  # (..., D)
    weight: torch.Tensor,  # (V, D)
    targets: torch.Tensor,  # (...) ids in [0, V) (any id where the weight is 0)
    weights: torch.Tensor | None = None,  # (...) loss weights
    bias: torch.Tensor | None = None,  # (V,)
    *,
    chunk: int | None = None,  # tokens per chunk; None: default_chunk (about 2^25 logits)
) -> torch.Tensor:  # 0-dim fp32
    """-sum(w log softmax(h W^T + b)[t]) / sum(w) over every token, without the (N, V) logits.

    Runs the custom op `lmsys::linear_cross_entropy_fwd` on the flattened tokens; the gradient
    sums are formed in the forward only for the inputs that need a gradient."""
    _check(h, weight, targets, weights, bias, chunk)
    grad = torch.is_grad_enabled()
    need_h, need_w, need_b = (grad and t is not None and t.requires_grad for t in (h, weight, bias))
    d = h.shape[-1]
    flat_weights = weights.reshape(-1) if weights is not None else None
    outputs = linear_cross_entropy_fwd(
        h.reshape(-1, d), weight, targets.reshape(-1), flat_weights, bias, chunk or 0, need_h, need_w, need_b
    )
    return outputs[0]
