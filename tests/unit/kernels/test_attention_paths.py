"""The attention kernels' code paths that test_flash_attention's grid does not reach: softmax
scales of any sign (the forward folds |scale| into exp2 and negates q for a negative one), and the
TMA path that sm_90 takes, run here through the Triton interpreter, which executes tensor
descriptors (bounds and zero fill included) on CPU tensors. The launch records are also checked:
which loads a target gets, and that the pruner hook shapes the descriptors for each tiling.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels.flash_attention import attention_reference, flash_attention
from tests.conftest import DEVICE
from tests.fixtures.reference import assert_matches_reference, attention_inputs

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="forces the TMA path through the CPU interpreter")


def _module():
    return importlib.import_module("kernels.flash_attention")


def _check(q, k, v, do, causal, scale, atol, rtol):
    out = flash_attention(q, k, v, causal=causal, scale=scale)
    reference = lambda q64, k64, v64: attention_reference(q64, k64, v64, causal=causal, scale=scale)
    assert_matches_reference(out, (q, k, v), do, reference, atol, rtol)


SCALES = [-1.0, -0.125, 0.0, 1.0, 3.0]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("scale", SCALES)
def test_any_sign_of_scale(scale, causal):
    """Negative scales flip which logit is the row max; 0 gives a uniform softmax; 1 is seed 000's."""
    q, k, v, do = attention_inputs(1, 2, 45, 24, 40, torch.float32, seed=11)
    _check(q, k, v, do, causal, scale, 1e-5, 1e-5)


def test_negative_scale_is_not_the_positive_one():
    """Guards the test above against a kernel that ignores the sign: the two outputs differ."""
    q, k, v, _ = attention_inputs(1, 1, 17, 16, 16, torch.float32, seed=12)
    with torch.no_grad():
        assert not torch.allclose(flash_attention(q, k, v, scale=0.5), flash_attention(q, k, v, scale=-0.5))


@pytest.fixture
def sm90(monkeypatch):
    """Launch as on an sm_90 device: the launchers pass tensor descriptors (TMA on a GPU)."""
    fa = _module()
    monkeypatch.setattr(fa, "_launch_capability", lambda device: 90)
    used = []
    original = fa._descriptors

    def spy(*args):
        descs = original(*args)
        used.append(all(d is not None for d in descs))
        return descs

    monkeypatch.setattr(fa, "_descriptors", spy)
    return used


# (B, H, T, d_qk, d_vo, causal, scale): T not a multiple of the blocks (descriptor zero fill at the
# end of T), padded head widths (zero fill past D), batch > 1 (the descriptor's B coordinate).
TMA_CASES = [
    (1, 2, 70, 40, 24, True, None),
    (2, 1, 33, 16, 16, False, -0.7),
    (1, 2, 64, 64, 64, True, 1.0),
    (2, 2, 17, 96, 40, False, None),
]


@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: "B{}H{}T{}-dqk{}-dvo{}-causal{}-scale{}".format(*c))
def test_tma_path_matches_reference(sm90, case):
    B, H, T, d_qk, d_vo, causal, scale = case
    q, k, v, do = attention_inputs(B, H, T, d_qk, d_vo, torch.float16, seed=13)
    _check(q, k, v, do, causal, scale, 5e-3, 5e-3)
    assert sm90 and all(sm90), "every launch should have taken the descriptor path"


def test_tma_unfit_inputs_take_the_pointer_path(sm90):
    """A last-dim stride of 2 cannot be described by TMA: launches that stream K take pointers."""
    q, k, v, do = attention_inputs(1, 1, 20, 32, 16, torch.float16, seed=14)
    k_strided = torch.randn(1, 1, 20, 64).to(torch.float16)[..., ::2].requires_grad_()  # (1, 1, 20, 32)
    _check(q, k_strided, v, do, True, None, 5e-3, 5e-3)
    # forward (streams K, V), dK/dV (streams Q, dO), dQ (streams K, V)
    assert sm90 == [False, True, False]


def _meta(*shape, dtype=torch.float16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("capability,tma", [(None, False), (80, False), (90, True)])
def test_launch_records_choose_the_load_path_by_target(capability, tma):
    fa = _module()
    q, k, v, o, do = (_meta(2, 4, 256, 64) for _ in range(5))
    lse, delta = _meta(2, 4, 256, dtype=torch.float32), _meta(2, 4, 256, dtype=torch.float32)
    forward = fa.forward_launch(q, k, v, o, lse, True, -0.125, capability)
    assert forward.kwargs["KV_TMA"] is tma and forward.kwargs["NEGATE_Q"] is True
    assert forward.named_args()["qk_scale"] == pytest.approx(0.125 * fa.LOG2E)  # |scale|, q negated
    _, dkdv, dq = fa.backward_launches(do, q, k, v, o, lse, delta, q, k, v, True, -0.125, capability)
    assert dkdv.kwargs["QDO_TMA"] is tma and dq.kwargs["KV_TMA"] is tma
    assert dq.named_args()["qk_scale"] == pytest.approx(-0.125 * fa.LOG2E)  # the backward keeps the sign


def test_tiling_shapes_the_descriptors():
    """The pre-hook the autotune configs carry gives each descriptor the block of the tiling."""
    import triton

    fa = _module()
    q, k, v, o, do = (_meta(1, 2, 128, 40) for _ in range(5))
    lse = _meta(1, 2, 128, dtype=torch.float32)
    forward = fa.forward_launch(q, k, v, o, lse, False, 0.1, 90)
    forward.kwargs_for(triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=2))
    named = forward.named_args()
    assert named["K_DESC"].block_shape == [1, 1, 128, 64]  # d = 40 padded to 64, zero-filled past 40
    assert named["V_DESC"].block_shape == [1, 1, 128, 64]
    _, dkdv, _ = fa.backward_launches(do, q, k, v, o, lse, lse, q, k, v, False, 0.1, 90)
    dkdv.kwargs_for(triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=2))
    assert dkdv.named_args()["Q_DESC"].block_shape == [1, 1, 32, 64]


def test_tma_path_with_grouped_heads_and_documents(sm90):
    """The descriptors of grouped key/value heads (their own head coordinate) and the document
    bounds' tile ranges, whose first key or query block need not be the first of the row."""
    from kernels.reference import document_attention_reference, repeat_kv

    g = torch.Generator().manual_seed(15)
    make = lambda *shape: torch.randn(*shape, generator=g).to(torch.float16)
    q, k, v = (make(2, heads, 70, d).requires_grad_() for heads, d in ((4, 32), (2, 32), (2, 16)))
    do = make(2, 4, 70, 16)
    documents = torch.tensor([[0] * 40 + [1] + [2] * 29, [3] * 3 + [4] * 67])
    out = flash_attention(q, k, v, causal=True, documents=documents)
    reference = lambda q64, k64, v64: document_attention_reference(
        q64, repeat_kv(k64, 2), repeat_kv(v64, 2), documents, True
    )
    assert_matches_reference(out, (q, k, v), do, reference, 5e-3, 5e-3)
    assert sm90 and all(sm90), "every launch should have taken the descriptor path"
