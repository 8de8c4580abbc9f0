"""FlashAttention-2 forward and backward as Triton kernels, with a plain torch reference.

    flash_attention(q, k, v, causal=True, scale=None, documents=None) -> o   # differentiable
    q: (B, H, T, d_qk)   k: (B, H_kv, T, d_qk)   v: (B, H_kv, T, d_vo)   o: (B, H, T, d_vo)
    documents: (B, T) integer ids, non-decreasing along each row, or None

Grouped-query attention: H_kv divides H and query head h reads key/value head h // (H / H_kv)
(H_kv = H: plain multi-head attention; H_kv = 1: multi-query). Packed documents: key j is visible
to query i only inside i's document (a run of equal ids), and the kernels skip every tile that
lies wholly outside the rows' documents ("Documents" below).

Head widths d_qk and d_vo are independent, 1..256 each (non-powers of two are padded inside the
kernel to the next power of two and masked); T is any length >= 1; inputs may be non-contiguous
(strides are passed to the kernels). fp32, fp16 and bf16 inputs accumulate in fp32. fp32 inputs
use IEEE fp32 dot products, not TF32, so fp32 results match the fp32 reference.

Layering, as in the other kernel files: private `@triton.jit` kernels -> host launchers
`flash_attention_forward` / `flash_attention_backward` -> the custom op beside them
(`lmsys::flash_attention_fwd` / `_bwd`, their fakes, `register_autograd`) -> `flash_attention`,
which checks the inputs and calls the op: the one path for callers and tests alike.
`attention_reference` (kernels/reference.py) is the readable torch definition the kernels are
tested against.

The launchers first build `KernelLaunch` records (`forward_launch`, `backward_launches`), then
run them; `python -m tools.inspect` compiles the same records for sm_80 / sm_90 without a GPU.

On a GPU every kernel is wrapped in `triton.autotune` (keyed on the shapes that change the best
tiling). It times the candidates listed below for the head width and GPU generation (those
`python -m tools.inspect` compiled without spilling on sm_80 and sm_90) that fit the device's
shared memory (`prune_configs`, through `kernels.runtime.prune_configs`). On sm_90 the operands a
kernel streams (K and V for the forward and dQ, Q and dO for dK/dV) are read through TMA tensor
descriptors when their layout allows (16-byte aligned base and strides, unit last stride);
elsewhere, and on sm_80, through pointers (cp.async). Under the Triton CPU
interpreter (TRITON_INTERPRET=1) tuning would run every config through a Python emulator, so
one small fixed tiling (`INTERPRETER_TILES`) is used instead; the kernel code is the same on
both, and the interpreter also runs the descriptor path (tests/unit/kernels/test_attention_paths.py).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.reference import attention_reference  # noqa: F401  (imported from here by the tests)

try:  # host-side TMA descriptors, triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: every launch takes the pointer path
    TensorDescriptor = None

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634  # log2(e): the kernels work with exp2, which maps to one hardware instruction

# Fixed tiling used under the interpreter, whose cost grows with the number of loop steps. Tests
# swap in 16-row and unequal blocks to exercise the multi-block loop bounds on short sequences.
INTERPRETER_TILES: dict[str, dict[str, int]] = {
    "fwd": {"BLOCK_M": 32, "BLOCK_N": 32},
    "preprocess": {"BLOCK_M": 32},
    "dkdv": {"BLOCK_M": 32, "BLOCK_N": 32},
    "dq": {"BLOCK_M": 32, "BLOCK_N": 32},
}


# ----------------------------------------------------------------------------------------------
# The math.
#
# Per (batch, head), with scale c, logits and probabilities (masked entries: S = -inf, P = 0):
#   S = c * Q K^T                      (T, T)
#   P = softmax_rows(S)                (T, T)
#   O = P V                            (T, d_vo)
#
# Forward, online softmax (FlashAttention-2). A program owns a block of query rows and streams
# key blocks j, keeping per row a running max m, a running denominator l and an unnormalised
# accumulator acc:
#   m_new = max(m, rowmax(S_j))
#   alpha = exp(m - m_new)                         rescales what was summed under the old max
#   P~_j  = exp(S_j - m_new)
#   l     = alpha * l + rowsum(P~_j)
#   acc   = alpha * acc + P~_j V_j
# and at the end O = acc / l, LSE = m + log(l) (saved: P can be rebuilt as exp(S - LSE) without
# storing the T x T matrix). The kernels use base 2: S2 = S * log2(e), exp2 instead of exp, and
# LSE is stored in the same base-2 units (LSE2 = LSE * log2(e)). The scale is folded into the
# exponent: with a = |c| log2(e) and the raw dot X = Q K^T, rowmax(a X) = a rowmax(X) and
# P~ = exp2(a X - m) is one FFMA per element; a negative c runs as |c| with -Q.
#
# Backward, the VJP. Given dO = dL/dO:
#   dV = P^T dO                        (T, d_vo)
#   dP = dO V^T                        (T, T)
#   dS = P * (dP - delta),   delta_i = sum_j P_ij dP_ij = sum_j P_ij (dO_i . V_j) = dO_i . O_i
#   dQ = c * dS K                      (T, d_qk)
#   dK = c * dS^T Q                    (T, d_qk)
# (softmax Jacobian: dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik)). delta is a row-wise dot product of
# two (T, d_vo) matrices, computed once by a preprocess kernel instead of from the T x T dP.
#
# No atomics: dK, dV are sums over query rows, dQ is a sum over key rows. One kernel owns a key
# block and loops over query blocks (dK, dV stay in registers), another owns a query block and
# loops over key blocks (dQ stays in registers). P and dS are recomputed in both, which costs one
# extra Q K^T and dO V^T but makes the result deterministic (fixed summation order).
#
# Causal: key j is visible to query i iff j <= i. Each loop is split into blocks that need no
# mask at all (fully visible, fully inside T) and the few blocks on the diagonal or at the tail
# of T that do; the MASKED constexpr compiles the two loop bodies separately.
#
# Grouped-query attention: the forward and dQ programs of query head h read K/V head h // GROUP;
# a dK/dV program owns a key block of one K/V head and streams the query blocks of each of its
# GROUP query heads in turn: dK, dV are sums over all of them in a fixed order, still no atomics.
#
# Documents: with start[t], end[t] the bounds of token t's document, key j is visible to query i
# iff start[i] <= j < end[i] (and j <= i when causal). Rows are non-decreasing in document, so
# start and end are non-decreasing in t and a block's range of visible keys is bounded by its
# first and last rows: a query block [m0, m1) needs keys from start[m0] to the causal end (not
# causal: end[m1 - 1]), and a key block [n0, n1) is needed by queries up to end[n1 - 1] (not
# causal: from start[n0]). Blocks inside every row's document (keys from start[m1 - 1] on, before
# end[m0]) run unmasked; the boundary blocks before and after them are masked; nothing else is
# visited (`_query_block_keys`, `_key_block_queries`).
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(
    ptrs,  # (R, BLOCK_D) pointers
    rows,  # (R,) int32 row indices, for the row mask
    cols,  # (BLOCK_D,) int32 column indices: arange(0, BLOCK_D)
    T,  # int: valid rows are < T
    D: tl.constexpr,  # valid columns are < D
    BLOCK_D: tl.constexpr,  # padded width, a power of two >= D
    CHECK_ROWS: tl.constexpr,  # False where the caller knows every row is < T
):
    """(R, BLOCK_D) tile, zero outside the valid rows/columns, so padding adds nothing to dots.

    The masks are compile-time optional: an all-true mask would still cost vectorised loads."""
    if CHECK_ROWS:
        if BLOCK_D == D:
            tile = tl.load(ptrs, mask=rows[:, None] < T, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < T) & (cols[None, :] < D), other=0.0)
    else:
        if BLOCK_D == D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=cols[None, :] < D, other=0.0)
    return tile


@triton.jit
def _store_tile(
    ptrs,  # (R, BLOCK_D) pointers
    tile,  # (R, BLOCK_D) values, already in the destination dtype
    rows,  # (R,) int32 row indices
    cols,  # (BLOCK_D,) int32 column indices
    T,  # int: rows >= T are padding and are not written
    D: tl.constexpr,  # columns >= D are padding and are not written
):
    tl.store(ptrs, tile, mask=(rows[:, None] < T) & (cols[None, :] < D))


@triton.jit
def _load_rows(
    ptrs,  # (R, BLOCK_D) pointers to the R rows starting at row `start`, or unused with DESC
    desc,  # TensorDescriptor over (B, H, T, D), block (1, 1, R, BLOCK_D), or None
    off_b,  # int32 batch index (descriptor coordinates)
    off_h,  # int32 head index
    start,  # int32 first row
    rows,  # (R,) int32 row indices start + arange(0, R), for the row mask
    cols,  # (BLOCK_D,) int32 column indices
    T,  # int: valid rows are < T
    R: tl.constexpr,  # rows of the tile
    D: tl.constexpr,  # valid columns are < D
    BLOCK_D: tl.constexpr,  # padded width
    CHECK_ROWS: tl.constexpr,  # False where every row is < T
    TMA: tl.constexpr,  # load through `desc` (a TMA bulk copy on sm_90) instead of `ptrs`
):
    """(R, BLOCK_D) tile of a streamed operand, zero outside the valid rows/columns. A descriptor
    copy zero-fills whatever lies outside (T, D) itself: no mask, no per-thread addresses."""
    if TMA:
        tile = desc.load([off_b, off_h, start, 0]).reshape(R, BLOCK_D)
    else:
        tile = _load_tile(ptrs, rows, cols, T, D, BLOCK_D, CHECK_ROWS)
    return tile


@triton.jit
def _document_visible(
    cols,  # (BLOCK_N,) int32 key rows
    rows,  # (BLOCK_M,) int32 query rows
    doc_lo,  # (BLOCK_M,) int32 first key of each query's document
    doc_hi,  # (BLOCK_M,) int32 end (exclusive) of each query's document
    T,  # int: sequence length
    CAUSAL: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) bool: key j is visible to query i, in i's document (and j <= i)."""
    visible = (cols[None, :] < T) & (cols[None, :] >= doc_lo[:, None])
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None])
    else:
        visible = visible & (cols[None, :] < doc_hi[:, None])
    return visible


@triton.jit
def _tiles(lo, hi, STEP: tl.constexpr):
    """Steps of `range(lo, hi, STEP)`: the tiles a loop over [lo, hi) visits."""
    return (tl.maximum(hi - lo, 0) + STEP - 1) // STEP


