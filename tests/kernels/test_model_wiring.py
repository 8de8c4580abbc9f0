"""The model with model.kernels=triton equals model.kernels=torch, forward and every gradient.

On CPU the Triton kernels run through the interpreter (tests/conftest.py), so this checks the
wiring in lmsys/ops.py and the kernels' agreement with the torch path inside a whole model.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import kernels
from lmsys.config import compose_model
from lmsys.model import Transformer
from tests.conftest import DEVICE

SMALL = ["vocab_size=37", "d_model=32", "n_heads=2", "n_layers=2", "max_seq_len=24", "ffn.d_ff=48"]
PRESETS = {
    "seed_gpt": [],
    "seed_gpt_parallel": ["block=parallel"],
    "seed_trax": [],
    "seed_postln": [],
    "seed_compact": ["attention.d_qk=16", "attention.d_vo=24"],
    "seed_compact_bidirectional": ["attention.d_qk=16", "attention.d_vo=24", "attention.causal=false"],
    "gpt2_124m": [],
    "tiny": [],
}


def _pair(preset: str, extra: list[str]) -> tuple[Transformer, Transformer]:
    name = preset.removesuffix("_parallel").removesuffix("_bidirectional")
    models = []
    for choice in ("torch", "triton"):
        torch.manual_seed(0)
        cfg = compose_model(name, SMALL + extra + [f"kernels={choice}"])
        models.append(Transformer(cfg).to(DEVICE))
    # At init (std 0.02) attention is almost uniform, which hides a wrong scale (checked: seed_gpt's
    # scale 1 vs 1/sqrt(d) changed nothing). Perturb every parameter, biases and gains included,
    # identically in both models, so a wrong scale or mask moves logits and gradients by >= 3e-3.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in models[0].parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen).to(DEVICE))
    models[1].load_state_dict(models[0].state_dict())
    return models[0], models[1]


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Wrap the kernels' entry points (lmsys.ops imports them from `kernels` at call time)."""
    calls: Counter = Counter()
    for name in ("flash_attention", "layer_norm", "add_layer_norm"):
        original = getattr(kernels, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.mark.parametrize("preset", list(PRESETS))
def test_triton_model_equals_torch_model(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, fused = _pair(preset, PRESETS[preset])
    tokens = torch.randint(0, 37, (2, 19), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    weights = torch.rand(2, 19, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    calls = _count_kernel_calls(monkeypatch)
    loss_ref = reference.loss(tokens, weights)
    assert not calls, f"kernels=torch ran Triton kernels: {dict(calls)}"
    loss_fused = fused.loss(tokens, weights)
    # Every layer's attention, and every norm where the preset has one, went through Triton.
    assert calls["flash_attention"] == fused.cfg.n_layers, dict(calls)
    if fused.cfg.norm.formula != "none":
        assert calls["layer_norm"] + calls["add_layer_norm"] > 0, dict(calls)
    loss_ref.backward()
    loss_fused.backward()
    torch.testing.assert_close(fused(tokens[:, :-1]), reference(tokens[:, :-1]), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(loss_fused, loss_ref, atol=2e-6, rtol=1e-5)
    grads_ref = dict(reference.named_parameters())
    for name, p in fused.named_parameters():
        expected = grads_ref[name].grad
        # fp32 rounding relative to the tensor's largest entry (k biases get exactly-zero gradients
        # in exact arithmetic: softmax ignores a per-row shift, hence the floor). Observed <= 5e-7.
        atol = 1e-5 * max(expected.abs().max().item(), 1e-2)
        torch.testing.assert_close(p.grad, expected, atol=atol, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


def test_auto_uses_torch_on_cpu_and_triton_on_cuda() -> None:
    from lmsys import ops

    cpu = torch.zeros(1)
    assert not ops.use_triton(cpu, "auto")
    assert ops.use_triton(cpu, "triton")
    assert not ops.use_triton(cpu, "torch")
    if torch.cuda.is_available():
        assert ops.use_triton(cpu.cuda(), "auto")
