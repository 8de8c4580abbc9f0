"""RMS norm and the fused residual add + RMS norm (the layer-norm kernels' "rms" formula) against
the float64 autograd of `rms_norm_reference`, through the Triton interpreter on CPU: odd widths,
one-element rows, the chunked path of wide rows, deterministic weight gradients.
"""

from __future__ import annotations

import pytest
import torch

from kernels.layer_norm import (
    add_rms_norm,
    layer_norm_backward,
    layer_norm_forward,
    rms_norm,
    rms_norm_reference,
)
from tests.conftest import DEVICE

# (dtype, atol, rtol) against float64; fp16 is limited by rounding xhat before the gain and the
# result, as the reference does.
FP32 = (torch.float32, 1e-5, 1e-5)
FP16 = (torch.float16, 5e-3, 5e-3)
EPS = 1e-6


def _randn(shape, dtype, gen, scale=1.0, shift=0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale + shift).to(dtype).to(DEVICE)


def _leaf(t: torch.Tensor | None, dtype=None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_(True)


def _close(actual, expected, atol, rtol, what) -> None:
    bound = atol * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual.double(), expected, atol=bound, rtol=rtol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("n", [1, 7, 1500])
@pytest.mark.parametrize("gain", [True, False], ids=["gain", "no-gain"])
@pytest.mark.parametrize("dtype, atol, rtol", [FP32, FP16], ids=["fp32", "fp16"])
def test_rms_norm_matches_float64_reference(n, gain, dtype, atol, rtol):
    gen = torch.Generator().manual_seed(n)
    x = _randn((2, 3, n), dtype, gen, 2.0, 0.5)
    weight = _randn((n,), dtype, gen, 0.5, 1.0) if gain else None
    dy = _randn((2, 3, n), dtype, gen)
    xs, ws = _leaf(x), _leaf(weight)
    y = rms_norm(xs, ws, EPS)
    y.backward(dy)
    assert y.dtype == dtype and y.shape == x.shape

    x64, w64 = _leaf(x, torch.float64), _leaf(weight, torch.float64)
    y64 = rms_norm_reference(x64, w64, EPS)
    y64.backward(dy.double())
    _close(y, y64, atol, rtol, "y")
    _close(xs.grad, x64.grad, atol, rtol, "dx")
    if gain:
        assert ws.grad.dtype == dtype
        _close(ws.grad, w64.grad, 4 * atol, rtol, "dweight")


def test_rms_norm_rounds_before_the_gain_as_the_reference():
    """fp16: xhat is rounded to the input dtype before the gain multiplies it (LlamaRMSNorm)."""
    gen = torch.Generator().manual_seed(2)
    x, weight = _randn((4, 96), torch.float16, gen, 3.0), _randn((96,), torch.float16, gen, 1.0, 2.0)
    want = rms_norm_reference(x, weight, EPS)
    assert (rms_norm(x, weight, EPS).double() - want.double()).abs().max() <= 2 * 2**-10 * want.abs().max()


@pytest.mark.parametrize("n", [7, 1500])
@pytest.mark.parametrize("dtype, atol, rtol", [FP32, FP16], ids=["fp32", "fp16"])
def test_add_rms_norm_matches_float64_reference(n, dtype, atol, rtol):
    gen = torch.Generator().manual_seed(10 + n)
    x, residual = _randn((3, n), dtype, gen, 2.0), _randn((3, n), dtype, gen)
    weight = _randn((n,), dtype, gen, 0.5, 1.0)
    dnormed, dsummed = _randn((3, n), dtype, gen), _randn((3, n), dtype, gen)
    leaves = [_leaf(t) for t in (x, residual, weight)]
    normed, summed = add_rms_norm(*leaves, EPS)
    torch.autograd.backward([normed, summed], [dnormed, dsummed])
    assert torch.equal(summed, x + residual)

    leaves64 = [_leaf(t, torch.float64) for t in (x, residual, weight)]
    summed64 = leaves64[0] + leaves64[1]
    normed64 = rms_norm_reference(summed64, leaves64[2], EPS)
    torch.autograd.backward([normed64, summed64], [dnormed.double(), dsummed.double()])
    _close(normed, normed64, atol, rtol, "normed")
    for name, got, want, scale in zip(("dx", "dresidual", "dweight"), leaves, leaves64, (1, 1, 4)):
        _close(got.grad, want.grad, scale * atol, rtol, name)


def test_add_rms_norm_with_only_the_sum_used():
    gen = torch.Generator().manual_seed(7)
    leaves = [_leaf(_randn(shape, torch.float32, gen)) for shape in ((3, 33), (3, 33), (33,))]
    _, summed = add_rms_norm(*leaves)
    summed.sum().backward()
    assert torch.equal(leaves[0].grad, torch.ones(3, 33, device=DEVICE)) and leaves[2].grad is None


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
def test_chunked_wide_row_path(fused):
    """Rows wider than one tile (a small block_n reaches the path): a sum of squares forward, the
    row sums then the column-parallel dx backward."""
    n = 1500
    gen = torch.Generator().manual_seed(int(fused))
    x, residual = _randn((3, n), torch.float32, gen, 3.0, -1.0), _randn((3, n), torch.float32, gen)
    weight = _randn((n,), torch.float32, gen, 0.5, 1.0)
    dy, ds = _randn((3, n), torch.float32, gen), _randn((3, n), torch.float32, gen)
    y, summed, _, rstd = layer_norm_forward(
        x, weight, None, EPS, "rms", residual=residual if fused else None, block_n=512
    )
    normed_input = summed if fused else x
    dx, dw, db = layer_norm_backward(
        dy, normed_input, rstd, rstd, weight, None, EPS, "rms", dsummed=ds if fused else None, block_n=512
    )
    assert db is None
    x64, r64, w64 = (_leaf(t, torch.float64) for t in (x, residual, weight))
    s64 = x64 + r64 if fused else x64
    y64 = rms_norm_reference(s64, w64, EPS)
    torch.autograd.backward(
        [y64, s64] if fused else [y64], [dy.double(), ds.double()] if fused else [dy.double()]
    )
    _close(y, y64, 1e-5, 1e-5, "y")
    _close(dx, x64.grad, 1e-5, 1e-5, "dx")
    _close(dw, w64.grad, 4e-5, 1e-5, "dweight")


def test_weight_gradient_is_deterministic():
    gen = torch.Generator().manual_seed(3)
    x, weight = _randn((37, 1023), torch.float32, gen), _randn((1023,), torch.float32, gen)
    dy = _randn((37, 1023), torch.float32, gen)
    runs = []
    for _ in range(2):
        xs, ws = _leaf(x), _leaf(weight)
        rms_norm(xs, ws).backward(dy)
        runs.append((xs.grad, ws.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_bad_inputs_raise_one_clear_error():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        rms_norm(x, torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match="rms_norm has a gain and no bias"):
        layer_norm_forward(x, None, torch.ones(8, device=DEVICE), EPS, "rms")
    with pytest.raises(TypeError, match="unsupported dtype float64"):
        rms_norm(x.double())
    with pytest.raises(ValueError, match="x and residual shapes differ"):
        add_rms_norm(x, x[:2])