@triton.jit
def _query_block_keys(
    DOC_START,  # pointer: (B, T) int32 first token of each token's document, or None
    DOC_END,  # pointer: (B, T) int32 end (exclusive) of each token's document, or None
    off_b,  # int64 batch index
    start_m,  # int32 first query row of the block
    T,  # int: sequence length
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """The key blocks a query block visits, as (lo, full_lo, full_hi, hi): [lo, full_lo) and
    [full_hi, hi) need a mask, [full_lo, full_hi) none (every key visible to every row, inside T).

    Causal: keys up to the diagonal; else every key. With documents the range starts at the
    block's first query's document start (no earlier key is visible to any of its rows) and,
    not causal, ends at its last query's document end; a key block needs no mask when it lies
    inside every row's document: at or after the last row's document start, before the first
    row's document end."""
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, T)
        # key block [n, n + BLOCK_N) is visible to every row iff n + BLOCK_N <= start_m + 1
        full_hi = ((start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = T
        full_hi = (T // BLOCK_N) * BLOCK_N
    lo = 0
    full_lo = 0
    if HAS_DOCS:
        docs = DOC_START + off_b * T
        last_m = tl.minimum(start_m + BLOCK_M, T) - 1
        lo = (tl.load(docs + start_m) // BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.cdiv(tl.load(docs + last_m), BLOCK_N) * BLOCK_N, hi)
        ends = DOC_END + off_b * T
        if not CAUSAL:
            hi = tl.load(ends + last_m)
        full_hi = tl.maximum(tl.minimum(full_hi, (tl.load(ends + start_m) // BLOCK_N) * BLOCK_N), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _key_block_queries(
    DOC_START,  # pointer: (B, T) int32 first token of each token's document, or None
    DOC_END,  # pointer: (B, T) int32 end (exclusive) of each token's document, or None
    off_b,  # int64 batch index
    start_n,  # int32 first key row of the block
    T,  # int: sequence length
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """The query blocks a key block visits, as (lo, mid_lo, mid_hi, end): [lo, min(mid_lo, end))
    straddle the diagonal or the block's documents' starts, [mid_lo, mid_hi) need no mask,
    [max(mid_lo, mid_hi), end) hold the tail of T or of the documents (or are still on the
    diagonal). With documents the range ends at the block's last key's document end and, not
    causal, starts at its first key's document start."""
    end = tl.cdiv(T, BLOCK_M) * BLOCK_M
    mid_hi = (T // BLOCK_M) * BLOCK_M
    lo = 0
    mid_lo = 0
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M  # earlier query blocks see none of these keys
        # first block whose first row is >= the block's last key row
        mid_lo = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    if HAS_DOCS:
        last_n = tl.minimum(start_n + BLOCK_N, T) - 1
        starts = DOC_START + off_b * T
        ends = DOC_END + off_b * T
        end = tl.load(ends + last_n)
        mid_hi = (tl.load(ends + start_n) // BLOCK_M) * BLOCK_M
        if not CAUSAL:  # causal: a key's own document starts at or before it
            lo = (tl.load(starts + start_n) // BLOCK_M) * BLOCK_M
            mid_lo = tl.cdiv(tl.load(starts + last_n), BLOCK_M) * BLOCK_M
    return lo, mid_lo, mid_hi, end


@triton.jit
def _attn_fwd_inner(
    acc,  # (BLOCK_M, BLOCK_DVO) fp32 unnormalised output
    l_i,  # (BLOCK_M,) fp32 running softmax denominator
    m_i,  # (BLOCK_M,) fp32 running row max of the base-2 logits
    q,  # (BLOCK_M, BLOCK_DQK) query tile, input dtype (negated when the scale is negative)
    k_ptrs,  # (BLOCK_N, BLOCK_DQK) pointers to K[b, h, 0:BLOCK_N, :], advanced by the loop
    v_ptrs,  # (BLOCK_N, BLOCK_DVO) pointers to V[b, h, 0:BLOCK_N, :]
    k_desc,  # TensorDescriptor of K, or None (KV_TMA False)
    v_desc,  # TensorDescriptor of V, or None
    off_b,  # int32 batch index
    off_h,  # int32 head index
    stride_kt,  # K stride over T
    stride_vt,  # V stride over T
    offs_m,  # (BLOCK_M,) query row indices of this program
    offs_dqk,  # (BLOCK_DQK,) arange
    offs_dvo,  # (BLOCK_DVO,) arange
    T,  # int: sequence length
    qk_scale,  # fp32 >= 0: |softmax scale| * log2(e)
    lo,  # first key row of the loop (multiple of BLOCK_N)
    hi,  # loop end (exclusive)
    doc_lo,  # (BLOCK_M,) int32 first key of each row's document (DOCS only)
    doc_hi,  # (BLOCK_M,) int32 end of each row's document (DOCS only)
    D_QK: tl.constexpr,
    D_VO: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DVO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key in [lo, hi) is < T and visible to every row
    KV_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOCS: tl.constexpr = False,  # the masked blocks also hide keys outside each row's document
):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key rows
        k = _load_rows(
            k_ptrs + start_n * stride_kt, k_desc, off_b, off_h, start_n, cols, offs_dqk, T,
            BLOCK_N, D_QK, BLOCK_DQK, MASKED, KV_TMA,
        )  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) unscaled logits
        if MASKED and DOCS:
            visible = _document_visible(cols, offs_m, doc_lo, doc_hi, T, CAUSAL)
            s = tl.where(visible, qk * qk_scale, float("-inf"))  # (BLOCK_M, BLOCK_N) base-2 logits
            # A boundary block may hide every key from a row that has seen none yet: its max is
            # then -inf, and 0 stands in for it so that exp2(-inf - 0) = 0 rather than NaN.
            m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
        elif MASKED:
            visible = cols[None, :] < T
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None])
            # Key 0 is visible to every row (also padding rows), so the first block always gives
            # a finite max and later all-masked rows give exp2(-inf) = 0, never NaN.
            s = tl.where(visible, qk * qk_scale, float("-inf"))  # (BLOCK_M, BLOCK_N) base-2 logits
            m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
            p = tl.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
        else:
            # The scale is folded into the exponent: qk_scale >= 0, so the max of the scaled
            # logits is the scaled max, and exp2(qk * qk_scale - m) is one FFMA and one MUFU.EX2
            # per element instead of a separate multiply.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # (BLOCK_M,)
            p = tl.exp2(qk * qk_scale - m_new[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.exp2(m_i - m_new)  # (BLOCK_M,) 0 on the first block, where m_i = -inf
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(
            v_ptrs + start_n * stride_vt, v_desc, off_b, off_h, start_n, cols, offs_dvo, T,
            BLOCK_N, D_VO, BLOCK_DVO, MASKED, KV_TMA,
        )  # fmt: skip
        # P goes to the dot in the input dtype (as V), accumulation stays fp32.
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q,  # pointer: (B, H, T, D_QK), input dtype
    K,  # pointer: (B, H, T, D_QK), input dtype
    V,  # pointer: (B, H, T, D_VO), input dtype
    O,  # pointer: (B, H, T, D_VO) output, input dtype
    LSE,  # pointer: (B, H, T) contiguous fp32 output, base-2 log-sum-exp of each row's logits
    K_DESC,  # TensorDescriptor of K (B, H, T, D_QK), block (1, 1, BLOCK_N, BLOCK_DQK); None: use K
    V_DESC,  # TensorDescriptor of V (B, H, T, D_VO), block (1, 1, BLOCK_N, BLOCK_DVO); None: use V
    DOC_START,  # pointer: (B, T) int32 first token of each token's document; None without documents
    DOC_END,  # pointer: (B, T) int32 end (exclusive) of each token's document; None without documents
    TILES,  # pointer: int32 out, the tiles each program visits (COUNT_TILES only; else None)
    stride_qb,  # Q stride over B
    stride_qh,  # Q stride over H
    stride_qt,  # Q stride over T
    stride_qd,  # Q stride over d_qk
    stride_kb,  # K stride over B
    stride_kh,  # K stride over H
    stride_kt,  # K stride over T
    stride_kd,  # K stride over d_qk
    stride_vb,  # V stride over B
    stride_vh,  # V stride over H
    stride_vt,  # V stride over T
    stride_vd,  # V stride over d_vo
    stride_ob,  # O stride over B
    stride_oh,  # O stride over H
    stride_ot,  # O stride over T
    stride_od,  # O stride over d_vo
    H,  # int: number of heads
    T,  # int: sequence length
    T_BUCKET,  # int: next_power_of_2(T); unused in the body, an autotune key only
    qk_scale,  # fp32 >= 0: |softmax scale| * log2(e)
    D_QK: tl.constexpr,  # q/k head width
    D_VO: tl.constexpr,  # v/o head width
    BLOCK_DQK: tl.constexpr,  # D_QK padded to a power of two (>= 16 for tl.dot)
    BLOCK_DVO: tl.constexpr,  # D_VO padded likewise
    CAUSAL: tl.constexpr,
    NEGATE_Q: tl.constexpr,  # the softmax scale is negative: use -q with |scale|
    KV_TMA: tl.constexpr,  # K and V through K_DESC / V_DESC (TMA on sm_90) instead of pointers
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), ignored for fp16/bf16
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # key rows per loop step
    GROUP: tl.constexpr = 1,  # query heads per key/value head: head h reads K/V head h // GROUP
    HAS_DOCS: tl.constexpr = False,  # DOC_START / DOC_END bound each row's keys to its document
    COUNT_TILES: tl.constexpr = False,  # store the key blocks each program visits to TILES
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs blocks of at least 16 rows")
    tl.static_assert(BLOCK_DQK >= D_QK and BLOCK_DVO >= D_VO, "padded head width below the real one")
    tl.static_assert(BLOCK_DQK >= 16 and BLOCK_DVO >= 16, "tl.dot needs a reduction width of at least 16")
    # grid: (cdiv(T, BLOCK_M), H, B)
    start_m = tl.program_id(0) * BLOCK_M
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)
    pid_kv = pid_h // GROUP if GROUP > 1 else pid_h  # the key/value head of this query head
    off_h = pid_h.to(tl.int64)
    off_kv = pid_kv.to(tl.int64)
    off_b = pid_b.to(tl.int64)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_kv * stride_kh
    v_base = V + off_b * stride_vb + off_kv * stride_vh
    o_base = O + off_b * stride_ob + off_h * stride_oh
    lse_base = LSE + (off_b * H + off_h) * T

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dvo = tl.arange(0, BLOCK_DVO)
    q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_dqk[None, :] * stride_qd
    q = _load_tile(q_ptrs, offs_m, offs_dqk, T, D_QK, BLOCK_DQK, True)  # (BLOCK_M, BLOCK_DQK)
    if NEGATE_Q:
        # softmax(c q k^T) = softmax(|c| (-q) k^T): with a non-negative factor the loop may scale
        # the row max instead of every logit. Negation is exact in every dtype.
        q = -q
    offs_n = tl.arange(0, BLOCK_N)
    k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_dqk[None, :] * stride_kd  # (BLOCK_N, BLOCK_DQK)
    v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_dvo[None, :] * stride_vd  # (BLOCK_N, BLOCK_DVO)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DVO], dtype=tl.float32)  # fp32 accumulation whatever the input

    # Key blocks entirely below the diagonal (causal), inside T and inside every row's document
    # need no mask; blocks outside the rows' documents are not visited at all.
    lo, full_lo, full_hi, hi = _query_block_keys(
        DOC_START, DOC_END, off_b, start_m, T, BLOCK_M, BLOCK_N, CAUSAL, HAS_DOCS
    )
    doc_lo = offs_m  # unused without documents
    doc_hi = offs_m
    if HAS_DOCS:
        # Padding rows (>= T) see every key, as without documents: never an empty row.
        doc_lo = tl.load(DOC_START + off_b * T + offs_m, mask=offs_m < T, other=0)  # (BLOCK_M,)
        doc_hi = tl.load(DOC_END + off_b * T + offs_m, mask=offs_m < T, other=T)  # (BLOCK_M,)
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, K_DESC, V_DESC, pid_b, pid_kv, stride_kt, stride_vt,
            offs_m, offs_dqk, offs_dvo, T, qk_scale, lo, full_lo, doc_lo, doc_hi,
            D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_N, CAUSAL, True, KV_TMA, DOT_PRECISION, True,
        )  # fmt: skip
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, K_DESC, V_DESC, pid_b, pid_kv, stride_kt, stride_vt,
        offs_m, offs_dqk, offs_dvo, T, qk_scale, full_lo, full_hi, doc_lo, doc_hi,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_N, CAUSAL, False, KV_TMA, DOT_PRECISION, HAS_DOCS,
    )  # fmt: skip
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, K_DESC, V_DESC, pid_b, pid_kv, stride_kt, stride_vt,
        offs_m, offs_dqk, offs_dvo, T, qk_scale, full_hi, hi, doc_lo, doc_hi,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_N, CAUSAL, True, KV_TMA, DOT_PRECISION, HAS_DOCS,
    )  # fmt: skip
    if COUNT_TILES:
        tiles = (
            _tiles(lo, full_lo, BLOCK_N) + _tiles(full_lo, full_hi, BLOCK_N) + _tiles(full_hi, hi, BLOCK_N)
        )
        tl.store(TILES + (off_b * H + off_h) * tl.num_programs(0) + tl.program_id(0), tiles)

    o = acc / l_i[:, None]  # (BLOCK_M, BLOCK_DVO); l_i >= 1 since the row max contributes exp2(0)
    o_ptrs = o_base + offs_m[:, None] * stride_ot + offs_dvo[None, :] * stride_od
    _store_tile(o_ptrs, o.to(O.dtype.element_ty), offs_m, offs_dvo, T, D_VO)
    tl.store(lse_base + offs_m, m_i + tl.log2(l_i), mask=offs_m < T)


@triton.jit
def _attn_bwd_preprocess_kernel(
    O,  # pointer: (B, H, T, D_VO), forward output
    DO,  # pointer: (B, H, T, D_VO), gradient of the output
    DELTA,  # pointer: (B, H, T) contiguous fp32 output, rowsum(dO * O)
    stride_ob,  # O stride over B
    stride_oh,  # O stride over H
    stride_ot,  # O stride over T
    stride_od,  # O stride over d_vo
    stride_dob,  # dO stride over B
    stride_doh,  # dO stride over H
    stride_dot,  # dO stride over T
    stride_dod,  # dO stride over d_vo
    H,  # int: number of heads
    T,  # int: sequence length
    D_VO: tl.constexpr,  # v/o head width
    BLOCK_DVO: tl.constexpr,  # D_VO padded to a power of two
    BLOCK_M: tl.constexpr,  # rows per program
):
    tl.static_assert(BLOCK_DVO >= D_VO, "padded head width below the real one")
    # grid: (cdiv(T, BLOCK_M), H, B)
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dvo = tl.arange(0, BLOCK_DVO)
    o_base = O + off_b * stride_ob + off_h * stride_oh
    do_base = DO + off_b * stride_dob + off_h * stride_doh
    o_ptrs = o_base + offs_m[:, None] * stride_ot + offs_dvo[None, :] * stride_od
    do_ptrs = do_base + offs_m[:, None] * stride_dot + offs_dvo[None, :] * stride_dod
    o = _load_tile(o_ptrs, offs_m, offs_dvo, T, D_VO, BLOCK_DVO, True)  # (BLOCK_M, BLOCK_DVO)
    do = _load_tile(do_ptrs, offs_m, offs_dvo, T, D_VO, BLOCK_DVO, True)  # (BLOCK_M, BLOCK_DVO)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,) fp32
    tl.store(DELTA + (off_b * H + off_h) * T + offs_m, delta, mask=offs_m < T)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk,  # (BLOCK_N, BLOCK_DQK) fp32 accumulator
    dv,  # (BLOCK_N, BLOCK_DVO) fp32 accumulator
    k,  # (BLOCK_N, BLOCK_DQK) this program's key tile
    v,  # (BLOCK_N, BLOCK_DVO) this program's value tile
    q_ptrs,  # (BLOCK_M, BLOCK_DQK) pointers to Q[b, h, 0:BLOCK_M, :], advanced by the loop
    do_ptrs,  # (BLOCK_M, BLOCK_DVO) pointers to dO[b, h, 0:BLOCK_M, :]
    q_desc,  # TensorDescriptor of Q, or None (QDO_TMA False)
    do_desc,  # TensorDescriptor of dO, or None
    off_b,  # int32 batch index
    off_h,  # int32 head index
    lse_base,  # pointer to LSE[b, h, 0]
    delta_base,  # pointer to DELTA[b, h, 0]
    stride_qt,  # Q stride over T
    stride_dot,  # dO stride over T
    offs_n,  # (BLOCK_N,) key row indices of this program
    offs_dqk,  # (BLOCK_DQK,) arange
    offs_dvo,  # (BLOCK_DVO,) arange
    T,  # int: sequence length
    qk_scale,  # fp32: softmax scale * log2(e)
    lo,  # first query row of the loop (multiple of BLOCK_M)
    hi,  # loop end (exclusive)
    doc_lo,  # (BLOCK_N,) int32 first token of each key's document (DOCS only)
    doc_hi,  # (BLOCK_N,) int32 end of each key's document (DOCS only)
    D_QK: tl.constexpr,
    D_VO: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DVO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,  # False: every query in [lo, hi) is < T and sees every key of the block
    QDO_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOCS: tl.constexpr = False,  # the masked blocks also hide queries outside each key's document
):
    # Works on transposed tiles (keys along rows) so dK and dV come out as (BLOCK_N, d) directly.
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m0  # (BLOCK_M,) query rows
        q = _load_rows(
            q_ptrs + start_m * stride_qt, q_desc, off_b, off_h, start_m, rows, offs_dqk, T,
            BLOCK_M, D_QK, BLOCK_DQK, MASKED, QDO_TMA,
        )  # fmt: skip
        do = _load_rows(
            do_ptrs + start_m * stride_dot, do_desc, off_b, off_h, start_m, rows, offs_dvo, T,
            BLOCK_M, D_VO, BLOCK_DVO, MASKED, QDO_TMA,
        )  # fmt: skip
        if MASKED:
            lse = tl.load(lse_base + rows, mask=rows < T, other=0.0)  # (BLOCK_M,)
            delta = tl.load(delta_base + rows, mask=rows < T, other=0.0)  # (BLOCK_M,)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M) unscaled
        # P^T, exact probabilities thanks to the saved LSE; the scale folds into one FFMA.
        p_t = tl.exp2(qk_t * qk_scale - lse[None, :])
        if MASKED:
            visible = rows[None, :] < T
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= rows[None, :])
            if DOCS:  # query i sees key j iff i is in j's document (causal: j <= i already)
                visible = visible & (rows[None, :] < doc_hi[:, None])
                if not CAUSAL:
                    visible = visible & (rows[None, :] >= doc_lo[:, None])
            p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # dV += P^T dO
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M) = (dO V^T)^T
        ds_t = p_t * (dp_t - delta[None, :])  # dS^T, without the scale c (applied once at the end)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)  # dK += dS^T Q
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_head(
    dk,  # (BLOCK_N, BLOCK_DQK) fp32 accumulator
    dv,  # (BLOCK_N, BLOCK_DVO) fp32 accumulator
    k,  # (BLOCK_N, BLOCK_DQK) this program's key tile
    v,  # (BLOCK_N, BLOCK_DVO) this program's value tile
    Q,
    DO,
    LSE,
    DELTA,
    Q_DESC,
    DO_DESC,  # as the kernel's
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,  # Q strides
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dod,  # dO strides
    pid_b,  # int32 batch index
    pid_hq,  # int32 query head whose rows this call streams
    H,  # int: query heads
    offs_n,  # (BLOCK_N,) key row indices of this program
    offs_dqk,  # (BLOCK_DQK,) arange
    offs_dvo,  # (BLOCK_DVO,) arange
    T,  # int: sequence length
    qk_scale,  # fp32: c * log2(e)
    lo,
    mid_lo,
    mid_hi,
    end,  # the query blocks to visit (`_key_block_queries`)
    doc_lo,  # (BLOCK_N,) int32 first token of each key's document (HAS_DOCS only)
    doc_hi,  # (BLOCK_N,) int32 end of each key's document (HAS_DOCS only)
    D_QK: tl.constexpr,
    D_VO: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DVO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    QDO_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """dK, dV += the contributions of one query head's rows to this program's keys."""
    off_b = pid_b.to(tl.int64)
    off_h = pid_hq.to(tl.int64)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    do_base = DO + off_b * stride_dob + off_h * stride_doh
    lse_base = LSE + (off_b * H + off_h) * T
    delta_base = DELTA + (off_b * H + off_h) * T
    offs_m0 = tl.arange(0, BLOCK_M)
    q_ptrs = q_base + offs_m0[:, None] * stride_qt + offs_dqk[None, :] * stride_qd  # (BLOCK_M, BLOCK_DQK)
    do_ptrs = do_base + offs_m0[:, None] * stride_dot + offs_dvo[None, :] * stride_dod  # (BLOCK_M, BLOCK_DVO)
    if CAUSAL or HAS_DOCS:
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, Q_DESC, DO_DESC, pid_b, pid_hq,
            lse_base, delta_base, stride_qt, stride_dot,
            offs_n, offs_dqk, offs_dvo, T, qk_scale, lo, tl.minimum(mid_lo, end), doc_lo, doc_hi,
            D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_M, CAUSAL, True, QDO_TMA, DOT_PRECISION, HAS_DOCS,
        )  # fmt: skip
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, q_ptrs, do_ptrs, Q_DESC, DO_DESC, pid_b, pid_hq,
        lse_base, delta_base, stride_qt, stride_dot,
        offs_n, offs_dqk, offs_dvo, T, qk_scale, mid_lo, mid_hi, doc_lo, doc_hi,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_M, CAUSAL, False, QDO_TMA, DOT_PRECISION, HAS_DOCS,
    )  # fmt: skip
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, q_ptrs, do_ptrs, Q_DESC, DO_DESC, pid_b, pid_hq,
        lse_base, delta_base, stride_qt, stride_dot,
        offs_n, offs_dqk, offs_dvo, T, qk_scale, tl.maximum(mid_lo, mid_hi), end, doc_lo, doc_hi,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_M, CAUSAL, True, QDO_TMA, DOT_PRECISION, HAS_DOCS,
    )  # fmt: skip
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q,  # pointer: (B, H, T, D_QK)
    K,  # pointer: (B, H, T, D_QK)
    V,  # pointer: (B, H, T, D_VO)
    DO,  # pointer: (B, H, T, D_VO), gradient of the output
    LSE,  # pointer: (B, H, T) contiguous fp32, base-2 log-sum-exp from the forward
    DELTA,  # pointer: (B, H, T) contiguous fp32, rowsum(dO * O)
    DK,  # pointer: (B, H, T, D_QK) output, input dtype
    DV,  # pointer: (B, H, T, D_VO) output, input dtype
    Q_DESC,  # TensorDescriptor of Q (B, H, T, D_QK), block (1, 1, BLOCK_M, BLOCK_DQK); None: use Q
    DO_DESC,  # TensorDescriptor of dO (B, H, T, D_VO), block (1, 1, BLOCK_M, BLOCK_DVO); None: use DO
    DOC_START,  # pointer: (B, T) int32 first token of each token's document; None without documents
    DOC_END,  # pointer: (B, T) int32 end (exclusive) of each token's document; None without documents
    TILES,  # pointer: int32 out, the tiles each program visits (COUNT_TILES only; else None)
    stride_qb,  # Q stride over B
    stride_qh,  # Q stride over H
    stride_qt,  # Q stride over T
    stride_qd,  # Q stride over d_qk
    stride_kb,  # K stride over B
    stride_kh,  # K stride over H
    stride_kt,  # K stride over T
    stride_kd,  # K stride over d_qk
    stride_vb,  # V stride over B
    stride_vh,  # V stride over H
    stride_vt,  # V stride over T
    stride_vd,  # V stride over d_vo
    stride_dob,  # dO stride over B
    stride_doh,  # dO stride over H
    stride_dot,  # dO stride over T
    stride_dod,  # dO stride over d_vo
    stride_dkb,  # dK stride over B
    stride_dkh,  # dK stride over H
    stride_dkt,  # dK stride over T
    stride_dkd,  # dK stride over d_qk
    stride_dvb,  # dV stride over B
    stride_dvh,  # dV stride over H
    stride_dvt,  # dV stride over T
    stride_dvd,  # dV stride over d_vo
    H,  # int: number of heads
    T,  # int: sequence length
    T_BUCKET,  # int: next_power_of_2(T); autotune key only
    sm_scale,  # fp32: softmax scale c
    qk_scale,  # fp32: c * log2(e)
    D_QK: tl.constexpr,
    D_VO: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DVO: tl.constexpr,
    CAUSAL: tl.constexpr,
    QDO_TMA: tl.constexpr,  # Q and dO through Q_DESC / DO_DESC (TMA on sm_90) instead of pointers
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per loop step
    BLOCK_N: tl.constexpr,  # key rows owned by the program
    GROUP: tl.constexpr = 1,  # query heads per key/value head: this program sums over GROUP of them
    HAS_DOCS: tl.constexpr = False,  # DOC_START / DOC_END bound each key's queries to its document
    COUNT_TILES: tl.constexpr = False,  # store the query blocks each program visits to TILES
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs blocks of at least 16 rows")
    tl.static_assert(BLOCK_DQK >= D_QK and BLOCK_DVO >= D_VO, "padded head width below the real one")
    tl.static_assert(BLOCK_DQK >= 16 and BLOCK_DVO >= 16, "tl.dot needs a reduction width of at least 16")
    # grid: (cdiv(T, BLOCK_N), H_kv, B): key/value head pid_h of the GROUP query heads
    # pid_h * GROUP ... pid_h * GROUP + GROUP - 1, whose contributions it sums in that order
    start_n = tl.program_id(0) * BLOCK_N
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)
    off_h = pid_h.to(tl.int64)
    off_b = pid_b.to(tl.int64)
    k_base = K + off_b * stride_kb + off_h * stride_kh
    v_base = V + off_b * stride_vb + off_h * stride_vh

    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dvo = tl.arange(0, BLOCK_DVO)
    # Key rows >= T load as zeros; their dK/dV rows are garbage-free but never stored anyway.
    k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_dqk[None, :] * stride_kd
    v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_dvo[None, :] * stride_vd
    k = _load_tile(k_ptrs, offs_n, offs_dqk, T, D_QK, BLOCK_DQK, True)  # (BLOCK_N, BLOCK_DQK)
    v = _load_tile(v_ptrs, offs_n, offs_dvo, T, D_VO, BLOCK_DVO, True)  # (BLOCK_N, BLOCK_DVO)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DVO], dtype=tl.float32)

    # Query blocks: [lo, mid_lo) straddle the diagonal (causal) or the documents' starts,
    # [mid_lo, mid_hi) need no mask, [max(mid_lo, mid_hi), end) hold the tail of T or of the
    # documents (or are still on the diagonal); blocks outside the keys' documents are skipped.
    lo, mid_lo, mid_hi, end = _key_block_queries(
        DOC_START, DOC_END, off_b, start_n, T, BLOCK_M, BLOCK_N, CAUSAL, HAS_DOCS
    )
    doc_lo = offs_n  # unused without documents
    doc_hi = offs_n
    if HAS_DOCS:
        doc_lo = tl.load(DOC_START + off_b * T + offs_n, mask=offs_n < T, other=0)  # (BLOCK_N,)
        doc_hi = tl.load(DOC_END + off_b * T + offs_n, mask=offs_n < T, other=0)  # (BLOCK_N,)
    if GROUP == 1:
        dk, dv = _attn_bwd_dkdv_head(
            dk, dv, k, v, Q, DO, LSE, DELTA, Q_DESC, DO_DESC,
            stride_qb, stride_qh, stride_qt, stride_qd, stride_dob, stride_doh, stride_dot, stride_dod,
            pid_b, pid_h, H, offs_n, offs_dqk, offs_dvo, T, qk_scale,
            lo, mid_lo, mid_hi, end, doc_lo, doc_hi,
            D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_M, CAUSAL, QDO_TMA, DOT_PRECISION, HAS_DOCS,
        )  # fmt: skip
    else:
        for g in range(GROUP):  # the group's query heads in order: a fixed summation order
            dk, dv = _attn_bwd_dkdv_head(
                dk, dv, k, v, Q, DO, LSE, DELTA, Q_DESC, DO_DESC,
                stride_qb, stride_qh, stride_qt, stride_qd, stride_dob, stride_doh, stride_dot, stride_dod,
                pid_b, pid_h * GROUP + g, H, offs_n, offs_dqk, offs_dvo, T, qk_scale,
                lo, mid_lo, mid_hi, end, doc_lo, doc_hi,
                D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_M, CAUSAL, QDO_TMA, DOT_PRECISION, HAS_DOCS,
            )  # fmt: skip
    if COUNT_TILES:  # the query blocks of the three ranges above, for each of the GROUP heads
        tiles = _tiles(lo, tl.minimum(mid_lo, end), BLOCK_M) + _tiles(mid_lo, mid_hi, BLOCK_M)
        tiles += _tiles(tl.maximum(mid_lo, mid_hi), end, BLOCK_M)
        slot = (off_b * tl.num_programs(1) + off_h) * tl.num_programs(0) + tl.program_id(0)
        tl.store(TILES + slot, tiles * GROUP)

    dk = dk * sm_scale  # dK = c * dS^T Q
    dk_base = DK + off_b * stride_dkb + off_h * stride_dkh
    dv_base = DV + off_b * stride_dvb + off_h * stride_dvh
    dk_ptrs = dk_base + offs_n[:, None] * stride_dkt + offs_dqk[None, :] * stride_dkd
    dv_ptrs = dv_base + offs_n[:, None] * stride_dvt + offs_dvo[None, :] * stride_dvd
    _store_tile(dk_ptrs, dk.to(DK.dtype.element_ty), offs_n, offs_dqk, T, D_QK)
    _store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, offs_dvo, T, D_VO)


