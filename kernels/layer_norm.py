"""Row-wise layer normalisation (SPEC section 5) as Triton kernels, plus a fused residual add.

Every row of the last dimension (width N) is normalised with population statistics

    mu = mean(x),  var = mean((x - mu)^2),  sigma = sqrt(var),  xhat = (x - mu) / r

where the denominator r depends on the formula:

    "sqrt_var_eps"  r = sqrt(var + eps)     GPT-2 and most code (torch.nn.LayerNorm)
    "std_plus_eps"  r = sigma + eps
    "exact"         r = sigma               no eps at all: eps is ignored

then optionally y = gamma * xhat + beta (weight and bias are each optional).

RMS normalisation (SPEC section 11, the Llama family) is a fourth formula of the same kernels,
with its own public functions `rms_norm` / `add_rms_norm` (no mean, no bias):

    "rms"           xhat = x / sqrt(mean(x^2) + eps),  y = gamma * round(xhat)

where round() is the rounding to the input dtype that transformers' LlamaRMSNorm applies before
the gain (kernels/reference.py, `rms_norm_reference`); statistics are fp32 as for every formula.

What lmsys does with a constant row under "exact": var = 0, so xhat = 0 / 0. No eps is added
behind the caller's back: the result is NaN whenever the row mean is computed exactly (N = 1,
a row of zeros, most constant rows), and the gradients are NaN too. When rounding leaves the
computed mean an ulp away from the constant, the row instead comes out as +-1 values. Either
way the output is meaningless; use an eps formula when constant rows can occur.

Files follow the kernel pattern of docs/DESIGN.md: `_layer_norm_fwd_kernel` / `_layer_norm_bwd_kernel`
(private, @triton.jit) -> host launchers `layer_norm_forward` / `layer_norm_backward` ->
the custom ops beside them (`lmsys::layer_norm_fwd`, `lmsys::add_layer_norm_fwd`, and
`lmsys::layer_norm_bwd` for both; `lmsys::rms_norm_fwd`, `lmsys::add_rms_norm_fwd` and
`lmsys::rms_norm_bwd`; fakes, `register_autograd`) -> `layer_norm` / `add_layer_norm` /
`rms_norm` / `add_rms_norm`, which check the inputs and call the ops: the one path for callers and
tests alike. The plain torch references `layer_norm_reference` / `add_layer_norm_reference` /
`rms_norm_reference` are in kernels/reference.py.

Statistics are always fp32; inputs may be fp32, fp16 or bf16 and outputs come back in the
input dtype. (Under the Triton CPU interpreter, triton 3.x, the final fp32 -> bf16 rounding is
toward zero instead of to nearest even as on a GPU: bf16 results, the fused op's `summed`
included, may differ from torch's by one bf16 ulp there.) Weight-gradient reductions are
deterministic: fp32 partial sums per program into a (P, N) buffer, then a torch `.sum(0)`; no
atomics, no locks.

Tiling (kernels/runtime.py): not timed. Each launch has one config, derived from the row width
(`_geometry`: whole rows in one tile up to a width, 16 values per thread), the same under the
interpreter; `python -m tools.inspect` compiles it for every model width and the wide rows.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.reference import (  # noqa: F401  (the tests import the references from here too)
    LAYER_NORM_FORMULAS,
    add_layer_norm_reference,
    layer_norm_reference,
    rms_norm_reference,
)

__all__ = [
    "FORMULAS",
    "MAX_N",
    "layer_norm",
    "add_layer_norm",
    "rms_norm",
    "add_rms_norm",
    "layer_norm_fwd",
    "add_layer_norm_fwd",
    "layer_norm_bwd",
    "layer_norm_forward",
    "layer_norm_backward",
    "layer_norm_reference",
    "add_layer_norm_reference",
    "rms_norm_reference",
]

# Formula name -> the constexpr int the kernels branch on.
FORMULAS: dict[str, int] = {name: i for i, name in enumerate(LAYER_NORM_FORMULAS)}  # -> FORMULA constexpr
RMS = "rms"  # the fourth formula: `rms_norm` / `add_rms_norm` only (no mean, no bias)
_FORMULA_CODES = {**FORMULAS, RMS: len(FORMULAS)}  # every formula the kernels compute -> constexpr
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

MAX_N = 65536  # widest row accepted (the widest row supported; wide rows loop over column chunks)
# Widest row one program keeps in registers. The backward holds more live fp32 tiles (x, dy,
# xhat, g and the dgamma/dbeta accumulators), so it switches to chunks earlier: a single
# 16384-wide backward tile would need 32 warps at 16 values per thread, twice the register file.
_FWD_MAX_SINGLE_BLOCK = 16384
_BWD_MAX_SINGLE_BLOCK = 8192
# Tile elements per warp: 16 fp32 values per thread in both directions. Measured with
# `python -m tools.inspect` (Triton 3.9, ptxas -v), no tile the launchers pick spills on sm_80 or
# sm_90: the forward takes 40-60 registers, the backward 100-128. The backward used 8 values per
# thread before: 32 warps at N = 8192, where 1024 threads leave 64 registers each, and it spilled
# 40 B (56 B with the residual gradient); and at N <= 2048 one 16-warp CTA of about 80 registers
# filled an SM with 15-20 KiB of loads in flight. 16 values per thread halve the warps per tile:
# 8 warps for rows up to 4096 (two CTAs per SM, twice the bytes in flight) and 16 at 8192.
_FWD_ELEMS_PER_WARP = 512
_BWD_ELEMS_PER_WARP = 512
_CHUNK = 4096  # column chunk of the looped path for rows wider than the single-block limit
_TILE = 4096  # narrow rows: one program normalises BLOCK_M = _TILE // BLOCK_N rows at once
_MAX_TILE = 16384  # static bound on BLOCK_M * BLOCK_N checked inside the kernels


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rstd_from_var(var, eps, FORMULA: tl.constexpr):
    """1 / r(var) per row, fp32. FORMULA: 0 sqrt_var_eps, 1 std_plus_eps, 2 exact, 3 rms (var is
    then the mean square)."""
    if FORMULA == 0 or FORMULA == 3:
        rstd = 1.0 / tl.sqrt_rn(var + eps)
    elif FORMULA == 1:
        rstd = 1.0 / (tl.sqrt_rn(var) + eps)
    else:
        rstd = 1.0 / tl.sqrt_rn(var)  # inf for a constant row: by definition, see module doc
    return rstd


@triton.jit
def _load_ln_input(
    X,  # *T: (M, N) input rows
    R,  # *T: (M, N) residual rows, read only if HAS_RESIDUAL
    S,  # *T: (M, N) out: X + R, written only if HAS_RESIDUAL and STORE_SUM
    offs_x,  # (BLOCK_M, BLOCK_N) int64 element offsets into X
    offs_r,  # (BLOCK_M, BLOCK_N) int64 element offsets into R
    offs_s,  # (BLOCK_M, BLOCK_N) int64 element offsets into S
    mask,  # (BLOCK_M, BLOCK_N) bool: inside the (M, N) matrix
    HAS_RESIDUAL: tl.constexpr,
    STORE_SUM: tl.constexpr,
):
    """The tile the layer norm sees, in fp32: x, or x + residual rounded to T like torch's add."""
    x = tl.load(X + offs_x, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + offs_r, mask=mask, other=0.0)
        # fp32 add, rounded once to T: bitwise what `x + residual` gives in torch, so that the
        # returned `summed` and the normalised values agree exactly.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
        if STORE_SUM:
            tl.store(S + offs_s, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _layer_norm_fwd_kernel(
    X,  # *T: (M, N) input rows, unit column stride
    R,  # *T: (M, N) residual rows (read only if HAS_RESIDUAL; else any pointer)
    S,  # *T: (M, N) out: X + R in T (written only if HAS_RESIDUAL)
    Y,  # *T: (M, N) out: normalised (and affine) rows
    W,  # *Tw: (N,) gamma (read only if HAS_WEIGHT)
    B,  # *Tw: (N,) beta (read only if HAS_BIAS)
    Mean,  # *fp32: (M,) out: row mean (not written by "rms", which has none)
    Rstd,  # *fp32: (M,) out: row 1 / r(var), the statistic the backward needs
    stride_x,  # int: row stride of X, in elements
    stride_r,  # int: row stride of R
    stride_s,  # int: row stride of S
    stride_y,  # int: row stride of Y
    M,  # int: number of rows
    N,  # int: row width
    eps,  # fp32: eps of the formula (ignored by "exact")
    FORMULA: tl.constexpr,  # 0 sqrt_var_eps, 1 std_plus_eps, 2 exact, 3 rms
    HAS_RESIDUAL: tl.constexpr,  # normalise X + R and store it to S
    HAS_WEIGHT: tl.constexpr,  # multiply by gamma
    HAS_BIAS: tl.constexpr,  # add beta
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per tile: >= N when SINGLE_BLOCK, else the chunk width
    SINGLE_BLOCK: tl.constexpr,  # the whole row fits one tile: read X once, keep it in registers
):
    """One program normalises BLOCK_M consecutive rows. Grid: (cdiv(M, BLOCK_M),)."""
    tl.static_assert(BLOCK_M * BLOCK_N <= 16384)  # = _MAX_TILE: register budget per program
    tl.static_assert((FORMULA >= 0) & (FORMULA <= 3))
    tl.static_assert(not (FORMULA == 3 and HAS_BIAS), "rms has no bias")
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)[:, None]  # (BLOCK_M, 1): int64, M * N may pass 2^31
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)

    # Statistics, all fp32 accumulation.
    if SINGLE_BLOCK:
        mask = row_mask[:, None] & (cols[None, :] < N)  # (BLOCK_M, BLOCK_N)
        x = _load_ln_input(
            X,
            R,
            S,
            rows64 * stride_x + cols[None, :],
            rows64 * stride_r + cols[None, :],
            rows64 * stride_s + cols[None, :],
            mask,
            HAS_RESIDUAL,
            True,
        )  # (BLOCK_M, BLOCK_N) fp32
        if FORMULA == 3:  # rms: the mean square about 0 (masked lanes loaded as 0)
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N  # (BLOCK_M,)
            xc = tl.where(mask, x - mean[:, None], 0.0)  # two-pass variance, exact in registers
        var = tl.sum(xc * xc, axis=1) / N  # (BLOCK_M,)
    elif FORMULA == 3:
        # Wide rows, rms: a sum of squares per lane, no mean to cancel against.
        sq_l = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            x = _load_ln_input(
                X,
                R,
                S,
                rows64 * stride_x + c[None, :],
                rows64 * stride_r + c[None, :],
                rows64 * stride_s + c[None, :],
                row_mask[:, None] & (c[None, :] < N),
                HAS_RESIDUAL,
                True,
            )
            sq_l += x * x
        var = tl.sum(sq_l, axis=1) / N  # (BLOCK_M,)
    else:
        # Wide rows: one sweep of Welford updates, each lane owning the columns lane, lane +
        # BLOCK_N, ... ; the lanes are merged with Chan's formula. No E[x^2] - E[x]^2 cancellation.
        cnt_l = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        mean_l = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        m2_l = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c[None, :] < N)
            x = _load_ln_input(
                X,
                R,
                S,
                rows64 * stride_x + c[None, :],
                rows64 * stride_r + c[None, :],
                rows64 * stride_s + c[None, :],
                mask,
                HAS_RESIDUAL,
                True,
            )
            cnt_new = cnt_l + tl.where(mask, 1.0, 0.0)
            delta = x - mean_l
            mean_l += tl.where(mask, delta / tl.maximum(cnt_new, 1.0), 0.0)
            m2_l += tl.where(mask, delta * (x - mean_l), 0.0)
            cnt_l = cnt_new
        mean = tl.sum(cnt_l * mean_l, axis=1) / N  # (BLOCK_M,)
        d = mean_l - mean[:, None]
        var = (tl.sum(m2_l, axis=1) + tl.sum(cnt_l * d * d, axis=1)) / N  # (BLOCK_M,)

    rstd = _rstd_from_var(var, eps, FORMULA)  # (BLOCK_M,)
    if FORMULA != 3:
        tl.store(Mean + rows, mean, mask=row_mask)
    tl.store(Rstd + rows, rstd, mask=row_mask)

    # Normalise (and affine) and write Y.
    if SINGLE_BLOCK:
        y = xc * rstd[:, None]
        if FORMULA == 3:  # rounded to the output dtype before the gain, as the reference does
            y = y.to(Y.dtype.element_ty).to(tl.float32)
        col_mask = cols < N
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        for start in range(0, N, BLOCK_N):
            c = start + cols
            col_mask = c < N
            mask = row_mask[:, None] & col_mask[None, :]
            # Recompute x + r rather than re-reading S: a load of what this program stored may
            # be served by another thread without a barrier.
            x = _load_ln_input(
                X,
                R,
                S,
                rows64 * stride_x + c[None, :],
                rows64 * stride_r + c[None, :],
                rows64 * stride_s + c[None, :],
                mask,
                HAS_RESIDUAL,
                False,
            )
            if FORMULA == 3:
                y = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)
            else:
                y = (x - mean[:, None]) * rstd[:, None]
            if HAS_WEIGHT:
                y = y * tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_BIAS:
                y = y + tl.load(B + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + rows64 * stride_y + c[None, :], y.to(Y.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------
# The VJP. Per row, with c_i = x_i - mu, var = mean(c^2), sigma = sqrt(var), xhat = c / r(var),
# y = gamma * xhat + beta and g = dL/dxhat = dy * gamma (g = dy without a weight):
#
#   dxhat_i/dx_j = (delta_ij - 1/N) / r  -  c_i / r^2 * r'(var) * dvar/dx_j,
#   dvar/dx_j    = 2 c_j / N                       (the mean term vanishes: sum_i c_i = 0),
#
#   dx_j = sum_i g_i dxhat_i/dx_j
#        = (g_j - mean(g)) / r  -  2 r'(var) * xhat_j * mean(g * xhat)      [mean(g c) = r mean(g xhat)]
#        = rstd * (g_j - mean(g) - k * xhat_j * mean(g * xhat)),   rstd = 1/r,  k = 2 r r'(var):
#
#   "sqrt_var_eps"  r = sqrt(var + eps)  r' = 1 / (2 sqrt(var + eps))  k = 1
#   "std_plus_eps"  r = sigma + eps      r' = 1 / (2 sigma)            k = (sigma + eps) / sigma
#                                                                        = 1 / (1 - eps * rstd)
#   "exact"         r = sigma            r' = 1 / (2 sigma)            k = 1
#
# and dgamma = sum_rows dy * xhat, dbeta = sum_rows dy. For the fused residual add the grad of
# `summed` is added to dx, and x and residual both receive that dx.
#
# "rms": no mean (mu = 0 throughout, xhat = x * rstd, rstd = 1 / sqrt(mean(x^2) + eps)), so the
# mean(g) term is absent and k = 1:  dx = rstd * (g - xhat * mean(g * xhat));  no dbeta.
#
# "std_plus_eps" at sigma = 0 (N = 1 or a constant row): xhat = 0 and mean(g * xhat) = 0 while
# k = inf. The term is taken as 0, so dx = rstd * (g - mean(g)); for N = 1 that is exactly 0,
# the true derivative of the constant output (autograd through sqrt(0) gives NaN instead).
#
# Forward stores mean and rstd per row; the backward recomputes xhat from them and never needs
# sigma except through rstd (sigma = 1/rstd - eps).


@triton.jit
def _xhat_correction(mgx, rstd, eps, FORMULA: tl.constexpr):
    """k * mean(g * xhat) per row (see the VJP above), fp32."""
    if FORMULA == 1:
        inv_k = 1.0 - eps * rstd  # = sigma / (sigma + eps): k = 1 / inv_k
        # sigma = 0 means xhat = 0 and mgx = 0: the term is 0 (and no 0 * inf is ever formed).
        corr = tl.where(mgx == 0.0, 0.0, mgx / tl.where(inv_k == 0.0, 1.0, inv_k))
    else:
        corr = mgx
    return corr


@triton.jit
def _layer_norm_bwd_row_sums_kernel(
    X,  # *T: (M, N) layer-norm input (x, or x + residual for the fused op)
    W,  # *Tw: (N,) gamma (read only if HAS_WEIGHT)
    DY,  # *T: (M, N) grad of Y
    Mean,  # *fp32: (M,) row mean from the forward
    Rstd,  # *fp32: (M,) row 1 / r from the forward
    MG,  # *fp32: (M,) out: mean(g) per row
    MGX,  # *fp32: (M,) out: mean(g * xhat) per row
    stride_x,  # int: row stride of X, in elements
    stride_dy,  # int: row stride of DY
    M,  # int: number of rows
    N,  # int: row width
    HAS_WEIGHT: tl.constexpr,  # g = dy * gamma rather than dy
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # column chunk width
    RMS: tl.constexpr = False,  # the "rms" formula: no mean (Mean is not read)
):
    """Wide rows only: the two row means of the VJP, before the column-parallel dx pass."""
    tl.static_assert(BLOCK_M * BLOCK_N <= 16384)
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)[:, None]  # (BLOCK_M, 1)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    if RMS:
        mean = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    else:
        mean = tl.load(Mean + rows, mask=row_mask, other=0.0)[:, None]  # (BLOCK_M, 1)
    rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)[:, None]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # fp32 accumulation
    acc_gx = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        col_mask = c < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows64 * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + c[None, :], mask=mask, other=0.0).to(tl.float32)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy
        if HAS_WEIGHT:
            g = dy * tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_g += g
        acc_gx += g * xhat
    tl.store(MG + rows, tl.sum(acc_g, axis=1) / N, mask=row_mask)
    tl.store(MGX + rows, tl.sum(acc_gx, axis=1) / N, mask=row_mask)


