"""The rotary kernel (queries and keys together) against the float64 autograd of
`rotary_reference`, through the Triton interpreter on CPU: odd lengths, grouped key heads (group
sizes 1, 2 and all heads), tables shared by the rows or per row, strided inputs, fp32 and fp16.
"""

from __future__ import annotations

import pytest
import torch

from kernels.rotary import rotary, rotary_bwd, rotary_fwd, rotary_reference
from tests.conftest import DEVICE

# (B, H, Hkv, T, d, per_row tables, dtype, atol)
CASES = [
    (2, 4, 4, 17, 16, False, torch.float32, 1e-6),  # group size 1
    (2, 4, 2, 1, 64, True, torch.float32, 1e-6),  # group size 2, one token, a table per row
    (1, 3, 1, 17, 6, False, torch.float32, 1e-6),  # multi-query, a width below a power of two
    (2, 4, 2, 5, 128, True, torch.float16, 2e-3),
]


def _tables(b: int, t: int, d: int, per_row: bool, dtype: torch.dtype):
    """cos, sin as lmsys builds them: positions times theta^(-2i/d), each angle for both halves."""
    positions = torch.arange(t)[None] + 3 * torch.arange(b)[:, None] if per_row else torch.arange(t)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = positions[..., None].float() * inv_freq
    both = torch.cat((angles, angles), dim=-1)  # (T, d) or (B, T, d)
    return both.cos().to(DEVICE, dtype), both.sin().to(DEVICE, dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}kv{c[2]}T{c[3]}d{c[4]}-{c[6]}")
def test_matches_float64_reference(case):
    b, h, h_kv, t, d, per_row, dtype, atol = case
    gen = torch.Generator().manual_seed(t + d)
    # q as the model makes it: a (B, T, H, d) projection viewed as (B, H, T, d)
    q = torch.randn(b, t, h, d, generator=gen).to(DEVICE, dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(b, h_kv, t, d, generator=gen).to(DEVICE, dtype).requires_grad_()
    cos, sin = _tables(b, t, d, per_row, dtype)
    q_rot, k_rot = rotary(q, k, cos, sin)
    dq, dk = (torch.randn(x.shape, generator=gen).to(DEVICE, dtype) for x in (q_rot, k_rot))
    torch.autograd.backward([q_rot, k_rot], [dq, dk])
    assert q_rot.dtype == dtype and q_rot.shape == q.shape and k_rot.shape == k.shape

    q64, k64 = (x.detach().double().requires_grad_() for x in (q, k))
    want_q, want_k = (rotary_reference(x, cos.double(), sin.double()) for x in (q64, k64))
    torch.autograd.backward([want_q, want_k], [dq.double(), dk.double()])
    for name, got, want in (
        ("q", q_rot, want_q),
        ("k", k_rot, want_k),
        ("dq", q.grad, q64.grad),
        ("dk", k.grad, k64.grad),
    ):
        torch.testing.assert_close(
            got.double(), want, atol=atol, rtol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_the_backward_undoes_the_rotation():
    """With cos^2 + sin^2 = 1 the transposed rotation is the inverse one."""
    gen = torch.Generator().manual_seed(5)
    q, k = (
        torch.randn(1, 2, 9, 32, generator=gen).to(DEVICE),
        torch.randn(1, 1, 9, 32, generator=gen).to(DEVICE),
    )
    cos, sin = _tables(1, 9, 32, False, torch.float32)
    back_q, back_k = rotary_bwd(*rotary_fwd(q, k, cos, sin), cos, sin)
    torch.testing.assert_close(back_q, q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(back_k, k, atol=1e-6, rtol=1e-6)


def test_bad_inputs_raise_one_clear_error():
    q, k = torch.randn(1, 2, 4, 8, device=DEVICE), torch.randn(1, 1, 4, 8, device=DEVICE)
    cos, sin = _tables(1, 4, 8, False, torch.float32)
    with pytest.raises(ValueError, match="must be even"):
        rotary(q[..., :7], k[..., :7], cos[:, :7], sin[:, :7])
    with pytest.raises(ValueError, match=r"cos must be \(T, d\)"):
        rotary(q, k, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="must agree on B, T and d"):
        rotary(q, k[:, :, :3], cos, sin)
    with pytest.raises(TypeError, match="dtypes differ"):
        rotary(q, k.half(), cos, sin)