@triton.jit
def _attn_bwd_dq_inner(
    dq,  # (BLOCK_M, BLOCK_DQK) fp32 accumulator
    q,  # (BLOCK_M, BLOCK_DQK) this program's query tile
    do,  # (BLOCK_M, BLOCK_DVO) this program's output-gradient tile
    lse,  # (BLOCK_M,) fp32 base-2 log-sum-exp of these rows
    delta,  # (BLOCK_M,) fp32 rowsum(dO * O) of these rows
    k_ptrs,  # (BLOCK_N, BLOCK_DQK) pointers to K[b, h, 0:BLOCK_N, :], advanced by the loop
    v_ptrs,  # (BLOCK_N, BLOCK_DVO) pointers to V[b, h, 0:BLOCK_N, :]
    k_desc,  # TensorDescriptor of K, or None (KV_TMA False)
    v_desc,  # TensorDescriptor of V, or None
    off_b,  # int32 batch index
    off_h,  # int32 head index
    stride_kt,  # K stride over T
    stride_vt,  # V stride over T
    offs_m,  # (BLOCK_M,) query row indices of this program
    offs_dqk,  # (BLOCK_DQK,) arange
    offs_dvo,  # (BLOCK_DVO,) arange
    T,  # int: sequence length
    qk_scale,  # fp32: softmax scale * log2(e)
    lo,  # first key row of the loop (multiple of BLOCK_N)
    hi,  # loop end (exclusive)
    doc_lo,  # (BLOCK_M,) int32 first key of each row's document (DOCS only)
    doc_hi,  # (BLOCK_M,) int32 end of each row's document (DOCS only)
    D_QK: tl.constexpr,
    D_VO: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DVO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key in [lo, hi) is < T and visible to every row
    KV_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOCS: tl.constexpr = False,  # the masked blocks also hide keys outside each row's document
):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key rows
        k = _load_rows(
            k_ptrs + start_n * stride_kt, k_desc, off_b, off_h, start_n, cols, offs_dqk, T,
            BLOCK_N, D_QK, BLOCK_DQK, MASKED, KV_TMA,
        )  # fmt: skip
        v = _load_rows(
            v_ptrs + start_n * stride_vt, v_desc, off_b, off_h, start_n, cols, offs_dvo, T,
            BLOCK_N, D_VO, BLOCK_DVO, MASKED, KV_TMA,
        )  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) unscaled
        p = tl.exp2(qk * qk_scale - lse[:, None])  # the scale folds into one FFMA
        if MASKED and DOCS:
            p = tl.where(_document_visible(cols, offs_m, doc_lo, doc_hi, T, CAUSAL), p, 0.0)
        elif MASKED:
            visible = cols[None, :] < T
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) = dO V^T
        ds = p * (dp - delta[:, None])  # dS without the scale c
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # dQ += dS K
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q,  # pointer: (B, H, T, D_QK)
    K,  # pointer: (B, H, T, D_QK)
    V,  # pointer: (B, H, T, D_VO)
    DO,  # pointer: (B, H, T, D_VO), gradient of the output
    LSE,  # pointer: (B, H, T) contiguous fp32, base-2 log-sum-exp from the forward
    DELTA,  # pointer: (B, H, T) contiguous fp32, rowsum(dO * O)
    DQ,  # pointer: (B, H, T, D_QK) output, input dtype
    K_DESC,  # TensorDescriptor of K (B, H, T, D_QK), block (1, 1, BLOCK_N, BLOCK_DQK); None: use K
    V_DESC,  # TensorDescriptor of V (B, H, T, D_VO), block (1, 1, BLOCK_N, BLOCK_DVO); None: use V
    DOC_START,  # pointer: (B, T) int32 first token of each token's document; None without documents
    DOC_END,  # pointer: (B, T) int32 end (exclusive) of each token's document; None without documents
    TILES,  # pointer: int32 out, the tiles each program visits (COUNT_TILES only; else None)
    stride_qb,  # Q stride over B
    stride_qh,  # Q stride over H
    stride_qt,  # Q stride over T
    stride_qd,  # Q stride over d_qk
    stride_kb,  # K stride over B
    stride_kh,  # K stride over H
    stride_kt,  # K stride over T
    stride_kd,  # K stride over d_qk
    stride_vb,  # V stride over B
    stride_vh,  # V stride over H
    stride_vt,  # V stride over T
    stride_vd,  # V stride over d_vo
    stride_dob,  # dO stride over B
    stride_doh,  # dO stride over H
    stride_dot,  # dO stride over T
    stride_dod,  # dO stride over d_vo
    stride_dqb,  # dQ stride over B
    stride_dqh,  # dQ stride over H
    stride_dqt,  # dQ stride over T
    stride_dqd,  # dQ stride over d_qk
    H,  # int: number of heads
    T,  # int: sequence length
    T_BUCKET,  # int: next_power_of_2(T); autotune key only
    sm_scale,  # fp32: softmax scale c
    qk_scale,  # fp32: c * log2(e)
    D_QK: tl.constexpr,
    D_VO: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DVO: tl.constexpr,
    CAUSAL: tl.constexpr,
    KV_TMA: tl.constexpr,  # K and V through K_DESC / V_DESC (TMA on sm_90) instead of pointers
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows owned by the program
    BLOCK_N: tl.constexpr,  # key rows per loop step
    GROUP: tl.constexpr = 1,  # query heads per key/value head: head h reads K/V head h // GROUP
    HAS_DOCS: tl.constexpr = False,  # DOC_START / DOC_END bound each row's keys to its document
    COUNT_TILES: tl.constexpr = False,  # store the key blocks each program visits to TILES
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs blocks of at least 16 rows")
    tl.static_assert(BLOCK_DQK >= D_QK and BLOCK_DVO >= D_VO, "padded head width below the real one")
    tl.static_assert(BLOCK_DQK >= 16 and BLOCK_DVO >= 16, "tl.dot needs a reduction width of at least 16")
    # grid: (cdiv(T, BLOCK_M), H, B)
    start_m = tl.program_id(0) * BLOCK_M
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)
    pid_kv = pid_h // GROUP if GROUP > 1 else pid_h  # the key/value head of this query head
    off_h = pid_h.to(tl.int64)
    off_kv = pid_kv.to(tl.int64)
    off_b = pid_b.to(tl.int64)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_kv * stride_kh
    v_base = V + off_b * stride_vb + off_kv * stride_vh
    do_base = DO + off_b * stride_dob + off_h * stride_doh
    lse_base = LSE + (off_b * H + off_h) * T
    delta_base = DELTA + (off_b * H + off_h) * T

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dvo = tl.arange(0, BLOCK_DVO)
    q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_dqk[None, :] * stride_qd
    do_ptrs = do_base + offs_m[:, None] * stride_dot + offs_dvo[None, :] * stride_dod
    q = _load_tile(q_ptrs, offs_m, offs_dqk, T, D_QK, BLOCK_DQK, True)  # (BLOCK_M, BLOCK_DQK)
    do = _load_tile(do_ptrs, offs_m, offs_dvo, T, D_VO, BLOCK_DVO, True)  # (BLOCK_M, BLOCK_DVO)
    offs_n = tl.arange(0, BLOCK_N)
    k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_dqk[None, :] * stride_kd  # (BLOCK_N, BLOCK_DQK)
    v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_dvo[None, :] * stride_vd  # (BLOCK_N, BLOCK_DVO)
    lse = tl.load(lse_base + offs_m, mask=offs_m < T, other=0.0)  # (BLOCK_M,)
    delta = tl.load(delta_base + offs_m, mask=offs_m < T, other=0.0)  # (BLOCK_M,)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)

    # Same split of the key loop as the forward.
    lo, full_lo, full_hi, hi = _query_block_keys(
        DOC_START, DOC_END, off_b, start_m, T, BLOCK_M, BLOCK_N, CAUSAL, HAS_DOCS
    )
    doc_lo = offs_m  # unused without documents
    doc_hi = offs_m
    if HAS_DOCS:
        doc_lo = tl.load(DOC_START + off_b * T + offs_m, mask=offs_m < T, other=0)  # (BLOCK_M,)
        doc_hi = tl.load(DOC_END + off_b * T + offs_m, mask=offs_m < T, other=T)  # (BLOCK_M,)
        dq = _attn_bwd_dq_inner(
            dq, q, do, lse, delta, k_ptrs, v_ptrs, K_DESC, V_DESC, pid_b, pid_kv, stride_kt, stride_vt,
            offs_m, offs_dqk, offs_dvo, T, qk_scale, lo, full_lo, doc_lo, doc_hi,
            D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_N, CAUSAL, True, KV_TMA, DOT_PRECISION, True,
        )  # fmt: skip
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, K_DESC, V_DESC, pid_b, pid_kv, stride_kt, stride_vt,
        offs_m, offs_dqk, offs_dvo, T, qk_scale, full_lo, full_hi, doc_lo, doc_hi,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_N, CAUSAL, False, KV_TMA, DOT_PRECISION, HAS_DOCS,
    )  # fmt: skip
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, K_DESC, V_DESC, pid_b, pid_kv, stride_kt, stride_vt,
        offs_m, offs_dqk, offs_dvo, T, qk_scale, full_hi, hi, doc_lo, doc_hi,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_N, CAUSAL, True, KV_TMA, DOT_PRECISION, HAS_DOCS,
    )  # fmt: skip
    if COUNT_TILES:
        tiles = (
            _tiles(lo, full_lo, BLOCK_N) + _tiles(full_lo, full_hi, BLOCK_N) + _tiles(full_hi, hi, BLOCK_N)
        )
        tl.store(TILES + (off_b * H + off_h) * tl.num_programs(0) + tl.program_id(0), tiles)

    dq = dq * sm_scale  # dQ = c * dS K
    dq_base = DQ + off_b * stride_dqb + off_h * stride_dqh
    dq_ptrs = dq_base + offs_m[:, None] * stride_dqt + offs_dqk[None, :] * stride_dqd
    _store_tile(dq_ptrs, dq.to(DQ.dtype.element_ty), offs_m, offs_dqk, T, D_QK)


