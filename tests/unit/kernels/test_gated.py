"""The fused gated activation (SwiGLU, GeGLU) against the float64 autograd of `gated_reference`,
through the Triton interpreter on CPU: every activation, odd shapes, a row wider than one tile."""

from __future__ import annotations

import pytest
import torch

from kernels.gated import ACTIVATIONS, gated, gated_reference
from tests.conftest import DEVICE
from tests.fixtures.reference import assert_matches_reference


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize(
    "shape, dtype, atol",
    [((1,), torch.float32, 1e-5), ((3, 5, 7), torch.float32, 1e-5), ((2, 3000), torch.float16, 5e-3)],
    ids=["one", "odd-fp32", "wide-fp16"],
)
def test_matches_float64_reference(activation, shape, dtype, atol):
    gen = torch.Generator().manual_seed(len(shape))
    gate = (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype).requires_grad_()  # both tails of phi
    up = torch.randn(shape, generator=gen).to(DEVICE, dtype).requires_grad_()
    dh = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    h = gated(gate, up, activation)
    reference = lambda gate64, up64: gated_reference(gate64, up64, activation)
    assert_matches_reference(h, (gate, up), dh, reference, atol, atol, names=("h", "dgate", "dup"))
    assert h.dtype == dtype and h.shape == gate.shape


def test_strided_inputs():
    """Gate and up as the two halves of one projection (row stride 2N)."""
    gen = torch.Generator().manual_seed(9)
    both = torch.randn(4, 2 * 40, generator=gen).to(DEVICE).requires_grad_()
    gate, up = both.chunk(2, dim=-1)
    gated(gate, up).sum().backward()
    both64 = both.detach().double().requires_grad_()
    gated_reference(*both64.chunk(2, dim=-1)).sum().backward()
    torch.testing.assert_close(both.grad.double(), both64.grad, atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise_one_clear_error():
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="unknown activation 'relu'; valid: silu, gelu, gelu_tanh"):
        gated(x, x, "relu")
    with pytest.raises(ValueError, match="must have one shape"):
        gated(x, x[:2])
    with pytest.raises(TypeError, match="dtypes differ"):
        gated(x, x.half())
