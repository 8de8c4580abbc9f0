"""Rotary position embedding (SPEC section 11) as one Triton kernel for queries and keys together.

    rotary(q, k, cos, sin) -> (q_rot, k_rot)                      # differentiable in q and k
    q: (B, H, T, d)   k: (B, Hkv, T, d)   cos, sin: (T, d) or (B, T, d)

Each pair of dimensions (i, i + d/2) of a head (transformers' half-split layout) is turned by the
angle of its token's position, as `kernels.reference.rotary_reference` defines it:

    y1 = x1 * cos1 - x2 * sin1        x1 = x[..., :d/2],  cos1 = cos[..., :d/2], ...
    y2 = x2 * cos2 + x1 * sin2        x2 = x[..., d/2:],  cos2 = cos[..., d/2:], ...

The map is linear in x, so its VJP is its transpose, the same kernel with the signs moved
(TRANSPOSE): dx1 = dy1 * cos1 + dy2 * sin2, dx2 = dy2 * cos2 - dy1 * sin1 (the inverse rotation
when cos1 = cos2 and sin1 = sin2, as every table of lmsys has them). The tables are inputs, not
parameters: they get no gradient.

One program per token (b, t): it loads the token's cos and sin once and turns every query head and
every key head of the token, a block of heads at a time; arithmetic in fp32, results rounded once
to the input dtype. Why a kernel of its own rather than a rotation fused into the attention's Q/K
loads: the forward attention kernel streams every key tile once per query block, so a fused
rotation would turn each key cdiv(T, BLOCK_M) times (and the dK/dV and dQ kernels again), and
every load path of the attention kernels (pointers, TMA descriptors) would need the half swap;
the KV cache stores rotated keys, so generation needs the rotation outside attention anyway. This
kernel reads and writes Q and K once each: a memory-bound pass of (H + Hkv) * d values per token.

Layering, as in the other kernel files: `_rotary_kernel` -> `rotary_launch` / `rotary_forward` ->
the custom ops `lmsys::rotary_fwd` / `lmsys::rotary_bwd` (fakes, `register_autograd`) -> `rotary`.
Tiling (kernels/runtime.py): one geometry per launch, derived from the head count and width, the
same under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.reference import rotary_reference  # noqa: F401  (the tests import the reference from here)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 512
_TILE = 4096  # values (both halves) of the heads one loop step turns
_ELEMS_PER_WARP = 512  # 16 values per thread, as the layer norm's tiles


@triton.jit
def _rotate_heads(
    X,  # *T: (B, heads, T, d) input, this tensor's base pointer
    Y,  # *T: (B, heads, T, d) output
    b,  # int64 batch index of the token
    t,  # int64 position index of the token
    stride_xb,  # X stride over B
    stride_xh,  # X stride over heads
    stride_xt,  # X stride over T
    stride_xd,  # X stride over d
    stride_yb,  # Y stride over B
    stride_yh,  # Y stride over heads
    stride_yt,  # Y stride over T
    stride_yd,  # Y stride over d
    n_heads,  # int: heads of X
    cos1,  # (1, BLOCK_HALF) fp32 cos of the first half's dimensions
    cos2,  # (1, BLOCK_HALF) fp32 cos of the second half's
    sin1,  # (1, BLOCK_HALF) fp32
    sin2,  # (1, BLOCK_HALF) fp32
    HALF: tl.constexpr,  # d / 2
    BLOCK_HALF: tl.constexpr,  # HALF padded to a power of two
    BLOCK_H: tl.constexpr,  # heads per loop step
    TRANSPOSE: tl.constexpr,  # the VJP: the transposed rotation
):
    cols = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF)
    x_base = X + b * stride_xb + t * stride_xt
    y_base = Y + b * stride_yb + t * stride_yt
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
        mask = (heads < n_heads) & (cols < HALF)  # (BLOCK_H, BLOCK_HALF)
        x_ptrs = x_base + heads * stride_xh + cols * stride_xd
        x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_HALF)
        x2 = tl.load(x_ptrs + HALF * stride_xd, mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSE:
            y1 = x1 * cos1 + x2 * sin2
            y2 = x2 * cos2 - x1 * sin1
        else:
            y1 = x1 * cos1 - x2 * sin1
            y2 = x2 * cos2 + x1 * sin2
        y_ptrs = y_base + heads * stride_yh + cols * stride_yd
        tl.store(y_ptrs, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(y_ptrs + HALF * stride_yd, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q,  # *T: (B, H, T, d) queries (or their output gradient with TRANSPOSE)
    K,  # *T: (B, Hkv, T, d) keys
    QO,  # *T: (B, H, T, d) out: rotated queries
    KO,  # *T: (B, Hkv, T, d) out: rotated keys
    COS,  # *Tc: (B, T, d) cos table; stride_cb = 0 for a (T, d) table shared by the rows
    SIN,  # *Tc: (B, T, d) sin table, the strides of COS
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,  # Q strides
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,  # K strides
    stride_qob,
    stride_qoh,
    stride_qot,
    stride_qod,  # QO strides
    stride_kob,
    stride_koh,
    stride_kot,
    stride_kod,  # KO strides
    stride_cb,  # COS / SIN stride over B (0: one table for every row)
    stride_ct,  # COS / SIN stride over T
    stride_cd,  # COS / SIN stride over d
    T,  # int: sequence length
    H,  # int: query heads
    H_KV,  # int: key heads
    HALF: tl.constexpr,  # d / 2
    BLOCK_HALF: tl.constexpr,  # HALF padded to a power of two
    BLOCK_H: tl.constexpr,  # heads per loop step
    TRANSPOSE: tl.constexpr,  # the VJP: the transposed rotation
):
    """Program p turns token (p // T, p % T) of every query and key head. Grid: (B * T,)."""
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF)
    col_mask = cols < HALF
    c_ptrs = b * stride_cb + t * stride_ct + cols * stride_cd
    cos1 = tl.load(COS + c_ptrs, mask=col_mask, other=0.0).to(tl.float32)  # (1, BLOCK_HALF)
    cos2 = tl.load(COS + c_ptrs + HALF * stride_cd, mask=col_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + c_ptrs, mask=col_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(SIN + c_ptrs + HALF * stride_cd, mask=col_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        Q, QO, b, t, stride_qb, stride_qh, stride_qt, stride_qd,
        stride_qob, stride_qoh, stride_qot, stride_qod,
        H, cos1, cos2, sin1, sin2, HALF, BLOCK_HALF, BLOCK_H, TRANSPOSE,
    )  # fmt: skip
    _rotate_heads(
        K, KO, b, t, stride_kb, stride_kh, stride_kt, stride_kd,
        stride_kob, stride_koh, stride_kot, stride_kod,
        H_KV, cos1, cos2, sin1, sin2, HALF, BLOCK_HALF, BLOCK_H, TRANSPOSE,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _check_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise one clear TypeError / ValueError for the first bad argument."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rotary: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"rotary: unsupported dtype {t.dtype} for {name}; supported: float32, float16, bfloat16"
            )
        if t.device != q.device:
            raise ValueError(
                f"rotary: q is on {q.device} but {name} is on {t.device}; tensors must share a device"
            )
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"rotary: {name} must be 4-D (B, heads, T, d), got shape {tuple(t.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"rotary: q and k dtypes differ: {q.dtype} vs {k.dtype}")
    b, _, t, d = q.shape
    if min(q.shape[:3]) < 1 or k.shape[1] < 1:
        raise ValueError(
            f"rotary: B, heads and T must be >= 1, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, t, d):
        raise ValueError(f"rotary: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on B, T and d")
    if d % 2 or not 2 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"rotary: the head width d = {d} must be even and between 2 and {MAX_HEAD_DIM}")
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) not in ((t, d), (b, t, d)):
            raise ValueError(
                f"rotary: {name} must be (T, d) = {(t, d)} or (B, T, d) = {(b, t, d)}, "
                f"got {tuple(table.shape)}"
            )
    if cos.shape != sin.shape:
        raise ValueError(f"rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    if q.device.type != "cuda" and not runtime.interpreting():
        raise ValueError(
            "rotary: Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for the CPU interpreter; "
            f"got {q.device}"
        )


def _table_strides(table: torch.Tensor) -> tuple[int, int, int]:
    """(over B, over T, over d) of a (T, d) or (B, T, d) table; 0 over B for one shared table."""
    return (0, *table.stride()) if table.dim() == 2 else tuple(table.stride())


def _geometry(heads: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_HALF, BLOCK_H, num_warps): every head of a token in one step while it fits _TILE."""
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(heads), _TILE // (2 * block_half)))
    return block_half, block_h, max(1, min(8, 2 * block_h * block_half // _ELEMS_PER_WARP))


def rotary_launch(
    q: torch.Tensor,  # (B, H, T, d)
    k: torch.Tensor,  # (B, Hkv, T, d)
    q_out: torch.Tensor,  # (B, H, T, d)
    k_out: torch.Tensor,  # (B, Hkv, T, d)
    cos: torch.Tensor,  # (T, d) or (B, T, d)
    sin: torch.Tensor,  # like cos
    transpose: bool,
) -> runtime.KernelLaunch:
    """The kernel's one launch: the rotation (or with `transpose` its VJP) of q and k into the
    outputs."""
    b, h, t, d = q.shape
    if _table_strides(cos) != _table_strides(sin):  # the kernel indexes both with one set of strides
        cos, sin = cos.contiguous(), sin.contiguous()
    block_half, block_h, num_warps = _geometry(max(h, k.shape[1]), d // 2)
    return runtime.KernelLaunch(
        name="rope_bwd" if transpose else "rope_fwd",
        kernel=_rotary_kernel,
        grid=(b * t,),
        args=(
            q,
            k,
            q_out,
            k_out,
            cos,
            sin,
            *q.stride(),
            *k.stride(),
            *q_out.stride(),
            *k_out.stride(),
            *_table_strides(cos),
            t,
            h,
            k.shape[1],
        ),  # fmt: skip
        kwargs={"HALF": d // 2, "BLOCK_HALF": block_half, "TRANSPOSE": bool(transpose)},
        configs=[runtime.config({"BLOCK_H": block_h, "num_warps": num_warps})],
    )


def rotary_forward(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel: (q_rot, k_rot), each laid out like its input (`torch.empty_like`);
    with `transpose`, the VJP of the rotation applied to the gradients q and k."""
    _check_inputs(q, k, cos, sin)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.numel() and k.numel():
        rotary_launch(q, k, q_out, k_out, cos, sin, transpose).run()
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# The custom ops and the public function
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("lmsys::rotary_fwd", mutates_args=())
def rotary_fwd(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot, k_rot): `rotary_forward` as an op."""
    return rotary_forward(q, k, cos, sin)


@rotary_fwd.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("lmsys::rotary_bwd", mutates_args=())
def rotary_bwd(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq_in, dk_in): the transposed rotation of the output gradients, as an op."""
    return rotary_forward(dq, dk, cos, sin, transpose=True)


@rotary_bwd.register_fake
def _(dq, dk, cos, sin):
    return torch.empty_like(dq), torch.empty_like(dk)


def _rotary_setup(ctx, inputs, output) -> None:
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _rotary_backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
    cos, sin = ctx.saved_tensors
    dq_in, dk_in = rotary_bwd(dq, dk, cos, sin)
    return dq_in, dk_in, None, None


rotary_fwd.register_autograd(_rotary_backward, setup_context=_rotary_setup)


def rotary(
    q: torch.Tensor,  # (B, H, T, d)
    k: torch.Tensor,  # (B, Hkv, T, d)
    cos: torch.Tensor,  # (T, d) or (B, T, d)
    sin: torch.Tensor,  # like cos
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k turned by their positions' angles (the half-split layout, `rotary_reference`):
    (q * cos + rotate_half(q) * sin, the same for k), in the input dtype, each laid out like its
    input. Differentiable in q and k (cos and sin get no gradient). Runs `lmsys::rotary_fwd`."""
    _check_inputs(q, k, cos, sin)
    return rotary_fwd(q, k, cos, sin)