# ----------------------------------------------------------------------------------------------
# Tiling: the candidates and their pruning (GPU only).
# ----------------------------------------------------------------------------------------------

# The tiling that wins depends on the head widths, the mask (causal, documents), the query heads
# per key/value head (a dK/dV program sums over them), the dtype (added to the key by Triton
# itself) and the order of magnitude of T (short sequences want small blocks); the exact T does
# not matter, so T enters the key as a power-of-two bucket and a new length does not re-tune.
_TUNE_KEY = ["T_BUCKET", "D_QK", "D_VO", "CAUSAL", "GROUP", "HAS_DOCS"]

Tile = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)

# Every candidate, in order of preference (under deterministic algorithms the first that fits is
# the one launched). At head widths up to 64 all of them compile without spilling and launch on
# sm_80 and sm_90 (`python -m tools.inspect`; with grouped heads or documents, less
# _VARIANT_SPILLS). A 128-row tile takes 8 warps: with 4, the (128, d) fp32 accumulator alone is
# d registers per thread and the scores tile comes on top.
_FWD_CONFIGS: list[Tile] = [
    (128, 64, 8, 4),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 32, 4, 4),
    (64, 64, 4, 2),
    (64, 32, 4, 4),
    (64, 128, 4, 2),
    (32, 32, 4, 2),
]
# dK/dV: a program owns BLOCK_N keys and streams BLOCK_M queries, so the key block is the big one;
# its two (BLOCK_N, d) fp32 accumulators want 8 warps at BLOCK_N = 128 (and at d = 256).
_DKDV_CONFIGS: list[Tile] = [
    (32, 128, 8, 2),
    (64, 128, 8, 2),
    (32, 128, 8, 3),
    (32, 64, 4, 3),
    (16, 64, 4, 3),
    (32, 32, 4, 2),
    (32, 32, 8, 2),
    (16, 128, 8, 3),  # the last two: added for grouped heads at d = 128 (spill-free on sm_90; untimed)
    (16, 64, 8, 2),
]
# dQ: a program owns BLOCK_M queries and streams BLOCK_N keys.
_DQ_CONFIGS: list[Tile] = [
    (128, 32, 8, 2),
    (128, 64, 8, 2),
    (64, 32, 4, 3),
    (64, 64, 4, 2),
    (32, 64, 4, 2),
    (32, 32, 4, 2),
]
CONFIGS = {"fwd": _FWD_CONFIGS, "dkdv": _DKDV_CONFIGS, "dq": _DQ_CONFIGS}