@triton.jit
def _layer_norm_bwd_kernel(
    X,  # *T: (M, N) layer-norm input (x, or x + residual for the fused op)
    W,  # *Tw: (N,) gamma (read only if HAS_WEIGHT)
    DY,  # *T: (M, N) grad of Y
    DS,  # *T: (M, N) grad of the fused op's `summed` output (read only if HAS_DS)
    DX,  # *T: (M, N) out: grad of X
    Mean,  # *fp32: (M,) row mean from the forward (not read by "rms")
    Rstd,  # *fp32: (M,) row 1 / r from the forward
    MG,  # *fp32: (M,) mean(g) per row (read only if not SINGLE_BLOCK)
    MGX,  # *fp32: (M,) mean(g * xhat) per row (read only if not SINGLE_BLOCK)
    DW_partial,  # *fp32: (P, N) out: this program's sum over its rows of dy * xhat
    DB_partial,  # *fp32: (P, N) out: this program's sum over its rows of dy
    stride_x,  # int: row stride of X, in elements
    stride_dy,  # int: row stride of DY
    stride_ds,  # int: row stride of DS
    stride_dx,  # int: row stride of DX
    M,  # int: number of rows
    N,  # int: row width
    rows_per_program,  # int: rows handled by one program, a multiple of BLOCK_M
    eps,  # fp32: eps of the formula
    FORMULA: tl.constexpr,  # 0 sqrt_var_eps, 1 std_plus_eps, 2 exact, 3 rms
    HAS_WEIGHT: tl.constexpr,  # g = dy * gamma; write DW_partial
    HAS_BIAS: tl.constexpr,  # write DB_partial
    HAS_DS: tl.constexpr,  # add DS to DX
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # columns per tile: >= N when SINGLE_BLOCK, else the chunk width
    SINGLE_BLOCK: tl.constexpr,  # whole row in one tile: compute mean(g), mean(g xhat) here
):
    """Program (p, q) handles rows [p * rows_per_program, (p + 1) * rows_per_program) and column
    chunk q. Grid: (P, cdiv(N, BLOCK_N)); with SINGLE_BLOCK there is one chunk. Each program owns
    row p of the partial buffers for its columns, which makes dgamma/dbeta deterministic."""
    tl.static_assert(BLOCK_M * BLOCK_N <= 16384)
    tl.static_assert((FORMULA >= 0) & (FORMULA <= 3))
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]  # (1, BLOCK_N)
    acc_dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # fp32 accumulation of dy * xhat
    acc_db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # fp32 accumulation of dy
    row_begin = pid_m * rows_per_program
    for i in range(0, rows_per_program, BLOCK_M):
        rows = row_begin + i + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)[:, None]  # (BLOCK_M, 1)
        mask = row_mask[:, None] & col_mask[None, :]  # (BLOCK_M, BLOCK_N)
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)  # (BLOCK_M,)
        if FORMULA == 3:  # rms: no mean
            xhat = x * rstd[:, None]  # masked lanes loaded as 0
        else:
            mean = tl.load(Mean + rows, mask=row_mask, other=0.0)  # (BLOCK_M,)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy
        if HAS_WEIGHT:
            g = dy * w
        if SINGLE_BLOCK:
            mgx = tl.sum(g * xhat, axis=1) / N  # (BLOCK_M,)
        else:
            mgx = tl.load(MGX + rows, mask=row_mask, other=0.0)
        corr = _xhat_correction(mgx, rstd, eps, FORMULA)  # (BLOCK_M,)
        if FORMULA == 3:
            dx = rstd[:, None] * (g - xhat * corr[:, None])
        else:
            if SINGLE_BLOCK:
                mg = tl.sum(g, axis=1) / N  # (BLOCK_M,)
            else:
                mg = tl.load(MG + rows, mask=row_mask, other=0.0)
            dx = rstd[:, None] * (g - mg[:, None] - xhat * corr[:, None])
        if HAS_DS:
            dx += tl.load(DS + rows64 * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            acc_dw += dy * xhat
        if HAS_BIAS:
            acc_db += dy
    if HAS_WEIGHT:
        tl.store(DW_partial + pid_m * N + cols, tl.sum(acc_dw, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_partial + pid_m * N + cols, tl.sum(acc_db, axis=0), mask=col_mask)


# ---------------------------------------------------------------------------------------------
# Host side: checks, launch geometry, launchers
# ---------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_inputs(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    formula: str,
    residual: torch.Tensor | None = None,
    formulas: tuple[str, ...] = tuple(FORMULAS),
) -> None:
    """Raise one clear ValueError / TypeError for the first bad argument. `formulas`: those the
    caller takes (the layer norm's; the launchers' also "rms", without a bias)."""
    if formula not in formulas:
        raise ValueError(f"unknown layer-norm formula {formula!r}; valid: {', '.join(formulas)}")
    if formula == RMS and bias is not None:
        raise ValueError("rms_norm has a gain and no bias; got a bias")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    supported = ", ".join(_dtype_name(d) for d in _SUPPORTED_DTYPES)
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"x has unsupported dtype {_dtype_name(x.dtype)}; supported: {supported}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x needs a last dimension of width >= 1 to normalise, got shape {tuple(x.shape)}")
    n = x.shape[-1]
    if n > MAX_N:
        raise ValueError(f"row width N = {n} is too wide; layer_norm supports N <= {MAX_N}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(
                f"x and residual shapes differ: {tuple(x.shape)} vs {tuple(residual.shape)}; they must match"
            )
        if residual.dtype != x.dtype:
            raise TypeError(
                f"x and residual dtypes differ: {_dtype_name(x.dtype)} vs {_dtype_name(residual.dtype)}"
            )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(p).__name__}")
        if tuple(p.shape) != (n,):
            raise ValueError(f"{name} must have shape ({n},) like the last dim of x, got {tuple(p.shape)}")
        if p.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {_dtype_name(p.dtype)}; supported: {supported}")
    for name, t in (("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"x is on {x.device} but {name} is on {t.device}; tensors must share a device")
    if x.device.type != "cuda" and not runtime.interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for the CPU interpreter; "
            f"got tensors on {x.device}"
        )


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(..., N) -> (M, N) with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _programs_target(sm_count: int | None) -> int:
    """How many programs keep the device busy: a few per SM on a GPU, a handful on the interpreter."""
    return 4 * sm_count if sm_count is not None else 4


def _geometry(
    m: int, n: int, max_single: int, elems_per_warp: int, block_n: int | None
) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, SINGLE_BLOCK, num_warps) for an (m, n) problem.

    `block_n` overrides the column tile (a power of two; tests use it to reach the chunked path
    with small rows)."""
    if block_n is None:
        block_n = triton.next_power_of_2(n)
        if block_n > max_single:
            block_n = _CHUNK
    elif block_n < 1 or block_n & (block_n - 1) or block_n > _MAX_TILE:
        raise ValueError(f"block_n must be a power of two in [1, {_MAX_TILE}], got {block_n}")
    single = block_n >= n
    block_m = 1
    if single:  # narrow rows: several per program
        block_m = max(1, min(_TILE // block_n, triton.next_power_of_2(max(m, 1))))
    num_warps = min(32, max(1, block_m * block_n // elems_per_warp))
    return block_m, block_n, single, num_warps


def _bwd_partition(m: int, n: int, sm_count: int | None, block_n: int | None = None) -> tuple[int, int]:
    """(P, rows_per_program) of the backward on a GPU with `sm_count` SMs (None: the interpreter):
    P row-programs (times the column chunks) fill the device; P is also the row count of the
    dweight/dbias partial buffers."""
    block_m, bn, _, _ = _geometry(m, n, _BWD_MAX_SINGLE_BLOCK, _BWD_ELEMS_PER_WARP, block_n)
    row_tiles = triton.cdiv(m, block_m)
    programs = max(1, min(row_tiles, _programs_target(sm_count) // triton.cdiv(n, bn)))
    rows_per_program = triton.cdiv(row_tiles, programs) * block_m
    return triton.cdiv(m, rows_per_program), rows_per_program


def _bwd_row_programs(m: int, n: int, device: torch.device, block_n: int | None = None) -> tuple[int, int]:
    """`_bwd_partition` for the GPU `device` is on."""
    return _bwd_partition(m, n, _sm_count(device), block_n)


def _sm_count(device: torch.device) -> int | None:
    """SMs of a CUDA device (the partitions fill them); None elsewhere (the interpreter)."""
    limits = runtime.device_limits(device)
    return limits.sm_count if limits is not None else None


def _launch_name(formula: str, what: str, residual: bool) -> str:
    """The report name of a launch: "ln_fwd", "ln_bwd_residual", "rms_fwd", ..."""
    return f"{'rms' if formula == RMS else 'ln'}_{what}{'_residual' if residual else ''}"


def _tiling(block_m: int, block_n: int, num_warps: int) -> triton.Config:
    """A launch's geometry as its one config (num_stages: Triton's default)."""
    return runtime.config({"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps})


def forward_launch(
    x: torch.Tensor,  # (..., N) input, already checked
    weight: torch.Tensor | None,  # (N,)
    bias: torch.Tensor | None,  # (N,)
    eps: float,
    formula: str,
    residual: torch.Tensor | None,  # (..., N) like x
    block_n: int | None = None,
) -> tuple[runtime.KernelLaunch | None, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]]:
    """The forward's launch (None when there are no rows) and its outputs (y, summed, mean, rstd),
    allocated on x's device, not yet computed."""
    n = x.shape[-1]
    x2 = _rows(x, n)  # (M, N)
    m = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, n)  # (M, N)
    r2 = _rows(residual, n) if residual is not None else x2  # (M, N)
    summed = torch.empty_like(y) if residual is not None else None
    s2 = summed.view(-1, n) if summed is not None else y2  # (M, N)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    outputs = (y, summed, mean, rstd)
    if m == 0:
        return None, outputs
    block_m, bn, single, num_warps = _geometry(m, n, _FWD_MAX_SINGLE_BLOCK, _FWD_ELEMS_PER_WARP, block_n)
    w = weight.contiguous() if weight is not None else x2
    b = bias.contiguous() if bias is not None else x2
    launch = runtime.KernelLaunch(
        name=_launch_name(formula, "fwd", residual is not None),
        kernel=_layer_norm_fwd_kernel,
        grid=(triton.cdiv(m, block_m),),
        args=(
            x2,
            r2,
            s2,
            y2,
            w,
            b,
            mean,
            rstd,
            x2.stride(0),
            r2.stride(0),
            s2.stride(0),
            y2.stride(0),
            m,
            n,
            float(eps),
        ),  # fmt: skip
        kwargs={
            "FORMULA": _FORMULA_CODES[formula],
            "HAS_RESIDUAL": residual is not None,
            "HAS_WEIGHT": weight is not None,
            "HAS_BIAS": bias is not None,
            "SINGLE_BLOCK": single,
        },
        configs=[_tiling(block_m, bn, num_warps)],
    )
    return launch, outputs


