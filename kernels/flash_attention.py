"""FlashAttention-2 forward and backward as Triton kernels, with a plain torch reference.

    flash_attention(q, k, v, causal=True, scale=None) -> o       # differentiable
    q, k: (B, H, T, d_qk)   v: (B, H, T, d_vo)   o: (B, H, T, d_vo), in the input dtype

Head widths d_qk and d_vo are independent, 1..256 each (non-powers of two are padded inside the
kernel to the next power of two and masked); T is any length >= 1; inputs may be non-contiguous
(strides are passed to the kernels). fp32, fp16 and bf16 inputs accumulate in fp32. fp32 inputs
use IEEE fp32 dot products, not TF32, so fp32 results match the fp32 reference.

Layering, as in the other kernel files: private `@triton.jit` kernels -> host launchers
`flash_attention_forward` / `flash_attention_backward` -> `FlashAttentionFunction` ->
`flash_attention`. `attention_reference` is the readable torch definition the kernels are
tested against.

On a GPU every kernel is wrapped in `triton.autotune` (pruned per head width, keyed on the
shapes that change the best tiling, persisted to Triton's cache dir where supported). Under the
Triton CPU interpreter (TRITON_INTERPRET=1) tuning would run every config through a Python
emulator, so one small fixed tiling (`INTERPRETER_BLOCKS`) is used instead; the kernel code is
the same on both.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOG2E = 1.4426950408889634  # log2(e): the kernels work with exp2, which maps to one hardware instruction


def _interpreting() -> bool:
    """True when `@triton.jit` builds interpreted (CPU, numpy) kernels; decided once, at import."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # triton >= 3.3 parses the variable itself (also accepts "true"/"on")
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET") == "1"


# The jitted kernels below are interpreted or compiled depending on this, fixed at decoration time.
_INTERPRET = _interpreting()