# Wider heads keep fewer: the candidates that compile without spilling and launch at every head
# width of the class, by the padded head width (the wider of BLOCK_DQK and BLOCK_DVO) and GPU
# generation (80: up to sm_89, mma.sync; 90: sm_90 and later, wgmma and TMA), for bf16 and fp16,
# both masks and both load paths: `python -m tools.inspect --candidates` (Triton 3.9). sm_80's
# mma.sync code spills at head widths where sm_90's wgmma code does not.
_WIDE_HEADS: dict[str, dict[int, dict[int, list[Tile]]]] = {
    "fwd": {
        128: {
            80: [(64, 64, 4, 2), (64, 32, 4, 4)],
            90: [(128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 32, 4, 4),
                 (64, 128, 4, 2), (32, 32, 4, 2)],
        },
        256: {80: [(32, 32, 4, 2)], 90: [(64, 32, 4, 4), (32, 32, 4, 2)]},
    },
    "dkdv": {
        128: {
            80: [(16, 64, 4, 3), (32, 32, 4, 2), (32, 32, 8, 2), (16, 128, 8, 3), (16, 64, 8, 2)],
            90: [(32, 128, 8, 2), (32, 128, 8, 3), (32, 64, 4, 3), (16, 64, 4, 3), (32, 32, 8, 2),
                 (16, 128, 8, 3), (16, 64, 8, 2)],
        },
        256: {80: [(32, 32, 8, 2)], 90: [(32, 32, 8, 2)]},
    },
    "dq": {
        128: {
            80: [(128, 32, 8, 2), (64, 32, 4, 3), (64, 64, 4, 2), (32, 64, 4, 2), (32, 32, 4, 2)],
            90: _DQ_CONFIGS,
        },
        256: {
            80: [(64, 32, 4, 3), (32, 64, 4, 2), (32, 32, 4, 2)],
            90: [(128, 32, 8, 2), (64, 32, 4, 3), (32, 32, 4, 2)],
        },
    },
}  # fmt: skip
GENERATIONS = (80, 90)  # the targets the lists were inspected on