def backward_launches(
    dy: torch.Tensor,  # (..., N) like x
    x: torch.Tensor,  # (..., N) what the forward normalised, already checked
    mean: torch.Tensor,  # (M,) fp32
    rstd: torch.Tensor,  # (M,) fp32
    weight: torch.Tensor | None,  # (N,)
    bias: torch.Tensor | None,  # (N,)
    eps: float,
    formula: str,
    dsummed: torch.Tensor | None,  # (..., N) grad of the fused op's `summed`
    sm_count: int | None,  # SMs of the GPU (None: the interpreter)
    block_n: int | None = None,
) -> tuple[list[runtime.KernelLaunch], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """The backward's launches, in order (rows wider than one tile first get their row sums),
    and (dx, dweight_partial (P, N), dbias_partial (P, N)) allocated on x's device; dweight and
    dbias are the fixed-order column sums of the partials."""
    n = x.shape[-1]
    x2 = _rows(x, n)  # (M, N)
    dy2 = _rows(dy, n)  # (M, N)
    ds2 = _rows(dsummed, n) if dsummed is not None else dy2  # (M, N)
    m = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx2 = dx.view(-1, n)  # (M, N)
    if m == 0:
        return [], (dx, None, None)

    block_m, bn, single, num_warps = _geometry(m, n, _BWD_MAX_SINGLE_BLOCK, _BWD_ELEMS_PER_WARP, block_n)
    programs, rows_per_program = _bwd_partition(m, n, sm_count, block_n)
    w = weight.contiguous() if weight is not None else x2
    launches = []
    mg = mgx = mean  # unused by the single-block kernel
    if not single:
        mg = torch.empty(m, dtype=torch.float32, device=x.device)
        mgx = torch.empty(m, dtype=torch.float32, device=x.device)
        launches.append(
            runtime.KernelLaunch(
                name=_launch_name(formula, "bwd_row_sums", False),
                kernel=_layer_norm_bwd_row_sums_kernel,
                grid=(m,),
                args=(x2, w, dy2, mean, rstd, mg, mgx, x2.stride(0), dy2.stride(0), m, n),
                kwargs={"HAS_WEIGHT": weight is not None, **({"RMS": True} if formula == RMS else {})},
                configs=[_tiling(1, bn, num_warps)],
            )
        )
    # Deterministic weight gradients: program p writes row p of these, then a fixed-order sum.
    dw_part = torch.empty((programs, n), dtype=torch.float32, device=x.device) if weight is not None else None
    db_part = torch.empty((programs, n), dtype=torch.float32, device=x.device) if bias is not None else None
    launches.append(
        runtime.KernelLaunch(
            name=_launch_name(formula, "bwd", dsummed is not None),
            kernel=_layer_norm_bwd_kernel,
            grid=(programs, triton.cdiv(n, bn)),
            args=(
                x2,
                w,
                dy2,
                ds2,
                dx2,
                mean,
                rstd,
                mg,
                mgx,
                dw_part if dw_part is not None else mean,
                db_part if db_part is not None else mean,
                x2.stride(0),
                dy2.stride(0),
                ds2.stride(0),
                dx2.stride(0),
                m,
                n,
                rows_per_program,
                float(eps),
            ),  # fmt: skip
            kwargs={
                "FORMULA": _FORMULA_CODES[formula],
                "HAS_WEIGHT": weight is not None,
                "HAS_BIAS": bias is not None,
                "HAS_DS": dsummed is not None,
                "SINGLE_BLOCK": single,
            },
            configs=[_tiling(block_m, bn, num_warps)],
        )
    )
    return launches, (dx, dw_part, db_part)


def layer_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    formula: str = "sqrt_var_eps",
    residual: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    Returns (y, summed, mean, rstd): y like x; summed = x + residual (None without a residual),
    which is what was normalised; mean and rstd fp32 of shape (M,), M = x.numel() // N, with
    rstd = 1 / r(var) of the chosen formula ("rms" too: mean is then left unwritten).
    """
    _check_inputs(x, weight, bias, eps, formula, residual, tuple(_FORMULA_CODES))
    launch, outputs = forward_launch(x, weight, bias, eps, formula, residual, block_n)
    if launch is not None:
        launch.run()
    return outputs


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    formula: str = "sqrt_var_eps",
    dsummed: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel(s).

    `x` is what the forward normalised (for the fused op: `summed`), `mean`/`rstd` its saved
    statistics. `dsummed`, the grad of the fused op's `summed`, is added to dx. Returns
    (dx, dweight, dbias): dx like x; dweight/dbias in the weight/bias dtype, or None when there
    is no weight/bias.
    """
    _check_inputs(x, weight, bias, eps, formula, dsummed, tuple(_FORMULA_CODES))
    if dy.shape != x.shape:
        raise ValueError(f"dy shape {tuple(dy.shape)} differs from x shape {tuple(x.shape)}")
    launches, (dx, dw_part, db_part) = backward_launches(
        dy, x, mean, rstd, weight, bias, eps, formula, dsummed, _sm_count(x.device), block_n
    )
    if not launches:  # no rows
        zeros = lambda p: torch.zeros_like(p) if p is not None else None
        return dx, zeros(weight), zeros(bias)
    for launch in launches:
        launch.run()
    dweight = dw_part.sum(0).to(weight.dtype) if weight is not None else None
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias


# ---------------------------------------------------------------------------------------------
# The custom ops and the public functions
# ---------------------------------------------------------------------------------------------
# The forward ops return the fp32 row statistics beside their outputs, for the backward;
# `register_autograd` saves them, and the backward launches `lmsys::layer_norm_bwd` (both ops'
# backward: the fused one passes the gradient of `summed`). A custom op cannot return None: an
# absent dweight / dbias comes back from the backward op as an empty tensor, and is None again
# before autograd sees it.

_EMPTY = (0,)  # the shape that stands for "no gradient" (no weight, no bias)


def _stats_like(x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.dim() else 1
    return x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("lmsys::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, formula: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y like x, mean (M,) fp32, rstd (M,) fp32): `layer_norm_forward` as an op."""
    y, _, mean, rstd = layer_norm_forward(x, weight, bias, eps, formula)
    return y, mean, rstd


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps, formula):
    return x.new_empty(x.shape), _stats_like(x), _stats_like(x)


@torch.library.custom_op("lmsys::add_layer_norm_fwd", mutates_args=())
def add_layer_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    formula: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed like x, summed = x + residual, mean (M,) fp32, rstd (M,) fp32): the fused
    `layer_norm_forward` as an op."""
    normed, summed, mean, rstd = layer_norm_forward(x, weight, bias, eps, formula, residual=residual)
    return normed, summed, mean, rstd


@add_layer_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, formula):
    return x.new_empty(x.shape), x.new_empty(x.shape), _stats_like(x), _stats_like(x)


@torch.library.custom_op("lmsys::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    formula: str,
    dsummed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias): `layer_norm_backward` as an op; dweight / dbias are empty tensors
    when there is no weight / bias."""
    dx, dweight, dbias = layer_norm_backward(dy, x, mean, rstd, weight, bias, eps, formula, dsummed)
    empty = x.new_empty(_EMPTY)
    return dx, dweight if dweight is not None else empty, dbias if dbias is not None else empty.clone()


@layer_norm_bwd.register_fake
def _(dy, x, mean, rstd, weight, bias, eps, formula, dsummed):
    dweight = weight.new_empty(weight.shape) if weight is not None else x.new_empty(_EMPTY)
    dbias = bias.new_empty(bias.shape) if bias is not None else x.new_empty(_EMPTY)
    return x.new_empty(x.shape), dweight, dbias


def _none_if_absent(grad: torch.Tensor, param: torch.Tensor | None) -> torch.Tensor | None:
    return None if param is None else grad


def _layer_norm_setup(ctx, inputs, output) -> None:
    x, weight, bias, eps, formula = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.eps, ctx.formula = eps, formula


def _layer_norm_backward(ctx, dy: torch.Tensor, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = layer_norm_bwd(
        dy.contiguous(), x, mean, rstd, weight, bias, ctx.eps, ctx.formula, None
    )
    return dx, _none_if_absent(dweight, weight), _none_if_absent(dbias, bias), None, None


layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


def _add_layer_norm_setup(ctx, inputs, output) -> None:
    _, _, weight, bias, eps, formula = inputs
    _, summed, mean, rstd = output
    ctx.save_for_backward(summed, weight, bias, mean, rstd)
    ctx.eps, ctx.formula = eps, formula
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zero tensor read


def _add_layer_norm_backward(ctx, dnormed, dsummed, _dmean, _drstd):
    summed, weight, bias, mean, rstd = ctx.saved_tensors
    if dnormed is None:  # only `summed` was used: the add's gradient, nothing through the norm
        return dsummed, dsummed, None, None, None, None
    dx, dweight, dbias = layer_norm_bwd(
        dnormed.contiguous(),
        summed,
        mean,
        rstd,
        weight,
        bias,
        ctx.eps,
        ctx.formula,
        dsummed.contiguous() if dsummed is not None else None,
    )
    # x and residual get the same gradient (autograd copies before accumulating into it)
    return dx, dx, _none_if_absent(dweight, weight), _none_if_absent(dbias, bias), None, None


add_layer_norm_fwd.register_autograd(_add_layer_norm_backward, setup_context=_add_layer_norm_setup)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    formula: str = "sqrt_var_eps",
) -> torch.Tensor:
    """Normalise the last dim of x with `formula` (see the module doc), then the optional affine.

    x: (..., N), fp32/fp16/bf16, N <= 65536; weight, bias: (N,) or None. The result has x's
    shape and dtype; statistics are fp32. "exact" ignores eps and gives NaN for constant rows.
    Runs the custom op `lmsys::layer_norm_fwd` (differentiable in x, weight and bias).
    """
    _check_inputs(x, weight, bias, eps, formula)
    return layer_norm_fwd(x, weight, bias, float(eps), formula)[0]


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    formula: str = "sqrt_var_eps",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + layer norm: returns (normed, summed), summed = x + residual in x's
    dtype and normed = layer_norm(summed, ...), in one pass over the data.

    Pre-LN blocks carry `summed` as the residual stream, post-LN blocks carry `normed`; both are
    differentiable and the grad of `summed` reaches x and residual. Runs the custom op
    `lmsys::add_layer_norm_fwd`.
    """
    if residual is None:
        raise TypeError("residual must be a torch.Tensor, got NoneType")
    _check_inputs(x, weight, bias, eps, formula, residual)
    normed, summed, _, _ = add_layer_norm_fwd(x, residual, weight, bias, float(eps), formula)
    return normed, summed


# ---------------------------------------------------------------------------------------------
# RMS norm: the same kernels with the "rms" formula, its own ops (no mean, no bias)
# ---------------------------------------------------------------------------------------------
# The forward ops return the fp32 rstd beside their outputs; the backward op passes it as both
# statistics (the kernels read no mean under "rms").


@torch.library.custom_op("lmsys::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y like x, rstd (M,) fp32): the "rms" `layer_norm_forward` as an op."""
    y, _, _, rstd = layer_norm_forward(x, weight, None, eps, RMS)
    return y, rstd


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), _stats_like(x)