# Fixed tiling used under the interpreter, whose cost grows with the number of loop steps. Tests
# swap in 16-row and unequal blocks to exercise the multi-block loop bounds on short sequences.
INTERPRETER_BLOCKS: dict[str, dict[str, int]] = {
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
# LSE is stored in the same base-2 units (LSE2 = LSE * log2(e)).
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
def _attn_fwd_inner(
    acc,  # (BLOCK_M, BLOCK_DVO) fp32 unnormalised output
    l_i,  # (BLOCK_M,) fp32 running softmax denominator
    m_i,  # (BLOCK_M,) fp32 running row max of the base-2 logits
    q,  # (BLOCK_M, BLOCK_DQK) query tile, input dtype
    k_ptrs,  # (BLOCK_N, BLOCK_DQK) pointers to K[b, h, 0:BLOCK_N, :], advanced by the loop
    v_ptrs,  # (BLOCK_N, BLOCK_DVO) pointers to V[b, h, 0:BLOCK_N, :]
    stride_kt,  # K stride over T
    stride_vt,  # V stride over T
    offs_m,  # (BLOCK_M,) query row indices of this program
    offs_dqk,  # (BLOCK_DQK,) arange
    offs_dvo,  # (BLOCK_DVO,) arange
    T,  # int: sequence length
    qk_scale,  # fp32: softmax scale * log2(e)
    lo,  # first key row of the loop (multiple of BLOCK_N)
    hi,  # loop end (exclusive)
    D_QK: tl.constexpr,
    D_VO: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DVO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key in [lo, hi) is < T and visible to every row
    DOT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key rows
        k = _load_tile(k_ptrs + start_n * stride_kt, cols, offs_dqk, T, D_QK, BLOCK_DQK, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:
            visible = cols[None, :] < T
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None])
            # Key 0 is visible to every row (also padding rows), so the first block always gives
            # a finite max and later all-masked rows give exp2(-inf) = 0, never NaN.
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # (BLOCK_M,)
        alpha = tl.exp2(m_i - m_new)  # (BLOCK_M,) 0 on the first block, where m_i = -inf
        p = tl.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_ptrs + start_n * stride_vt, cols, offs_dvo, T, D_VO, BLOCK_DVO, MASKED)
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
    qk_scale,  # fp32: softmax scale * log2(e)
    D_QK: tl.constexpr,  # q/k head width
    D_VO: tl.constexpr,  # v/o head width
    BLOCK_DQK: tl.constexpr,  # D_QK padded to a power of two (>= 16 for tl.dot)
    BLOCK_DVO: tl.constexpr,  # D_VO padded likewise
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), ignored for fp16/bf16
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # key rows per loop step
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs blocks of at least 16 rows")
    tl.static_assert(BLOCK_DQK >= D_QK and BLOCK_DVO >= D_VO, "padded head width below the real one")
    tl.static_assert(BLOCK_DQK >= 16 and BLOCK_DVO >= 16, "tl.dot needs a reduction width of at least 16")
    # grid: (cdiv(T, BLOCK_M), H, B)
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_h * stride_kh
    v_base = V + off_b * stride_vb + off_h * stride_vh
    o_base = O + off_b * stride_ob + off_h * stride_oh
    lse_base = LSE + (off_b * H + off_h) * T

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dvo = tl.arange(0, BLOCK_DVO)
    q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_dqk[None, :] * stride_qd
    q = _load_tile(q_ptrs, offs_m, offs_dqk, T, D_QK, BLOCK_DQK, True)  # (BLOCK_M, BLOCK_DQK)
    offs_n = tl.arange(0, BLOCK_N)
    k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_dqk[None, :] * stride_kd  # (BLOCK_N, BLOCK_DQK)
    v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_dvo[None, :] * stride_vd  # (BLOCK_N, BLOCK_DVO)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DVO], dtype=tl.float32)  # fp32 accumulation whatever the input

    # Key blocks entirely below the diagonal (causal) or entirely inside T need no mask.
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, T)
        # key block [n, n + BLOCK_N) is visible to every row iff n + BLOCK_N <= start_m + 1
        full_end = ((start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = T
        full_end = (T // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kt, stride_vt,
        offs_m, offs_dqk, offs_dvo, T, qk_scale, 0, full_end,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_N, CAUSAL, False, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kt, stride_vt,
        offs_m, offs_dqk, offs_dvo, T, qk_scale, full_end, hi,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_N, CAUSAL, True, DOT_PRECISION,
    )  # fmt: skip

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
    D_QK: tl.constexpr,
    D_VO: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DVO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,  # False: every query in [lo, hi) is < T and sees every key of the block
    DOT_PRECISION: tl.constexpr,
):
    # Works on transposed tiles (keys along rows) so dK and dV come out as (BLOCK_N, d) directly.
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m0  # (BLOCK_M,) query rows
        q = _load_tile(q_ptrs + start_m * stride_qt, rows, offs_dqk, T, D_QK, BLOCK_DQK, MASKED)
        do = _load_tile(do_ptrs + start_m * stride_dot, rows, offs_dvo, T, D_VO, BLOCK_DVO, MASKED)
        if MASKED:
            lse = tl.load(lse_base + rows, mask=rows < T, other=0.0)  # (BLOCK_M,)
            delta = tl.load(delta_base + rows, mask=rows < T, other=0.0)  # (BLOCK_M,)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
        p_t = tl.exp2(s_t - lse[None, :])  # P^T, exact probabilities thanks to the saved LSE
        if MASKED:
            visible = rows[None, :] < T
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= rows[None, :])
            p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # dV += P^T dO
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M) = (dO V^T)^T
        ds_t = p_t * (dp_t - delta[None, :])  # dS^T, without the scale c (applied once at the end)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)  # dK += dS^T Q
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
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per loop step
    BLOCK_N: tl.constexpr,  # key rows owned by the program
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs blocks of at least 16 rows")
    tl.static_assert(BLOCK_DQK >= D_QK and BLOCK_DVO >= D_VO, "padded head width below the real one")
    tl.static_assert(BLOCK_DQK >= 16 and BLOCK_DVO >= 16, "tl.dot needs a reduction width of at least 16")
    # grid: (cdiv(T, BLOCK_N), H, B)
    start_n = tl.program_id(0) * BLOCK_N
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_h * stride_kh
    v_base = V + off_b * stride_vb + off_h * stride_vh
    do_base = DO + off_b * stride_dob + off_h * stride_doh
    lse_base = LSE + (off_b * H + off_h) * T
    delta_base = DELTA + (off_b * H + off_h) * T

    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dvo = tl.arange(0, BLOCK_DVO)
    # Key rows >= T load as zeros; their dK/dV rows are garbage-free but never stored anyway.
    k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_dqk[None, :] * stride_kd
    v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_dvo[None, :] * stride_vd
    k = _load_tile(k_ptrs, offs_n, offs_dqk, T, D_QK, BLOCK_DQK, True)  # (BLOCK_N, BLOCK_DQK)
    v = _load_tile(v_ptrs, offs_n, offs_dvo, T, D_VO, BLOCK_DVO, True)  # (BLOCK_N, BLOCK_DVO)
    offs_m0 = tl.arange(0, BLOCK_M)
    q_ptrs = q_base + offs_m0[:, None] * stride_qt + offs_dqk[None, :] * stride_qd  # (BLOCK_M, BLOCK_DQK)
    do_ptrs = do_base + offs_m0[:, None] * stride_dot + offs_dvo[None, :] * stride_dod  # (BLOCK_M, BLOCK_DVO)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DVO], dtype=tl.float32)

    # Query blocks: [lo, mid_lo) straddle the diagonal (causal only), [mid_lo, mid_hi) need no
    # mask, [max(mid_lo, mid_hi), end) hold the tail of T (or are still on the diagonal).
    end = tl.cdiv(T, BLOCK_M) * BLOCK_M
    mid_hi = (T // BLOCK_M) * BLOCK_M
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M  # earlier query blocks see none of these keys
        # first block whose first row is >= the block's last key row
        mid_lo = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_base, delta_base, stride_qt, stride_dot,
            offs_n, offs_dqk, offs_dvo, T, qk_scale, lo, tl.minimum(mid_lo, end),
            D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_M, CAUSAL, True, DOT_PRECISION,
        )  # fmt: skip
    else:
        mid_lo = 0
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, q_ptrs, do_ptrs, lse_base, delta_base, stride_qt, stride_dot,
        offs_n, offs_dqk, offs_dvo, T, qk_scale, mid_lo, mid_hi,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_M, CAUSAL, False, DOT_PRECISION,
    )  # fmt: skip
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, q_ptrs, do_ptrs, lse_base, delta_base, stride_qt, stride_dot,
        offs_n, offs_dqk, offs_dvo, T, qk_scale, tl.maximum(mid_lo, mid_hi), end,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_M, CAUSAL, True, DOT_PRECISION,
    )  # fmt: skip

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
    stride_kt,  # K stride over T
    stride_vt,  # V stride over T
    offs_m,  # (BLOCK_M,) query row indices of this program
    offs_dqk,  # (BLOCK_DQK,) arange
    offs_dvo,  # (BLOCK_DVO,) arange
    T,  # int: sequence length
    qk_scale,  # fp32: softmax scale * log2(e)
    lo,  # first key row of the loop (multiple of BLOCK_N)
    hi,  # loop end (exclusive)
    D_QK: tl.constexpr,
    D_VO: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DVO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key in [lo, hi) is < T and visible to every row
    DOT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key rows
        k = _load_tile(k_ptrs + start_n * stride_kt, cols, offs_dqk, T, D_QK, BLOCK_DQK, MASKED)
        v = _load_tile(v_ptrs + start_n * stride_vt, cols, offs_dvo, T, D_VO, BLOCK_DVO, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s - lse[:, None])
        if MASKED:
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
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows owned by the program
    BLOCK_N: tl.constexpr,  # key rows per loop step
):
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs blocks of at least 16 rows")
    tl.static_assert(BLOCK_DQK >= D_QK and BLOCK_DVO >= D_VO, "padded head width below the real one")
    tl.static_assert(BLOCK_DQK >= 16 and BLOCK_DVO >= 16, "tl.dot needs a reduction width of at least 16")
    # grid: (cdiv(T, BLOCK_M), H, B)
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_h * stride_kh
    v_base = V + off_b * stride_vb + off_h * stride_vh
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
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, T)
        full_end = ((start_m + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = T
        full_end = (T // BLOCK_N) * BLOCK_N
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kt, stride_vt,
        offs_m, offs_dqk, offs_dvo, T, qk_scale, 0, full_end,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_N, CAUSAL, False, DOT_PRECISION,
    )  # fmt: skip
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kt, stride_vt,
        offs_m, offs_dqk, offs_dvo, T, qk_scale, full_end, hi,
        D_QK, D_VO, BLOCK_DQK, BLOCK_DVO, BLOCK_N, CAUSAL, True, DOT_PRECISION,
    )  # fmt: skip

    dq = dq * sm_scale  # dQ = c * dS K
    dq_base = DQ + off_b * stride_dqb + off_h * stride_dqh
    dq_ptrs = dq_base + offs_m[:, None] * stride_dqt + offs_dqk[None, :] * stride_dqd
    _store_tile(dq_ptrs, dq.to(DQ.dtype.element_ty), offs_m, offs_dqk, T, D_QK)


# ----------------------------------------------------------------------------------------------
# Autotuning (GPU only).
# ----------------------------------------------------------------------------------------------

# The tiling that wins depends on the head widths, the mask, the dtype (added to the key by Triton
# itself) and the order of magnitude of T (short sequences want small blocks); the exact T does
# not matter, so T enters the key as a power-of-two bucket and a new length does not re-tune.
_TUNE_KEY = ["T_BUCKET", "D_QK", "D_VO", "CAUSAL"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
_FWD_CONFIGS = [
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 32, 4, 4),
    (64, 64, 4, 3),
    (64, 32, 4, 4),
    (64, 128, 4, 2),
    (32, 32, 4, 2),
]
# dK/dV: a program owns BLOCK_N keys and streams BLOCK_M queries, so the key block is the big one.
_DKDV_CONFIGS = [
    (32, 128, 8, 2),
    (64, 128, 8, 2),
    (32, 128, 4, 3),
    (32, 64, 4, 3),
    (64, 64, 4, 2),
    (16, 64, 4, 3),
    (32, 32, 4, 2),
]
# dQ: a program owns BLOCK_M queries and streams BLOCK_N keys.
_DQ_CONFIGS = [
    (128, 32, 8, 2),
    (128, 64, 8, 2),
    (64, 32, 4, 3),
    (64, 64, 4, 2),
    (32, 64, 4, 3),
    (32, 32, 4, 2),
]


@functools.cache
def _max_shared_memory(device_index: int) -> int:
    """Bytes of shared memory one program may use on this GPU (227 KiB on H100, 163 KiB on A100)."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:  # an unfamiliar driver: assume a consumer-GPU budget rather than fail
        return 99 * 1024


def _make_pruner(kind: str) -> Callable:
    """Build an `early_config_prune` that drops tilings the head widths make infeasible or wasteful.

    Shared memory is estimated as the tiles resident for the whole program plus `num_stages` copies
    of the streamed tiles plus one (BLOCK_M, BLOCK_N) tile for P / dS; configs over the device
    budget would fail to compile (or spill) at large head widths. Accumulators over ~128 fp32
    registers per thread would spill. Blocks larger than the whole sequence only waste work.
    """

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        args = {**named_args, **kwargs}
        dqk, dvo = args["BLOCK_DQK"], args["BLOCK_DVO"]
        elem = args["Q"].element_size()
        device = args["Q"].device
        budget = _max_shared_memory(device.index if device.index is not None else torch.cuda.current_device())
        t_bucket = args["T_BUCKET"]

        def cost(cfg: triton.Config) -> tuple[int, int]:
            bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
            if kind == "fwd":  # Q resident; K, V streamed; acc (BM, dvo)
                resident, streamed, acc = bm * dqk, bn * (dqk + dvo), bm * dvo
            elif kind == "dkdv":  # K, V resident; Q, dO streamed; dK, dV accumulators
                resident, streamed, acc = bn * (dqk + dvo), bm * (dqk + dvo), bn * (dqk + dvo)
            else:  # dq: Q, dO resident; K, V streamed; dQ accumulator
                resident, streamed, acc = bm * (dqk + dvo), bn * (dqk + dvo), bm * dqk
            smem = (resident + cfg.num_stages * streamed + bm * bn) * elem
            regs_per_thread = acc // (cfg.num_warps * 32)
            return smem, regs_per_thread

        if elem == 4:
            # fp32 inputs use IEEE dots, which run on FMA units rather than tensor cores: large
            # tiles gain nothing there and take 30-100 s each to compile (measured for sm_90).
            configs = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 32]
        feasible = [c for c in configs if cost(c)[0] <= budget and cost(c)[1] <= 128]
        sized = [c for c in feasible if max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) <= max(t_bucket, 32)]
        # Never return nothing: fall back to the cheapest tiling, which is the likeliest to compile.
        return sized or feasible or [min(configs, key=lambda c: cost(c)[0])]

    return prune


def _autotuned(kernel: triton.runtime.JITFunction, configs: list[tuple[int, int, int, int]], kind: str):
    """Wrap `kernel` in triton.autotune, persisting results to disk where this Triton supports it."""
    extra = {}
    if "cache_results" in inspect.signature(triton.autotune).parameters:  # triton >= 3.2
        extra["cache_results"] = True  # a second process reuses the tuned choice without re-timing
    return triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in configs
        ],
        key=_TUNE_KEY,
        prune_configs_by={"early_config_prune": _make_pruner(kind)},
        **extra,
    )(kernel)


if _INTERPRET:
    # Launch the plain kernels with INTERPRETER_BLOCKS (see `_blocks`).
    _attn_fwd = _attn_fwd_kernel
    _attn_bwd_dkdv = _attn_bwd_dkdv_kernel
    _attn_bwd_dq = _attn_bwd_dq_kernel
else:
    _attn_fwd = _autotuned(_attn_fwd_kernel, _FWD_CONFIGS, "fwd")
    _attn_bwd_dkdv = _autotuned(_attn_bwd_dkdv_kernel, _DKDV_CONFIGS, "dkdv")
    _attn_bwd_dq = _autotuned(_attn_bwd_dq_kernel, _DQ_CONFIGS, "dq")

# The preprocess is a memory-bound row reduction; one tiling is fine everywhere.
_PREPROCESS_BLOCK_M = 64


def _blocks(kind: str) -> dict[str, int]:
    """Launch-time block sizes: fixed under the interpreter, chosen by the autotuner on GPU."""
    return dict(INTERPRETER_BLOCKS[kind]) if _INTERPRET else {}


# ----------------------------------------------------------------------------------------------
# Host side.
# ----------------------------------------------------------------------------------------------


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise one clear TypeError/ValueError for inputs the kernels cannot take."""
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
    if not (q.shape[:3] == k.shape[:3] == v.shape[:3]):
        raise ValueError(
            "flash_attention: q, k, v must agree on (B, H, T), got "
            f"{tuple(q.shape[:3])}, {tuple(k.shape[:3])}, {tuple(v.shape[:3])}"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"flash_attention: q and k head widths differ: d_qk {q.shape[3]} vs {k.shape[3]}")
    for name, d in (("q/k", q.shape[3]), ("v", v.shape[3])):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"flash_attention: {name} head width {d} must be between 1 and {MAX_HEAD_DIM}")
    if min(q.shape[:3]) < 1:
        raise ValueError(f"flash_attention: B, H and T must be >= 1, got {tuple(q.shape[:3])}")
    if q.device.type == "cpu" and not _INTERPRET:
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


