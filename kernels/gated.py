"""The gated feed-forward's hidden layer (SPEC section 11) as one Triton kernel each way.

    gated(gate, up, activation="silu") -> phi(gate) * up          # differentiable in gate and up
    gate, up: (..., N)   SwiGLU with "silu", GeGLU with "gelu" (erf) or "gelu_tanh"

Forward, per element, in fp32 and rounded once to the input dtype:  h = phi(g) * u.
Backward (the VJP), recomputing phi from the saved inputs rather than storing it:

    du = dh * phi(g)                    dg = dh * u * phi'(g)

    silu        phi = g s,  s = sigmoid(g)                phi' = s (1 + g (1 - s))
    gelu        phi = g P,  P = (1 + erf(g / sqrt 2)) / 2   phi' = P + g exp(-g^2 / 2) / sqrt(2 pi)
    gelu_tanh   phi = g (1 + t) / 2,  t = tanh(c (g + a g^3)),  c = sqrt(2 / pi), a = 0.044715
                phi' = (1 + t) / 2 + g (1 - t^2) c (1 + 3 a g^2) / 2

Unfused, torch reads gate and up and writes phi(gate), then reads it back with up and writes the
product (and the backward keeps phi(gate) alive for the graph); here each direction reads its
inputs once and writes its outputs once, and nothing but gate and up is kept for the backward.

Layering, as in the other kernel files: `_gated_fwd_kernel` / `_gated_bwd_kernel` -> the launchers
`gated_forward` / `gated_backward` -> the custom ops `lmsys::gated_fwd` / `lmsys::gated_bwd`
(fakes, `register_autograd`) -> `gated`. The torch definition is `ACTIVATIONS[name](gate) * up`
(`gated_reference`, kernels/reference.py). Tiling (kernels/runtime.py): one geometry per launch,
derived from the row width (16 values per thread), the same under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import runtime
from kernels.reference import GATED_ACTIVATIONS, gated_reference  # noqa: F401  (the tests import it here)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS: dict[str, int] = {name: i for i, name in enumerate(GATED_ACTIVATIONS)}  # -> ACTIVATION
_TILE = 4096  # elements per program
_MAX_BLOCK_N = 2048  # widest column tile; wider rows take several programs per row
_ELEMS_PER_WARP = 512  # 16 values per thread
_SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 pi)
_TANH_C = 0.7978845608028654  # sqrt(2 / pi)
_TANH_A = 0.044715


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp: (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], never overflowing,
    and the sign of x."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr, GRADIENT: tl.constexpr):
    """(phi(g), phi'(g)) in fp32; phi'(g) only with GRADIENT (else phi(g) twice). ACTIVATION:
    0 silu, 1 gelu (erf), 2 gelu_tanh."""
    if ACTIVATION == 0:
        s = tl.sigmoid(g)
        phi = g * s
        dphi = phi
        if GRADIENT:
            dphi = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * _SQRT_HALF))
        phi = g * cdf
        dphi = phi
        if GRADIENT:
            dphi = cdf + g * tl.exp(-0.5 * g * g) * _INV_SQRT_2PI
    else:
        t = _tanh(_TANH_C * (g + _TANH_A * g * g * g))
        phi = 0.5 * g * (1.0 + t)
        dphi = phi
        if GRADIENT:
            dphi = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _TANH_C * (1.0 + 3.0 * _TANH_A * g * g)
    return phi, dphi


@triton.jit
def _gated_fwd_kernel(
    GATE,  # *T: (M, N) gate pre-activations, unit column stride
    UP,  # *T: (M, N) up projections
    OUT,  # *T: (M, N) out: phi(gate) * up
    stride_g,  # int: row stride of GATE
    stride_u,  # int: row stride of UP
    stride_o,  # int: row stride of OUT
    M,  # int: rows
    N,  # int: row width
    ACTIVATION: tl.constexpr,  # 0 silu, 1 gelu, 2 gelu_tanh
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program
):
    """Program (p, q) computes the tile of rows p * BLOCK_M and columns q * BLOCK_N.
    Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]  # (BLOCK_M, 1)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
    mask = (rows < M) & (cols < N)
    g = tl.load(GATE + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    phi, _ = _activation(g, ACTIVATION, False)
    tl.store(OUT + rows * stride_o + cols, (phi * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(
    DH,  # *T: (M, N) gradient of the output
    GATE,  # *T: (M, N) gate pre-activations from the forward
    UP,  # *T: (M, N) up projections from the forward
    DGATE,  # *T: (M, N) out: dh * up * phi'(gate)
    DUP,  # *T: (M, N) out: dh * phi(gate)
    stride_dh,  # int: row stride of DH
    stride_g,  # int: row stride of GATE
    stride_u,  # int: row stride of UP
    stride_dg,  # int: row stride of DGATE
    stride_du,  # int: row stride of DUP
    M,  # int: rows
    N,  # int: row width
    ACTIVATION: tl.constexpr,  # 0 silu, 1 gelu, 2 gelu_tanh
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program
):
    """The VJP of the forward's tile (module docstring). Grid: as the forward's."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]  # (BLOCK_M, 1)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
    mask = (rows < M) & (cols < N)
    dh = tl.load(DH + rows * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    phi, dphi = _activation(g, ACTIVATION, True)
    tl.store(DGATE + rows * stride_dg + cols, (dh * u * dphi).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + rows * stride_du + cols, (dh * phi).to(DUP.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _check_inputs(gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    """Raise one clear TypeError / ValueError for the first bad argument."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated: unknown activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gated: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"gated: unsupported dtype {t.dtype} for {name}; supported: float32, float16, bfloat16"
            )
    if gate.shape != up.shape:
        raise ValueError(f"gated: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if gate.dtype != up.dtype:
        raise TypeError(f"gated: gate and up dtypes differ: {gate.dtype} vs {up.dtype}")
    if gate.device != up.device:
        raise ValueError(
            f"gated: gate is on {gate.device} but up is on {up.device}; tensors must share a device"
        )
    if gate.dim() == 0:
        raise ValueError("gated: gate and up need at least one dimension")
    if gate.device.type != "cuda" and not runtime.interpreting():
        raise ValueError(
            "gated: Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for the CPU interpreter; "
            f"got {gate.device}"
        )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (M, N) with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(name: str, kernel, m: int, n: int, args: tuple, activation: str) -> runtime.KernelLaunch:
    block_n = min(triton.next_power_of_2(max(n, 1)), _MAX_BLOCK_N)
    block_m = max(1, min(_TILE // block_n, triton.next_power_of_2(max(m, 1))))
    num_warps = max(1, min(8, block_m * block_n // _ELEMS_PER_WARP))
    return runtime.KernelLaunch(
        name=name,
        kernel=kernel,
        grid=(triton.cdiv(m, block_m), triton.cdiv(n, block_n)),
        args=(*args, m, n),
        kwargs={"ACTIVATION": ACTIVATIONS[activation]},
        configs=[runtime.config({"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps})],
    )


def forward_launch(
    gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, activation: str
) -> runtime.KernelLaunch:
    """The forward's launch: out = phi(gate) * up, each (..., N) (out contiguous)."""
    g2, u2, o2 = _rows(gate), _rows(up), out.view(-1, out.shape[-1])  # (M, N) each
    args = (g2, u2, o2, g2.stride(0), u2.stride(0), o2.stride(0))
    return _launch("glu_fwd", _gated_fwd_kernel, g2.shape[0], g2.shape[1], args, activation)


def backward_launch(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    dgate: torch.Tensor,
    dup: torch.Tensor,
    activation: str,
) -> runtime.KernelLaunch:
    """The backward's launch: dgate and dup (contiguous, like gate) from dh, gate and up."""
    dh2, g2, u2 = _rows(dh), _rows(gate), _rows(up)  # (M, N) each
    dg2, du2 = dgate.view(-1, gate.shape[-1]), dup.view(-1, gate.shape[-1])
    args = (dh2, g2, u2, dg2, du2, dh2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0))
    return _launch("glu_bwd", _gated_bwd_kernel, g2.shape[0], g2.shape[1], args, activation)


def gated_forward(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Launch the forward kernel: phi(gate) * up, contiguous, in the input dtype."""
    _check_inputs(gate, up, activation)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        forward_launch(gate, up, out, activation).run()
    return out


def gated_backward(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel: (dgate, dup), contiguous, in the input dtype."""
    _check_inputs(gate, up, activation)
    if dh.shape != gate.shape:
        raise ValueError(f"gated: dh {tuple(dh.shape)} must have the shape of gate {tuple(gate.shape)}")
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty_like(dgate)
    if dgate.numel():
        backward_launch(dh.to(gate.dtype), gate, up, dgate, dup, activation).run()
    return dgate, dup


# ---------------------------------------------------------------------------------------------
# The custom ops and the public function
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("lmsys::gated_fwd", mutates_args=())
def gated_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """phi(gate) * up: `gated_forward` as an op."""
    return gated_forward(gate, up, activation)


@gated_fwd.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("lmsys::gated_bwd", mutates_args=())
def gated_bwd(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup): `gated_backward` as an op."""
    return gated_backward(dh, gate, up, activation)


@gated_bwd.register_fake
def _(dh, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _gated_setup(ctx, inputs, output) -> None:
    gate, up, activation = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = activation


def _gated_backward(ctx, dh: torch.Tensor):
    gate, up = ctx.saved_tensors
    dgate, dup = gated_bwd(dh.contiguous(), gate, up, ctx.activation)
    return dgate, dup, None


gated_fwd.register_autograd(_gated_backward, setup_context=_gated_setup)


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """phi(gate) * up (SwiGLU with "silu", GeGLU with "gelu" or "gelu_tanh"), element-wise over
    (..., N) tensors of one shape and dtype (fp32, fp16, bf16), computed in fp32 and returned
    contiguous in the input dtype. Runs the custom op `lmsys::gated_fwd` (differentiable)."""
    _check_inputs(gate, up, activation)
    return gated_fwd(gate, up, activation)