# Grouped heads (GROUP > 1: a dK/dV program loops over its query heads) and packed documents
# (HAS_DOCS: each row's document bounds in registers) take more registers: the listed tiles that
# then spill, by the launch's feature, kernel, padded head width (64: up to 64) and generation. A
# launch with both leaves out both sets. From `python -m tools.inspect --attn-variants
# gqa,docs,gqa-docs` (head widths 16 to 256, bf16 and fp16, both masks, both load paths; Triton
# 3.9): a tile that spills in any of those cases is left out of all of them.
_VARIANT_SPILLS: dict[str, dict[str, dict[int, dict[int, set[Tile]]]]] = {
    "grouped": {
        "dkdv": {
            64: {80: {(64, 128, 8, 2)}, 90: {(32, 64, 4, 3), (64, 128, 8, 2), (32, 32, 4, 2)}},
            128: {80: {(16, 128, 8, 3), (16, 64, 4, 3)},
                  90: {(32, 128, 8, 2), (32, 128, 8, 3), (32, 64, 4, 3), (16, 64, 4, 3), (32, 32, 8, 2)}},
        },
    },
    "documents": {
        "fwd": {
            64: {80: {(64, 128, 4, 2), (128, 128, 8, 2), (128, 64, 8, 3)}},
            128: {90: {(128, 128, 8, 2), (64, 128, 4, 2)}},
        },
        "dkdv": {
            64: {80: {(64, 128, 8, 2)}, 90: {(32, 32, 8, 2)}},
            128: {80: {(16, 64, 4, 3), (16, 64, 8, 2)}, 90: {(16, 64, 4, 3), (32, 64, 4, 3)}},
        },
        "dq": {64: {80: {(64, 64, 4, 2)}}, 128: {80: {(64, 64, 4, 2)}}},
    },
}  # fmt: skip

# Report names of the tuned kernels.
KERNEL_NAMES = {"fwd": "attn_fwd", "dkdv": "attn_bwd_dkdv", "dq": "attn_bwd_dq"}

# TMA (tensor-memory-accelerator) bulk copies exist from sm_90 (Hopper) on.
TMA_MIN_CAPABILITY = 90


def listed_configs(
    kind: str, head_width: int, capability: int, grouped: bool = False, documents: bool = False
) -> list[Tile]:
    """The candidates listed for a padded head width on a GPU of `capability`, less those that
    spill with grouped heads or packed documents when the launch has them."""
    generation = max((g for g in GENERATIONS if g <= capability), default=GENERATIONS[0])
    by_generation = _WIDE_HEADS[kind].get(head_width)
    listed = CONFIGS[kind] if by_generation is None else by_generation[generation]  # None: up to 64
    features = [name for name, used in (("grouped", grouped), ("documents", documents)) if used]
    spills = set().union(
        *(
            _VARIANT_SPILLS[name].get(kind, {}).get(max(head_width, 64), {}).get(generation, set())
            for name in features
        )
    )
    return [tile for tile in listed if tile not in spills] or listed


def _launch_capability(device: torch.device) -> int | None:
    """The capability the kernels are compiled for: None under the interpreter."""
    limits = None if runtime.interpreting() else runtime.device_limits(device)
    return limits.capability if limits is not None else None


def _shared_bytes(kind: str, block_m: int, block_n: int, num_stages: int, meta: dict, elem: int) -> int:
    """Shared memory a config needs, estimated from its tiles: those resident for the whole
    program, `num_stages` copies of the streamed ones and one (BLOCK_M, BLOCK_N) tile for P / dS.
    An upper bound of what the compiler allocates (tests/integration/tools/test_inspect_subset.py
    checks it)."""
    dqk, dvo = meta["BLOCK_DQK"], meta["BLOCK_DVO"]
    if kind == "fwd":  # Q resident; K, V streamed
        resident, streamed = block_m * dqk, block_n * (dqk + dvo)
    elif kind == "dkdv":  # K, V resident; Q, dO streamed
        resident, streamed = block_n * (dqk + dvo), block_m * (dqk + dvo)
    else:  # dq: Q, dO resident; K, V streamed
        resident, streamed = block_m * (dqk + dvo), block_n * (dqk + dvo)
    return (resident + num_stages * streamed + block_m * block_n) * elem


def _tile(cfg: triton.Config) -> Tile:
    return (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages)


def prune_configs(
    kind: str, configs: list[triton.Config], args: dict, device: runtime.DeviceLimits
) -> list[triton.Config]:
    """The configs worth timing for one launch (`args`: its arguments by name) on `device`.

    1. The candidates listed for the launch's padded head width and the device's generation.
    2. fp32 inputs use IEEE dots on FMA units, where big tiles gain nothing and take 30-100 s
       each to compile (measured for sm_90): at most 64 x 32.
    3. `runtime.prune_configs`: what fits the device's shared memory, preferring blocks no longer
       than the sequence (longer ones only waste work).
    """
    width = max(args["BLOCK_DQK"], args["BLOCK_DVO"])
    grouped, documents = args.get("GROUP", 1) > 1, bool(args.get("HAS_DOCS"))
    listed = set(listed_configs(kind, width, device.capability, grouped, documents))
    pool = [c for c in configs if _tile(c) in listed] or list(configs)
    elem = args["Q"].element_size()
    if elem == 4:
        pool = [c for c in pool if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 32] or pool
    longest = max(args["T_BUCKET"], 32)
    return runtime.prune_configs(
        pool,
        device,
        shared_bytes=lambda c: _shared_bytes(
            kind, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, args, elem
        ),
        prefer=lambda c: max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) <= longest,
    )


def _make_pruner(kind: str) -> Callable:
    """The autotuner's `early_config_prune`: `prune_configs` for the launching device."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        args = {**named_args, **kwargs}
        return prune_configs(kind, configs, args, runtime.device_limits(args["Q"].device))

    return prune


# Tensor-descriptor arguments and the block shape a tiling gives each: (1, 1, rows, padded width).
_DESCRIPTOR_TILES = {
    "K_DESC": ("BLOCK_N", "BLOCK_DQK"),
    "V_DESC": ("BLOCK_N", "BLOCK_DVO"),
    "Q_DESC": ("BLOCK_M", "BLOCK_DQK"),
    "DO_DESC": ("BLOCK_M", "BLOCK_DVO"),
}


def _shape_descriptors(nargs: dict) -> None:
    """Give each tensor descriptor among the arguments the block shape of the launch's tiling
    (a no-op while the tiling is still open). The autotune configs run this as their pre-hook."""
    for name, (rows, cols) in _DESCRIPTOR_TILES.items():
        desc = nargs.get(name)
        if desc is not None and rows in nargs:
            desc.block_shape = [1, 1, nargs[rows], nargs[cols]]


def _tuning_configs(kind: str, tma: bool) -> list[triton.Config]:
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn},
            num_warps=w,
            num_stages=s,
            pre_hook=_shape_descriptors if tma else None,
        )
        for bm, bn, w, s in CONFIGS[kind]
    ]


def _autotuned(kernel: triton.runtime.JITFunction, kind: str, tma: bool):
    """Wrap `kernel` in triton.autotune. Without descriptors the results persist to disk where this
    Triton supports it; Triton cannot persist configs with pre-hooks, so the TMA variant re-tunes
    once per process."""
    extra = {}
    if not tma and "cache_results" in inspect.signature(triton.autotune).parameters:  # triton >= 3.2
        extra["cache_results"] = True  # a second process reuses the tuned choice without re-timing
    return triton.autotune(
        configs=_tuning_configs(kind, tma),
        key=_TUNE_KEY,
        prune_configs_by={"early_config_prune": _make_pruner(kind)},
        **extra,
    )(kernel)


if runtime.interpreting():
    # Launch the plain kernels with INTERPRETER_TILES (see `_fixed_tiling`).
    _attn_fwd = _attn_fwd_tma = _attn_fwd_kernel
    _attn_bwd_dkdv = _attn_bwd_dkdv_tma = _attn_bwd_dkdv_kernel
    _attn_bwd_dq = _attn_bwd_dq_tma = _attn_bwd_dq_kernel
else:
    _attn_fwd = _autotuned(_attn_fwd_kernel, "fwd", tma=False)
    _attn_fwd_tma = _autotuned(_attn_fwd_kernel, "fwd", tma=True)
    _attn_bwd_dkdv = _autotuned(_attn_bwd_dkdv_kernel, "dkdv", tma=False)
    _attn_bwd_dkdv_tma = _autotuned(_attn_bwd_dkdv_kernel, "dkdv", tma=True)
    _attn_bwd_dq = _autotuned(_attn_bwd_dq_kernel, "dq", tma=False)
    _attn_bwd_dq_tma = _autotuned(_attn_bwd_dq_kernel, "dq", tma=True)

# The preprocess is a memory-bound row reduction; one tiling is fine everywhere.
_PREPROCESS_TILE = {"BLOCK_M": 64}


def _fixed_tiling(kind: str) -> dict[str, int]:
    """A fixed tiling: the interpreter's; on a GPU none ({}: the autotuner chooses)."""
    return dict(INTERPRETER_TILES[kind]) if runtime.interpreting() else {}


