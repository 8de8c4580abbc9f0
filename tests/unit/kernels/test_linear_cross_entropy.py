"""The linear cross-entropy (the fused Triton kernels and the chunked torch path) against the float64
autograd of the reference: the loss and every gradient (h, weight, bias) under an upstream gradient.

What runs where: without a GPU the Triton kernels run on CPU tensors through the interpreter
(tests/conftest.py), in fp32 and fp16 at V = 97, 1,000 and 4,099 (small tiles so that the rows
and the vocabulary span many blocks, chunk tails included); the chunked torch path and the
reference also run at GPT-2's V = 50,257 and D = 768. bf16 runs the kernels on a GPU only (the
interpreter's bf16 tl.dot is wrong); the torch path takes bf16 on the CPU too.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels.linear_cross_entropy import (
    chunk_buffers,
    chunk_launches,
    default_chunk,
    linear_cross_entropy,
    linear_cross_entropy_forward,
)
from kernels.reference import chunked_linear_cross_entropy, lce_default_chunk, linear_cross_entropy_reference
from lmsys.model.transformer import weighted_next_token_loss
from tests.conftest import DEVICE

LCE = importlib.import_module("kernels.linear_cross_entropy")
IMPLS = {"triton": linear_cross_entropy, "torch": chunked_linear_cross_entropy}
GPU_ONLY_BF16 = pytest.mark.skipif(
    DEVICE != "cuda", reason="bf16 tl.dot is unsupported by the Triton CPU interpreter; runs on GPU"
)
# (dtype, tolerance): atol = tolerance x the largest entry of the expected tensor, rtol = 10 x that.
# fp16/bf16 inputs accumulate in fp32; their gradients are rounded once to the input dtype, and the
# kernels round G to it for the tensor-core products.
FP32 = pytest.param(torch.float32, 2e-6, id="fp32")
FP16 = pytest.param(torch.float16, 2e-3, id="fp16")
BF16 = pytest.param(torch.bfloat16, 1.6e-2, id="bf16")
BF16_TRITON = pytest.param(torch.bfloat16, 1.6e-2, id="bf16", marks=GPU_ONLY_BF16)


# Tiles of 16 rows and 32 words, far below the interpreter's defaults, so that these small shapes
# span many row, vocabulary and hidden blocks (tails included).
SMALL_TILES: dict[str, dict[str, int]] = {
    "lce_fwd": {"BLOCK_M": 16, "BLOCK_V": 32, "BLOCK_K": 16},
    "lce_lse": {"BLOCK_V": 64},
    "lce_bwd_dh": {"BLOCK_M": 16, "BLOCK_D": 16, "BLOCK_V": 32},
    "lce_bwd_dw": {"BLOCK_V": 32, "BLOCK_D": 16, "BLOCK_M": 16},
}


@pytest.fixture(autouse=True)
def small_interpreter_tiles(monkeypatch):
    monkeypatch.setattr(LCE, "INTERPRETER_TILES", {name: dict(t) for name, t in SMALL_TILES.items()})


def _inputs(n, d, v, dtype, *, bias=True, weights="mixed", scale=1.0, seed=0):
    """h (n, d), weight (v, d), targets, loss weights, bias on DEVICE; logits of order `scale` x 3.
    weights: "mixed" (uniform in [0, 1], a quarter exactly 0 with out-of-vocabulary targets),
    "none" or a tensor."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen) * scale
    weight = torch.randn(v, d, generator=gen) * (3.0 / d**0.5)
    b = torch.randn(v, generator=gen) if bias else None
    targets = torch.randint(0, v, (n,), generator=gen)
    if isinstance(weights, torch.Tensor):
        w = weights
    elif weights == "mixed":
        w = torch.rand(n, generator=gen)
        zero = torch.rand(n, generator=gen) < 0.25
        w[zero] = 0.0
        targets[zero] = torch.where(torch.arange(n)[zero] % 2 == 0, -100, v + 3)  # never read
    else:
        w = None
    to = lambda t: None if t is None else t.to(DEVICE)
    return to(h).to(dtype), to(weight).to(dtype), to(targets), to(w), to(b.to(dtype) if bias else None)


def _loss_and_grads(fn, h, weight, targets, w, b, upstream=1.7, **kwargs):
    leaves = [t.detach().clone().requires_grad_(True) for t in (h, weight) + ((b,) if b is not None else ())]
    loss = fn(leaves[0], leaves[1], targets, w, leaves[2] if b is not None else None, **kwargs)
    (loss * upstream).backward()
    return loss, [t.grad for t in leaves]


