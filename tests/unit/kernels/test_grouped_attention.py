"""Grouped-query attention in the flash-attention kernels: query head h reads key/value head
h // (H / H_kv) without the key/value heads repeated in memory, and dK/dV sum over each group's
query heads in a fixed order. Against the float64 reference with the heads repeated (`repeat_kv`),
through the Triton interpreter on CPU: group sizes 1, 2 and all heads (multi-query), odd lengths.
"""

from __future__ import annotations

import pytest
import torch

from kernels.flash_attention import (
    attention_reference,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
)
from kernels.reference import repeat_kv
from tests.conftest import DEVICE
from tests.fixtures.reference import assert_matches_reference

# (B, H, H_kv, T, d_qk, d_vo, causal, dtype, atol); group size 1 is every other attention test.
CASES = [
    (2, 4, 2, 17, 16, 16, True, torch.float32, 1e-5),  # groups of 2
    (1, 4, 1, 37, 32, 24, False, torch.float32, 1e-5),  # multi-query, d_qk != d_vo
    (1, 3, 1, 1, 16, 16, True, torch.float32, 1e-5),  # one token, three heads on one
    (1, 4, 2, 70, 64, 64, True, torch.float16, 5e-3),  # crosses blocks, fp16
]


def _inputs(b, h, h_kv, t, d_qk, d_vo, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    q = make(b, t, h, d_qk).transpose(1, 2).requires_grad_()  # the model's layout
    k, v = make(b, h_kv, t, d_qk).requires_grad_(), make(b, h_kv, t, d_vo).requires_grad_()
    return q, k, v, make(b, h, t, d_vo)


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"H{c[1]}kv{c[2]}T{c[3]}-{'causal' if c[6] else 'full'}-{c[7]}"
)
def test_matches_the_reference_with_repeated_heads(case):
    b, h, h_kv, t, d_qk, d_vo, causal, dtype, atol = case
    q, k, v, do = _inputs(b, h, h_kv, t, d_qk, d_vo, dtype)
    out = flash_attention(q, k, v, causal=causal)
    groups = h // h_kv
    reference = lambda q64, k64, v64: attention_reference(
        q64, repeat_kv(k64, groups), repeat_kv(v64, groups), causal=causal
    )
    assert_matches_reference(out, (q, k, v), do, reference, atol, atol)
    assert out.shape == (b, h, t, d_vo) and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_grouped_backward_is_deterministic():
    q, k, v, do = (x.detach() for x in _inputs(1, 4, 2, 40, 16, 16, torch.float16, seed=3))
    o, lse = flash_attention_forward(q, k, v, causal=True)
    first = flash_attention_backward(do, q, k, v, o, lse, causal=True)
    second = flash_attention_backward(do, q, k, v, o, lse, causal=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_heads_that_do_not_divide_are_refused():
    q, k = torch.randn(1, 4, 8, 16, device=DEVICE), torch.randn(1, 3, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="k and v may have fewer heads dividing q's"):
        flash_attention(q, k, k)