def _tuned_launch(kind: str, tma: bool, wrappers: tuple) -> dict:
    """The tiling fields of a tuned kernel's KernelLaunch: its candidates and the autotuner, or the
    fixed tiling alone."""
    fixed = _fixed_tiling(kind)
    if fixed:
        return {"configs": [runtime.config(fixed)], "tuned": None}
    return {"configs": _tuning_configs(kind, tma), "tuned": wrappers[tma]}


# ----------------------------------------------------------------------------------------------
# Host side.
# ----------------------------------------------------------------------------------------------


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
) -> None:
    """Raise one clear TypeError/ValueError for inputs the kernels cannot take. Documents must be
    non-decreasing along each row; that is not checked here (it would read the tensor back from
    the device on every call): a row that is not gives attention over the runs searchsorted finds."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"flash_attention: {name} must be 4-D (B, H, T, d), got {t.dim()}-D shape {tuple(t.shape)}"
            )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"flash_attention: unsupported dtype {t.dtype} for {name}; "
                "supported: torch.float32, torch.float16, torch.bfloat16"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"flash_attention: q, k, v must be on the same device, got {q.device}, {k.device}, {v.device}"
        )
    h, h_kv = q.shape[1], k.shape[1]
    same = q.shape[0] == k.shape[0] == v.shape[0] and q.shape[2] == k.shape[2] == v.shape[2]
    if not same or v.shape[1] != h_kv or h_kv < 1 or h % h_kv:
        raise ValueError(
            "flash_attention: q, k, v must agree on (B, H, T), except that k and v may have fewer heads "
            f"dividing q's (grouped-query attention), got {tuple(q.shape[:3])}, {tuple(k.shape[:3])}, "
            f"{tuple(v.shape[:3])}"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"flash_attention: q and k head widths differ: d_qk {q.shape[3]} vs {k.shape[3]}")
    for name, d in (("q/k", q.shape[3]), ("v", v.shape[3])):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"flash_attention: {name} head width {d} must be between 1 and {MAX_HEAD_DIM}")
    if min(q.shape[:3]) < 1:
        raise ValueError(f"flash_attention: B, H and T must be >= 1, got {tuple(q.shape[:3])}")
    if q.device.type == "cpu" and not runtime.interpreting():
        raise ValueError(
            "flash_attention: got CPU tensors. Triton kernels need CUDA tensors, "
            "or TRITON_INTERPRET=1 for the CPU interpreter (set before triton is imported)"
        )
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        # The interpreter's bf16 tl.dot returns garbage (errors of 1e8), not an error of its own.
        raise TypeError(
            "flash_attention: torch.bfloat16 is not supported on CPU tensors (the Triton interpreter "
            "cannot multiply bf16); use torch.float32 or torch.float16 on CPU, bf16 on CUDA"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        # Offsets inside one (b, h) slice are 32-bit in the kernels; (b, h) offsets are 64-bit.
        span = (t.shape[2] - 1) * abs(t.stride(2)) + (t.shape[3] - 1) * abs(t.stride(3))
        if span >= 2**31:
            raise ValueError(f"flash_attention: {name} spans {span} elements within one head, over 2**31")
    if documents is not None:
        if (
            not isinstance(documents, torch.Tensor)
            or documents.dtype.is_floating_point
            or documents.is_complex()
        ):
            raise TypeError("flash_attention: documents must be an integer tensor (B, T) of document ids")
        if tuple(documents.shape) != (q.shape[0], q.shape[2]):
            raise ValueError(
                f"flash_attention: documents must be (B, T) = {(q.shape[0], q.shape[2])}, "
                f"got {tuple(documents.shape)}"
            )
        if documents.device != q.device:
            raise ValueError(f"flash_attention: documents are on {documents.device}, q on {q.device}")


def _softmax_scale(scale: float | None, d_qk: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d_qk)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"flash_attention: scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"flash_attention: scale must be finite, got {scale}")
    return float(scale)


def _head_meta(d_qk: int, d_vo: int, dtype: torch.dtype) -> dict:
    """Constexpr meta-parameters shared by the kernels."""
    return {
        "D_QK": d_qk,
        "D_VO": d_vo,
        # tl.dot needs power-of-two tiles of at least 16 along the reduction axis.
        "BLOCK_DQK": max(16, triton.next_power_of_2(d_qk)),
        "BLOCK_DVO": max(16, triton.next_power_of_2(d_vo)),
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def _tma_compatible(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address `t` (B, H, T, d): a unit last stride, a 16-byte aligned
    base and 16-byte multiples for the other strides. Anything else takes the cp.async path."""
    elem = t.element_size()
    return (
        t.stride(3) == 1
        and t.data_ptr() % 16 == 0
        and all(s > 0 and s * elem % 16 == 0 for s in t.stride()[:3])
    )


def _descriptors(
    capability: int | None, allow_tma: bool, *tensors: torch.Tensor
) -> tuple[TensorDescriptor | None, ...]:
    """Tensor descriptors over `tensors` (each (B, H, T, d)) when the target has TMA, `allow_tma`
    and every tensor suits it, else Nones. Block shapes are set per tiling by `_shape_descriptors`."""
    if not allow_tma or TensorDescriptor is None or capability is None or capability < TMA_MIN_CAPABILITY:
        return (None,) * len(tensors)
    if not all(_tma_compatible(t) for t in tensors):
        return (None,) * len(tensors)
    padded = lambda d: max(16, triton.next_power_of_2(d))
    return tuple(
        TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, padded(t.shape[3])]) for t in tensors
    )


def document_bounds(documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, T) -> 2 x (B, T)
    """(start, end), each (B, T) int32 contiguous: the first token of each token's document and
    the end (exclusive) of it, for rows of document ids that are non-decreasing (each document
    a contiguous run). Query i sees key j iff start[i] <= j < end[i] (and j <= i when causal);
    the kernels derive from them which tiles to visit."""
    docs = documents.contiguous()
    start = torch.searchsorted(docs, docs, side="left").to(torch.int32)
    end = torch.searchsorted(docs, docs, side="right").to(torch.int32)
    return start, end


# Fewest rows of a block in any tiling: a buffer of tile counts with a slot per program of any tiling.
_MIN_BLOCK = 16


def _tile_counts(q: torch.Tensor, heads: int) -> torch.Tensor:
    """A zeroed buffer for one kernel's per-program tile counts (COUNT_TILES)."""
    return torch.zeros(
        q.shape[0] * heads * triton.cdiv(q.shape[2], _MIN_BLOCK), dtype=torch.int32, device=q.device
    )


def _pruner(kind: str, launch: runtime.KernelLaunch) -> Callable:
    return lambda configs, device: prune_configs(kind, configs, launch.named_args(), device)


def _variant(
    q: torch.Tensor, k: torch.Tensor, bounds: tuple | None, tiles: torch.Tensor | None
) -> dict[str, object]:
    """The constexprs of grouped-query attention, documents and tile counting: none at all
    without them, so that plain attention compiles exactly as it always has."""
    variant: dict[str, object] = {}
    if q.shape[1] != k.shape[1]:
        variant["GROUP"] = q.shape[1] // k.shape[1]
    if bounds is not None:
        variant["HAS_DOCS"] = True
    if tiles is not None:
        variant["COUNT_TILES"] = True
    return variant


def forward_launch(
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H, T, d_qk)
    v: torch.Tensor,  # (B, H, T, d_vo)
    o: torch.Tensor,  # (B, H, T, d_vo) output
    lse: torch.Tensor,  # (B, H, T) fp32 output
    causal: bool,
    sm_scale: float,
    capability: int | None,
    allow_tma: bool = True,
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    tiles: torch.Tensor | None = None,
) -> runtime.KernelLaunch:
    """The forward kernel's launch for a GPU of `capability` (90: sm_90, None: the interpreter).
    On sm_90 K and V stream through TMA descriptors when their layout allows (and `allow_tma`;
    False forces the pointer path, which inputs TMA cannot address take anyway). `bounds`: the
    documents' `document_bounds`; `tiles`: a `_tile_counts` buffer the programs count into."""
    B, H, T, d_qk = q.shape
    k_desc, v_desc = _descriptors(capability, allow_tma, k, v)
    tma = k_desc is not None
    launch = runtime.KernelLaunch(
        name=KERNEL_NAMES["fwd"],
        kernel=_attn_fwd_kernel,
        grid=lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H, B),
        args=(
            q,
            k,
            v,
            o,
            lse,
            k_desc,
            v_desc,
            *(bounds or (None, None)),
            tiles,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *o.stride(),
            H,
            T,
            triton.next_power_of_2(T),
            abs(sm_scale) * LOG2E,
        ),  # fmt: skip
        kwargs={
            "CAUSAL": bool(causal),
            "NEGATE_Q": sm_scale < 0,
            "KV_TMA": tma,
            **_head_meta(d_qk, v.shape[3], q.dtype),
            **_variant(q, k, bounds, tiles),
        },
        # A fixed tiling (the interpreter's, or a test's) launches the kernel itself, untuned.
        **_tuned_launch("fwd", tma, (_attn_fwd, _attn_fwd_tma)),
        pre_hook=_shape_descriptors,
    )
    launch.prune = _pruner("fwd", launch)
    return launch