@torch.library.custom_op("lmsys::add_rms_norm_fwd", mutates_args=())
def add_rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed like x, summed = x + residual, rstd (M,) fp32): the fused "rms" forward as an op."""
    normed, summed, _, rstd = layer_norm_forward(x, weight, None, eps, RMS, residual=residual)
    return normed, summed, rstd


@add_rms_norm_fwd.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape), _stats_like(x)


@torch.library.custom_op("lmsys::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    dsummed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight): the "rms" `layer_norm_backward` as an op; dweight is an empty tensor when
    there is no weight."""
    dx, dweight, _ = layer_norm_backward(dy, x, rstd, rstd, weight, None, eps, RMS, dsummed)
    return dx, dweight if dweight is not None else x.new_empty(_EMPTY)


@rms_norm_bwd.register_fake
def _(dy, x, rstd, weight, eps, dsummed):
    dweight = weight.new_empty(weight.shape) if weight is not None else x.new_empty(_EMPTY)
    return x.new_empty(x.shape), dweight


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps = eps


def _rms_norm_backward(ctx, dy: torch.Tensor, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_bwd(dy.contiguous(), x, rstd, weight, ctx.eps, None)
    return dx, _none_if_absent(dweight, weight), None


rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def _add_rms_norm_setup(ctx, inputs, output) -> None:
    _, _, weight, eps = inputs
    _, summed, rstd = output
    ctx.save_for_backward(summed, weight, rstd)
    ctx.eps = eps
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zero tensor read


def _add_rms_norm_backward(ctx, dnormed, dsummed, _drstd):
    summed, weight, rstd = ctx.saved_tensors
    if dnormed is None:  # only `summed` was used: the add's gradient, nothing through the norm
        return dsummed, dsummed, None, None
    dx, dweight = rms_norm_bwd(
        dnormed.contiguous(),
        summed,
        rstd,
        weight,
        ctx.eps,
        dsummed.contiguous() if dsummed is not None else None,
    )
    return dx, dx, _none_if_absent(dweight, weight), None  # x and residual get the same gradient


add_rms_norm_fwd.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim (SPEC section 11), statistics in fp32,
    the normalised value rounded to x's dtype before the gain (transformers' LlamaRMSNorm).

    x: (..., N), fp32/fp16/bf16, N <= 65536; weight: (N,) or None. The result has x's shape and
    dtype. Runs the custom op `lmsys::rms_norm_fwd` (differentiable in x and weight).
    """
    _check_inputs(x, weight, None, eps, RMS, formulas=(RMS,))
    return rms_norm_fwd(x, weight, float(eps))[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMS norm: (rms_norm(x + residual, weight, eps), x + residual), summed
    in x's dtype, in one pass over the data. Runs the custom op `lmsys::add_rms_norm_fwd`."""
    if residual is None:
        raise TypeError("residual must be a torch.Tensor, got NoneType")
    _check_inputs(x, weight, None, eps, RMS, residual, formulas=(RMS,))
    normed, summed, _ = add_rms_norm_fwd(x, residual, weight, float(eps))
    return normed, summed