def flash_attention_forward(
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H, T, d_qk)
    v: torch.Tensor,  # (B, H, T, d_vo)
    causal: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return o (B, H, T, d_vo) in the input dtype and lse (B, H, T) fp32 in base 2 (log2 sum exp2 of
    the scaled logits times log2(e)), which the backward needs."""
    _check_inputs(q, k, v)
    B, H, T, d_qk = q.shape
    d_vo = v.shape[3]
    sm_scale = _softmax_scale(scale, d_qk)
    o = torch.empty((B, H, T, d_vo), dtype=q.dtype, device=q.device)  # (B, H, T, d_vo)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)  # (B, H, T)
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H, B)
    _attn_fwd[grid](
        q, k, v, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        H, T, triton.next_power_of_2(T), sm_scale * LOG2E,
        CAUSAL=bool(causal), **_head_meta(d_qk, d_vo, q.dtype), **_blocks("fwd"),
    )  # fmt: skip
    return o, lse


def flash_attention_backward(
    do: torch.Tensor,  # (B, H, T, d_vo)
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H, T, d_qk)
    v: torch.Tensor,  # (B, H, T, d_vo)
    o: torch.Tensor,  # (B, H, T, d_vo) from flash_attention_forward
    lse: torch.Tensor,  # (B, H, T) fp32 from flash_attention_forward
    causal: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (dq, dk, dv), each shaped and typed like its input. Deterministic: no atomics."""
    _check_inputs(q, k, v)
    if do.shape != o.shape or lse.shape != q.shape[:3]:
        raise ValueError(
            f"flash_attention_backward: do {tuple(do.shape)} must match o {tuple(o.shape)} and lse "
            f"{tuple(lse.shape)} must be (B, H, T) = {tuple(q.shape[:3])}"
        )
    B, H, T, d_qk = q.shape
    d_vo = v.shape[3]
    sm_scale = _softmax_scale(scale, d_qk)
    do = do.to(q.dtype)  # autograd may hand a gradient in another dtype (e.g. under autocast)
    lse = lse.contiguous()  # (B, H, T), indexed as (b * H + h) * T + t
    meta = _head_meta(d_qk, d_vo, q.dtype)

    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)  # (B, H, T) rowsum(dO * O)
    pre_block = INTERPRETER_BLOCKS["preprocess"]["BLOCK_M"] if _INTERPRET else _PREPROCESS_BLOCK_M
    _attn_bwd_preprocess_kernel[(triton.cdiv(T, pre_block), H, B)](
        o, do, delta,
        *o.stride(), *do.stride(),
        H, T,
        D_VO=d_vo, BLOCK_DVO=meta["BLOCK_DVO"], BLOCK_M=pre_block,
    )  # fmt: skip

    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # (B, H, T, d_qk)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # (B, H, T, d_qk)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)  # (B, H, T, d_vo)
    t_bucket = triton.next_power_of_2(T)
    _attn_bwd_dkdv[lambda m: (triton.cdiv(T, m["BLOCK_N"]), H, B)](
        q, k, v, do, lse, delta, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        H, T, t_bucket, sm_scale, sm_scale * LOG2E,
        CAUSAL=bool(causal), **meta, **_blocks("dkdv"),
    )  # fmt: skip
    _attn_bwd_dq[lambda m: (triton.cdiv(T, m["BLOCK_M"]), H, B)](
        q, k, v, do, lse, delta, dq,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        H, T, t_bucket, sm_scale, sm_scale * LOG2E,
        CAUSAL=bool(causal), **meta, **_blocks("dq"),
    )  # fmt: skip
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,  # (B, H, T, d_qk)
        k: torch.Tensor,  # (B, H, T, d_qk)
        v: torch.Tensor,  # (B, H, T, d_vo)
        causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        o, lse = flash_attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.scale = scale
        return o  # (B, H, T, d_vo)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H, T, d_qk)
    v: torch.Tensor,  # (B, H, T, d_vo)
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention, softmax(scale * q k^T [causal mask]) v -> (B, H, T, d_vo).

    scale=None means 1/sqrt(d_qk). Causal: key j is visible to query i iff j <= i.
    """
    return FlashAttentionFunction.apply(q, k, v, causal, scale)


def attention_reference(
    q: torch.Tensor,  # (B, H, T, d_qk)
    k: torch.Tensor,  # (B, H, T, d_qk)
    v: torch.Tensor,  # (B, H, T, d_vo)
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """The definition the kernels are tested against: fp32 matmul + softmax (float64 stays float64),
    materialising the (T, T) matrix; returned in the input dtype."""
    d_qk, T = q.shape[-1], q.shape[-2]
    sm_scale = 1.0 / math.sqrt(d_qk) if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (q.to(compute) @ k.to(compute).transpose(-2, -1)) * sm_scale  # (B, H, T, T)
    if causal:
        visible = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # key j <= query i
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1)  # (B, H, T, T)
    return (p @ v.to(compute)).to(q.dtype)  # (B, H, T, d_vo)
