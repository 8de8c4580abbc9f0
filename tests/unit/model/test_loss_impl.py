"""model.loss_impl: the fused kernel, the chunked torch path, torch's own F.linear_cross_entropy
(model.loss_impl=torch, the baseline of `python -m tools.bench ce`) and the full logits path compute the
same loss and gradients for every preset (bos_shift, tied and untied embeddings, the unembedding
bias), `model(ids)` still gives logits, and `auto` picks what it says.

On CPU the fused kernel runs through the Triton interpreter (tests/conftest.py), so the models
are small; the chunked path is also checked at gpt2_124m's width and vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from lmsys.core.config import LOSS_IMPLS, compose, compose_model, config_to_dict
from lmsys.core.errors import ConfigError
from lmsys.engine.checkpoint import model_differences
from lmsys.model import ops
from lmsys.model.transformer import Transformer
from tests.conftest import DEVICE

SMALL = ["vocab_size=37", "d_model=32", "n_heads=2", "n_layers=2", "max_seq_len=24", "ffn.d_ff=48"]
# Every preset: seed_trax has bos_shift, an untied unembedding with a bias; seed_postln and
# seed_compact are untied without a bias; seed_gpt, gpt2 and tiny are tied.
PRESETS = ["seed_gpt", "seed_trax", "seed_postln", "seed_compact", "gpt2_124m", "tiny"]


def _models(preset: str, extra: list[str], impls: tuple[str, ...]) -> dict[str, Transformer]:
    models = {}
    for impl in impls:
        torch.manual_seed(0)
        models[impl] = Transformer(compose_model(preset, [*extra, f"loss_impl={impl}"])).to(DEVICE)
    # Perturb every parameter (biases included, identically) so that no gradient is trivially 0.
    gen = torch.Generator().manual_seed(1)
    first = next(iter(models.values()))
    with torch.no_grad():
        for p in first.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen).to(DEVICE))
    for model in models.values():
        model.load_state_dict(first.state_dict())
    return models


def _loss_and_grads(model: Transformer, tokens: torch.Tensor, weights: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model.loss(tokens, weights)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _assert_same(got, want, what: str, rtol: float = 1e-5) -> None:
    (loss, grads), (want_loss, want_grads) = got, want
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=rtol, msg=lambda m: f"{what} loss: {m}")
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        expected = want_grads[name]
        atol = 1e-5 * max(expected.abs().max().item(), 1e-3)
        torch.testing.assert_close(
            grad, expected, atol=atol, rtol=1e-3, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


@pytest.mark.parametrize("preset", PRESETS)
def test_every_loss_impl_equals_the_full_path(preset: str) -> None:
    models = _models(preset, SMALL, ("full", "chunked", "fused", "torch"))
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 37, (3, 17), generator=gen).to(DEVICE)
    weights = torch.rand(3, 17, generator=gen)
    weights[1] = 0.0  # a whole sequence of weight 0
    weights = weights.to(DEVICE)
    want = _loss_and_grads(models["full"], tokens, weights)
    for impl in ("chunked", "fused", "torch"):
        _assert_same(_loss_and_grads(models[impl], tokens, weights), want, f"{preset} {impl}")
    # the logits are the same function for every setting (generation and evaluation read them)
    for impl in ("chunked", "fused"):
        assert torch.equal(models[impl](tokens), models["full"](tokens))
    assert models["full"](tokens).shape == (3, 17, 37)


def test_tied_embedding_gets_both_gradients() -> None:
    """Tied: the unembedding's gradient from the loss adds to the embedding's from the lookup."""
    models = _models("tiny", SMALL, ("full", "chunked"))
    assert models["chunked"].unembed.weight is models["chunked"].tok_emb.weight
    tokens = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    weights = torch.ones(2, 12, device=DEVICE)
    _assert_same(
        _loss_and_grads(models["chunked"], tokens, weights),
        _loss_and_grads(models["full"], tokens, weights),
        "tied",
    )


def test_gpt2_124m_width_and_vocabulary_chunked_equals_full() -> None:
    """gpt2_124m's unembedding (V = 50,257, D = 768, tied) with one layer, on 2 x 256 tokens."""
    models = _models("gpt2_124m", ["n_layers=1", "max_seq_len=256"], ("full", "chunked"))
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 50257, (2, 256), generator=gen).to(DEVICE)
    weights = (torch.rand(2, 256, generator=gen) > 0.1).float().to(DEVICE)
    want = _loss_and_grads(models["full"], tokens, weights)
    _assert_same(_loss_and_grads(models["chunked"], tokens, weights), want, "gpt2_124m chunked")


def test_auto_picks_fused_where_triton_runs_and_chunked_elsewhere() -> None:
    cpu = torch.zeros(2, 3)
    assert ops.loss_implementation(cpu, "auto", "auto") == "chunked"
    assert ops.loss_implementation(cpu, "auto", "torch") == "chunked"
    assert ops.loss_implementation(cpu, "auto", "triton") == "fused"
    assert ops.loss_implementation(cpu.double(), "auto", "triton") == "chunked"  # the kernel has no fp64
    for impl in ("fused", "chunked", "torch", "full"):
        assert ops.loss_implementation(cpu, impl, "torch") == impl
    if torch.cuda.is_available():
        assert ops.loss_implementation(cpu.cuda(), "auto", "auto") == "fused"
    assert compose([]).model.loss_impl == "auto" and LOSS_IMPLS == (
        "auto",
        "fused",
        "chunked",
        "torch",
        "full",
    )


def test_bad_loss_impl_fails_at_composition_naming_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"model.loss_impl='liger' is not valid; choose one of: auto, fused"
    ):
        compose(["model.loss_impl=liger"])


def test_resume_and_init_from_ignore_the_loss_impl() -> None:
    """Like model.kernels, loss_impl chooses an implementation, not the function."""
    saved = config_to_dict(compose(["model.loss_impl=full"]))["model"]
    now = config_to_dict(compose(["model.loss_impl=fused"]))["model"]
    assert model_differences(saved, now, "checkpoint") is None
    older = {k: v for k, v in saved.items() if k != "loss_impl"}  # a checkpoint from before the option
    assert model_differences(older, now, "checkpoint") is None


@pytest.mark.skipif(DEVICE != "cpu", reason="the refusal is for the CPU interpreter")
def test_fused_bf16_on_cpu_is_one_clear_error() -> None:
    h, w, t = torch.randn(4, 16).bfloat16(), torch.randn(8, 16).bfloat16(), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ConfigError, match="model.loss_impl=fused with bf16 on cpu"):
        ops.linear_cross_entropy(h, w, t, None, None, loss_impl="fused")