def backward_launches(
    do: torch.Tensor,  # (B, H, T, d_vo), in the input dtype
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H, T, d_qk)
    v: torch.Tensor,  # (B, H, T, d_vo)
    o: torch.Tensor,  # (B, H, T, d_vo)
    lse: torch.Tensor,  # (B, H, T) contiguous fp32
    delta: torch.Tensor,  # (B, H, T) contiguous fp32 output of the preprocess
    dq: torch.Tensor,  # (B, H, T, d_qk) output
    dk: torch.Tensor,  # (B, H, T, d_qk) output
    dv: torch.Tensor,  # (B, H, T, d_vo) output
    causal: bool,
    sm_scale: float,
    capability: int | None,
    allow_tma: bool = True,
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[runtime.KernelLaunch]:
    """The backward's three launches, in order: delta = rowsum(dO * O), then dK/dV, then dQ. On
    sm_90 the streamed operands (Q and dO for dK/dV, K and V for dQ) go through TMA descriptors
    when their layout allows. `bounds`: the documents' `document_bounds`; `tiles`: the dK/dV
    and dQ kernels' `_tile_counts` buffers."""
    B, H, T, d_qk = q.shape
    H_kv = k.shape[1]
    dkdv_tiles, dq_tiles = tiles or (None, None)
    d_vo = v.shape[3]
    meta = _head_meta(d_qk, d_vo, q.dtype)
    scales = (H, T, triton.next_power_of_2(T), sm_scale, sm_scale * LOG2E)
    pre_tile = _fixed_tiling("preprocess") or _PREPROCESS_TILE
    preprocess = runtime.KernelLaunch(
        name="attn_bwd_preprocess",
        kernel=_attn_bwd_preprocess_kernel,
        grid=(triton.cdiv(T, pre_tile["BLOCK_M"]), H, B),
        args=(o, do, delta, *o.stride(), *do.stride(), H, T),
        kwargs={"D_VO": d_vo, "BLOCK_DVO": meta["BLOCK_DVO"]},
        configs=[runtime.config(pre_tile)],
    )

    q_desc, do_desc = _descriptors(capability, allow_tma, q, do)
    dkdv = runtime.KernelLaunch(
        name=KERNEL_NAMES["dkdv"],
        kernel=_attn_bwd_dkdv_kernel,
        grid=lambda m: (triton.cdiv(T, m["BLOCK_N"]), H_kv, B),
        args=(
            q,
            k,
            v,
            do,
            lse,
            delta,
            dk,
            dv,
            q_desc,
            do_desc,
            *(bounds or (None, None)),
            dkdv_tiles,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *do.stride(),
            *dk.stride(),
            *dv.stride(),
            *scales,
        ),  # fmt: skip
        kwargs={
            "CAUSAL": bool(causal),
            "QDO_TMA": q_desc is not None,
            **meta,
            **_variant(q, k, bounds, dkdv_tiles),
        },
        **_tuned_launch("dkdv", q_desc is not None, (_attn_bwd_dkdv, _attn_bwd_dkdv_tma)),
        pre_hook=_shape_descriptors,
    )
    dkdv.prune = _pruner("dkdv", dkdv)

    k_desc, v_desc = _descriptors(capability, allow_tma, k, v)
    dq_launch = runtime.KernelLaunch(
        name=KERNEL_NAMES["dq"],
        kernel=_attn_bwd_dq_kernel,
        grid=lambda m: (triton.cdiv(T, m["BLOCK_M"]), H, B),
        args=(
            q,
            k,
            v,
            do,
            lse,
            delta,
            dq,
            k_desc,
            v_desc,
            *(bounds or (None, None)),
            dq_tiles,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *do.stride(),
            *dq.stride(),
            *scales,
        ),  # fmt: skip
        kwargs={
            "CAUSAL": bool(causal),
            "KV_TMA": k_desc is not None,
            **meta,
            **_variant(q, k, bounds, dq_tiles),
        },
        **_tuned_launch("dq", k_desc is not None, (_attn_bwd_dq, _attn_bwd_dq_tma)),
        pre_hook=_shape_descriptors,
    )
    dq_launch.prune = _pruner("dq", dq_launch)
    return [preprocess, dkdv, dq_launch]


def flash_attention_forward(
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H_kv, T, d_qk), H_kv dividing H
    v: torch.Tensor,  # (B, H_kv, T, d_vo)
    causal: bool = True,
    scale: float | None = None,
    documents: torch.Tensor | None = None,  # (B, T) integer document ids, non-decreasing per row
    tiles: torch.Tensor | None = None,  # a `_tile_counts` buffer: the programs count their key blocks
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return o (B, H, T, d_vo) in the input dtype and lse (B, H, T) fp32 in base 2 (log2 sum exp2 of
    the scaled logits times log2(e)), which the backward needs."""
    _check_inputs(q, k, v, documents)
    B, H, T, _ = q.shape
    sm_scale = _softmax_scale(scale, q.shape[3])
    o = torch.empty((B, H, T, v.shape[3]), dtype=q.dtype, device=q.device)  # (B, H, T, d_vo)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)  # (B, H, T)
    bounds = document_bounds(documents) if documents is not None else None
    capability = _launch_capability(q.device)
    forward_launch(q, k, v, o, lse, causal, sm_scale, capability, bounds=bounds, tiles=tiles).run()
    return o, lse


def flash_attention_backward(
    do: torch.Tensor,  # (B, H, T, d_vo)
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H_kv, T, d_qk)
    v: torch.Tensor,  # (B, H_kv, T, d_vo)
    o: torch.Tensor,  # (B, H, T, d_vo) from flash_attention_forward
    lse: torch.Tensor,  # (B, H, T) fp32 from flash_attention_forward
    causal: bool = True,
    scale: float | None = None,
    documents: torch.Tensor | None = None,  # (B, T) as given to the forward
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,  # dK/dV's and dQ's `_tile_counts`
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (dq, dk, dv), each shaped and typed like its input. Deterministic: no atomics (with
    grouped-query heads a dK/dV program sums its group's query heads in order)."""
    _check_inputs(q, k, v, documents)
    if do.shape != o.shape or lse.shape != q.shape[:3]:
        raise ValueError(
            f"flash_attention_backward: do {tuple(do.shape)} must match o {tuple(o.shape)} and lse "
            f"{tuple(lse.shape)} must be (B, H, T) = {tuple(q.shape[:3])}"
        )
    sm_scale = _softmax_scale(scale, q.shape[3])
    do = do.to(q.dtype)  # autograd may hand a gradient in another dtype (e.g. under autocast)
    lse = lse.contiguous()  # (B, H, T), indexed as (b * H + h) * T + t
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)  # (B, H, T) rowsum(dO * O)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (B, H, T, d_qk)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # (B, H_kv, T, d_qk)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # (B, H_kv, T, d_vo)
    bounds = document_bounds(documents) if documents is not None else None
    capability = _launch_capability(q.device)
    launches = backward_launches(
        do, q, k, v, o, lse, delta, dq, dk, dv, causal, sm_scale, capability, bounds=bounds, tiles=tiles
    )
    for launch in launches:
        launch.run()
    return dq, dk, dv


def visited_tiles(
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H_kv, T, d_qk)
    v: torch.Tensor,  # (B, H_kv, T, d_vo)
    causal: bool = True,
    documents: torch.Tensor | None = None,  # (B, T)
) -> dict[str, int]:
    """The tiles of the (T, T) score matrix each kernel visits in one forward and backward, summed
    over batch rows and heads: {"fwd": key blocks of the forward's query blocks, "dkdv": query
    blocks of the dK/dV programs' key blocks (each of a group's query heads counted), "dq": key
    blocks of the dQ programs}. The programs count what their loops visit (COUNT_TILES), with the
    tiling this process launches; the work of each kernel is proportional to its count."""
    counts = {kind: _tile_counts(q, q.shape[1]) for kind in ("fwd", "dkdv", "dq")}
    o, lse = flash_attention_forward(q, k, v, causal, None, documents, tiles=counts["fwd"])
    do = torch.ones_like(o)
    flash_attention_backward(
        do, q, k, v, o, lse, causal, None, documents, tiles=(counts["dkdv"], counts["dq"])
    )
    return {kind: int(buffer.sum()) for kind, buffer in counts.items()}


# ---------------------------------------------------------------------------------------------
# The custom op and the public function
# ---------------------------------------------------------------------------------------------
# `lmsys::flash_attention_fwd` returns the log-sum-exp beside the output, for the backward;
# `register_autograd` saves both, and the backward launches `lmsys::flash_attention_bwd`. The
# fakes give shapes, dtypes and strides only, so torch.compile traces the op without running it.


@torch.library.custom_op("lmsys::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o (B, H, T, d_vo), lse (B, H, T) fp32): `flash_attention_forward` as an op."""
    return flash_attention_forward(q, k, v, causal, scale, documents)


@flash_attention_fwd.register_fake
def _(q, k, v, causal, scale, documents=None):
    b, h, t, _ = q.shape
    return q.new_empty((b, h, t, v.shape[3])), q.new_empty((b, h, t), dtype=torch.float32)


@torch.library.custom_op("lmsys::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): `flash_attention_backward` as an op."""
    return flash_attention_backward(do, q, k, v, o, lse, causal, scale, documents)


@flash_attention_bwd.register_fake
def _(do, q, k, v, o, lse, causal, scale, documents=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as launched


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, causal, scale, documents = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, documents)
    ctx.causal, ctx.scale = causal, scale


def _attention_backward(ctx, do: torch.Tensor, _dlse: torch.Tensor | None):
    q, k, v, o, lse, documents = ctx.saved_tensors
    dq, dk, dv = flash_attention_bwd(do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale, documents)
    return dq, dk, dv, None, None, None


flash_attention_fwd.register_autograd(_attention_backward, setup_context=_attention_setup)


def flash_attention(
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H_kv, T, d_qk), H_kv dividing H
    v: torch.Tensor,  # (B, H_kv, T, d_vo)
    causal: bool = True,
    scale: float | None = None,
    documents: torch.Tensor | None = None,  # (B, T) integer document ids, non-decreasing per row
) -> torch.Tensor:
    """Scaled dot-product attention, softmax(scale * q k^T [mask]) v -> (B, H, T, d_vo).

    scale=None means 1/sqrt(d_qk). Causal: key j is visible to query i iff j <= i. Grouped-query
    attention: with H_kv < H key/value heads, query head h reads key/value head h // (H / H_kv)
    (multi-query at H_kv = 1), without repeating them in memory. Documents (packed rows): key j
    is visible to query i only when both are of one document (a contiguous run of equal ids),
    and the kernels skip every tile outside the rows' documents: the work grows with the sum of
    the squared document lengths, not with T^2. Runs the custom op `lmsys::flash_attention_fwd`
    (differentiable; torch.compile traces it).
    """
    _check_inputs(q, k, v, documents)
    sm_scale = _softmax_scale(scale, q.shape[3])
    return flash_attention_fwd(q, k, v, bool(causal), sm_scale, documents)[0]