def _compare(impl, dtype, tol, n, d, v, chunk=None, **input_kwargs):
    h, weight, targets, w, b = _inputs(n, d, v, dtype, **input_kwargs)
    loss, grads = _loss_and_grads(IMPLS[impl], h, weight, targets, w, b, chunk=chunk)
    as64 = lambda t: None if t is None else t.double()
    want, want_grads = _loss_and_grads(
        linear_cross_entropy_reference, as64(h), as64(weight), targets, as64(w), as64(b)
    )
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(loss.double(), want, atol=10 * tol, rtol=10 * tol)
    for name, got, expected in zip(("dh", "dweight", "dbias"), grads, want_grads):
        assert got.dtype == dtype and got.shape == expected.shape, name
        scale = expected.abs().max().item()
        torch.testing.assert_close(
            got.double(), expected, atol=tol * scale, rtol=10 * tol, msg=lambda m, n=name: f"{impl} {n}: {m}"
        )


def test_reference_is_the_models_loss():
    """The reference equals lmsys's full path (logits, then weighted_next_token_loss) in float64."""
    h, weight, targets, w, b = _inputs(23, 16, 41, torch.float64)
    logits = (h @ weight.T + b).view(1, 23, 41)
    want = weighted_next_token_loss(logits, targets.clamp(0, 40).view(1, 23), w.view(1, 23))
    torch.testing.assert_close(linear_cross_entropy_reference(h, weight, targets, w, b), want)


# ----------------------------------------------------------------------------- the Triton kernels


@pytest.mark.parametrize("dtype,tol", [FP32, FP16, BF16_TRITON])
@pytest.mark.parametrize(
    "n,d,v,chunk",
    [(37, 48, 97, None), (37, 48, 97, 16), (50, 48, 1000, 16), (19, 768, 97, 8)],
    ids=["v97", "v97-chunks", "v1000-chunks", "d768"],
)
def test_triton_matches_float64_reference(dtype, tol, n, d, v, chunk):
    _compare("triton", dtype, tol, n, d, v, chunk)


def test_triton_without_bias_or_weights():
    _compare("triton", torch.float32, 2e-6, 45, 48, 97, chunk=32, bias=False, weights="none")


def test_triton_many_vocabulary_blocks_and_chunk_tails(monkeypatch):
    """V = 4,099 in 33 blocks of 128 (the last of 3 columns) whose partials are combined 8 per step;
    70 tokens in chunks of 32 (a tail of 6); tiles of 16 rows over 2 and 3 hidden blocks."""
    tiles = {name: dict(t) for name, t in SMALL_TILES.items()}
    tiles["lce_fwd"].update(BLOCK_V=128, BLOCK_K=16)
    tiles["lce_lse"].update(BLOCK_V=512)
    tiles["lce_bwd_dh"].update(BLOCK_V=256)
    tiles["lce_bwd_dw"].update(BLOCK_V=128)
    monkeypatch.setattr(LCE, "INTERPRETER_TILES", tiles)
    monkeypatch.setattr(LCE, "_MAX_BLOCK_P", 8)
    _compare("triton", torch.float32, 2e-6, 70, 40, 4099, chunk=32)


# ----------------------------------------------------------------------------- the torch path


@pytest.mark.parametrize("dtype,tol", [pytest.param(torch.float64, 1e-12, id="fp64"), FP32, FP16, BF16])
@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_torch_path_matches_float64_reference(dtype, tol, chunk):
    _compare("torch", dtype, tol, 37, 48, 97, chunk)


def test_torch_path_at_gpt2_vocabulary():
    """GPT-2's V = 50,257 and D = 768, 300 tokens in chunks of 128 (a tail of 44)."""
    _compare("torch", torch.float32, 2e-6, 300, 768, 50257, chunk=128)


# ----------------------------------------------------------------------------- weights and logits


@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_chunk_of_zero_weights_and_out_of_vocabulary_targets(impl):
    n, v = 40, 97
    w = torch.rand(n, generator=torch.Generator().manual_seed(5))
    w[:16] = 0.0  # the whole first chunk
    _compare(impl, torch.float32, 2e-6, n, 48, v, chunk=16, weights=w)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_all_zero_weights_give_zero_loss_and_gradients(impl):
    h, weight, targets, _, b = _inputs(20, 48, 97, torch.float32)
    targets[::3] = -1  # any id where the weight is 0
    loss, grads = _loss_and_grads(IMPLS[impl], h, weight, targets, torch.zeros(20, device=DEVICE), b, chunk=8)
    assert loss.item() == 0.0
    for g in grads:
        assert torch.count_nonzero(g) == 0


@pytest.mark.parametrize("impl", list(IMPLS))
def test_very_large_logits_do_not_overflow(impl):
    """Logits of order 1e4 (exp would overflow fp32 at 89): the online log-sum-exp keeps every
    exponent <= 0, so the loss and gradients stay finite and match float64."""
    h, weight, targets, w, b = _inputs(37, 48, 97, torch.float32, scale=3000.0)
    assert (h @ weight.T).abs().max() > 1e4
    _compare(impl, torch.float32, 2e-6, 37, 48, 97, chunk=16, scale=3000.0)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_out_of_vocabulary_target_with_a_weight_is_refused(impl):
    h, weight, targets, w, b = _inputs(10, 48, 97, torch.float32, weights="none")
    targets[4] = 97
    with pytest.raises(ValueError, match="target id 97 is outside the vocabulary"):
        IMPLS[impl](h, weight, targets, w, b)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_leading_dimensions_and_frozen_weight(impl):
    """(B, S, D) hidden states as the model passes them, with only h requiring a gradient."""
    h, weight, targets, w, b = _inputs(24, 48, 97, torch.float32)
    h3 = h.view(2, 12, 48).detach().requires_grad_(True)
    loss = IMPLS[impl](h3, weight, targets.view(2, 12), w.view(2, 12), b, chunk=5)
    loss.backward()
    h64 = h.double().detach().requires_grad_(True)
    want = linear_cross_entropy_reference(h64, weight.double(), targets, w.double(), b.double())
    want.backward()
    torch.testing.assert_close(loss.double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(h3.grad.double().view(24, 48), h64.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_bad_arguments_are_one_clear_error(impl):
    h, weight, targets, w, b = _inputs(6, 8, 11, torch.float32)
    fn = IMPLS[impl]
    with pytest.raises(ValueError, match=r"weight must be \(V, D\)"):
        fn(h, weight[:, :4], targets, w, b)
    with pytest.raises(TypeError, match="targets must hold integer ids"):
        fn(h, weight, targets.float(), w, b)
    with pytest.raises(ValueError, match="weights must have h's leading shape"):
        fn(h, weight, targets, w[:3], b)
    with pytest.raises(ValueError, match="chunk must be"):
        fn(h, weight, targets, w, b, chunk=0)
    with pytest.raises(TypeError, match="h is torch.float32 but weight is torch.float16"):
        fn(h, weight.half(), targets, w, b)


# ----------------------------------------------------------------------------- chunks and memory


def test_chunk_sizes():
    assert lce_default_chunk(8192, 50257) == 667  # 2^25 logits: 128 MiB of fp32
    assert default_chunk(8192, 50257) == 512  # the power of two below
    assert default_chunk(37, 97) == 64 and default_chunk(8192, 1 << 20) == 128  # >= one row tile


def test_no_logits_beyond_one_chunk_and_none_without_gradients():
    """The scratch of a chunk is (C, V); without gradients the kernels store no logits at all and
    only the logits and log-sum-exp kernels run."""
    h, weight, targets, w, b = _inputs(37, 48, 97, torch.float32)
    buffers = chunk_buffers(16, 48, 97, torch.float32, DEVICE, True, grads=True, gpu=None)
    assert tuple(buffers.logits.shape) == (16, 97) and buffers.logits.stride(0) == 112  # rows 16-aligned
    eval_buffers = chunk_buffers(16, 48, 97, torch.float32, DEVICE, False, grads=False, gpu=None)
    assert eval_buffers.logits is None and eval_buffers.dh_part is None
    per_token = torch.zeros(16, device=DEVICE)
    rows = (h[:16], weight, b, targets[:16], w[:16], per_token)
    launches = chunk_launches(*rows, eval_buffers, None, None, False)
    assert [lc.name for lc in launches] == ["lce_fwd", "lce_lse"]
    assert launches[0].kwargs["STORE_LOGITS"] is False and launches[1].kwargs["WRITE_GRAD"] is False
    loss, _, sums = linear_cross_entropy_forward(h, weight, targets, w, b, chunk=16)
    assert sums == (None, None, None)
    with torch.no_grad():
        assert torch.equal(linear_cross_entropy(h, weight, targets, w, b, chunk=16), loss)
    want = linear_cross_entropy_reference(h.double(), weight.double(), targets, w.double(), b.double())
    torch.testing.assert_close(loss.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_bitwise_stable(impl):
    """Two runs give the same bits (on a GPU: no atomics, partial sums in a fixed order)."""
    h, weight, targets, w, b = _inputs(37, 48, 97, torch.float32)
    first = _loss_and_grads(IMPLS[impl], h, weight, targets, w, b, chunk=16)
    second = _loss_and_grads(IMPLS[impl], h, weight, targets, w, b, chunk=16)
    assert torch.equal(first[0], second[0])
    for a, c in zip(first[1], second[1]):
        assert torch.equal(a, c)


@pytest.mark.skipif(DEVICE != "cpu", reason="bf16 runs on CUDA; the refusal is for the CPU interpreter")
def test_bf16_on_cpu_is_refused_not_garbage():
    h, weight, targets, w, b = _inputs(6, 16, 11, torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 is not supported on CPU"):
        linear_cross_entropy(h, weight, targets, w, b)
