"""Each seed preset's forward equals an independent reference of its document to 1e-10."""

from __future__ import annotations

import math

import pytest
import torch

from lmsys.core.config import compose_model
from lmsys.model.transformer import Transformer, fourier_t_table, sinusoidal_table
from tests.unit.model import references as ref

SMALL = ["vocab_size=23", "d_model=12", "n_heads=3", "n_layers=2", "max_seq_len=9", "ffn.d_ff=20"]


def build(preset: str, extra: list[str] | None = None, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(compose_model(preset, SMALL + (extra or []))).double()
    with torch.no_grad():  # non-trivial biases, gains and positions so every term is exercised
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name or "positions" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def ids_for(model: Transformer, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (length,), generator=g)


@pytest.mark.parametrize("block", ["none", "parallel"])
def test_seed_gpt_matches_seed000(block: str) -> None:
    model = build("seed_gpt", [f"block={block}"])
    ids = ids_for(model, 9)
    ours = model(ids[None])[0]
    if block == "none":
        expected = ref.seed000_logits(model, ids)
    else:  # remark 4.1: X -> X + attn-update(X) + m(X), no normalisation in seed 000
        expected = seed000_parallel(model, ids)
    torch.testing.assert_close(ours, expected, atol=1e-10, rtol=0)


def seed000_parallel(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    x = ref.embeddings(model, ids)
    n = x.shape[0]
    for block in model.blocks:
        update = torch.zeros_like(x)
        for hw in ref.heads_of(block.attn):
            scores = x @ (hw.wq @ hw.wk.T) @ x.T
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
            update = update + torch.softmax(scores, dim=-1) @ x @ (hw.wv @ hw.wo)
        (w1, b1), (w2, b2) = ref.linear(block.ffn.hidden[0]), ref.linear(block.ffn.out)
        x = x + update + (ref.relu(x @ w1.T + b1) @ w2.T + b2)
    return x @ model.unembed.weight.detach().T


def test_seed_gpt_untied_variant() -> None:
    model = build("seed_gpt", ["tied_embeddings=false"])
    assert model.unembed.weight is not model.tok_emb.weight
    ids = ids_for(model, 7)
    torch.testing.assert_close(model(ids[None])[0], ref.seed000_logits(model, ids), atol=1e-10, rtol=0)


def test_seed_trax_matches_seed001() -> None:
    model = build("seed_trax")
    ids = ids_for(model, 9)
    torch.testing.assert_close(model(ids[None])[0], ref.seed001_logits(model, ids), atol=1e-10, rtol=0)


def test_seed_trax_loss_matches_seed001_batch_loss() -> None:
    model = build("seed_trax")
    g = torch.Generator().manual_seed(3)
    batch = torch.randint(1, model.cfg.vocab_size, (3, 8), generator=g)
    weights = torch.rand(3, 8, generator=g, dtype=torch.float64)
    weights[1, 4:] = 0.0  # rows with different weight sums
    ours = model.loss(batch, weights)
    torch.testing.assert_close(ours, ref.seed001_loss(model, batch, weights), atol=1e-10, rtol=0)


def test_seed_trax_positional_encoding_is_seed001_formula() -> None:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), pos = 1..M, trainable."""
    model = Transformer(compose_model("seed_trax", ["d_model=6", "n_heads=2", "max_seq_len=3"]))
    assert isinstance(model.positions.table, torch.nn.Parameter)
    d = 6
    expected = torch.tensor(
        [
            [f(pos / 10000 ** (2 * i / d)) for i in range(d // 2) for f in (math.sin, math.cos)]
            for pos in (1, 2, 3)
        ]
    )
    torch.testing.assert_close(model.positions.table.detach(), expected.float())
    torch.testing.assert_close(sinusoidal_table(3, 6, origin=0)[0], torch.tensor([0.0, 1.0] * 3))


def test_fourier_t_positions_follow_seed004_variation() -> None:
    """W_pos[2i, t] = cos(t / T^(2i/D)), W_pos[2i-1, t] = sin(t / T^(2i/D)) with 1-based i, t."""
    t_max, d = 5, 8
    table = fourier_t_table(t_max, d, base=t_max)
    for t in range(1, t_max + 1):
        for i in range(1, d // 2 + 1):
            angle = t / t_max ** (2 * i / d)
            assert table[t - 1, 2 * i - 1].item() == pytest.approx(math.cos(angle), abs=1e-6)  # dim 2i
            assert table[t - 1, 2 * i - 2].item() == pytest.approx(math.sin(angle), abs=1e-6)  # dim 2i-1
    model = Transformer(compose_model("tiny", ["positions.kind=fourier_T", "positions.trainable=false"]))
    assert "positions.table" in dict(model.named_buffers())


def test_seed_postln_matches_seed002() -> None:
    model = build("seed_postln")
    ids = ids_for(model, 6)
    torch.testing.assert_close(model(ids[None])[0], ref.seed002_logits(model, ids), atol=1e-10, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_seed_compact_matches_seed004(causal: bool) -> None:
    model = build("seed_compact", ["attention.d_qk=5", "attention.d_vo=7", f"attention.causal={causal}"])
    assert model.blocks[0].attn.d_qk == 5 and model.blocks[0].attn.d_vo == 7
    ids = ids_for(model, 8)
    expected = ref.seed004_logits(model, ids, causal=causal)
    torch.testing.assert_close(model(ids[None])[0], expected, atol=1e-10, rtol=0)
    # G = softmax(X_T W_une): the next-token distribution reads the last position
    g = torch.softmax(model(ids[None])[0, -1], dim=-1)
    torch.testing.assert_close(g, torch.softmax(expected[-1], dim=-1), atol=1e-10, rtol=0)


def test_gpt2_preset_matches_gpt2_function() -> None:
    """GPT-2: pre-LN with sqrt(var + 1e-5), all attention biases, gelu-tanh, final LN, tied."""
    model = build("gpt2_124m")
    ids = ids_for(model, 9)
    x = ref.embeddings(model, ids)
    n = x.shape[0]

    def ln(layer, z: torch.Tensor) -> torch.Tensor:
        mu = z.mean(-1, keepdim=True)
        var = ((z - mu) ** 2).mean(-1, keepdim=True)
        return (z - mu) / torch.sqrt(var + 1e-5) * layer.weight.detach() + layer.bias.detach()

    for block in model.blocks:
        h = ln(block.norm1, x)
        out = torch.zeros_like(x)
        for hw in ref.heads_of(block.attn):
            q, k, v = h @ hw.wq + hw.cq, h @ hw.wk + hw.ck, h @ hw.wv + hw.cv
            s = (q @ k.T / math.sqrt(hw.wq.shape[1])).masked_fill(torch.ones(n, n).bool().triu(1), -math.inf)
            out = out + torch.softmax(s, -1) @ v @ hw.wo
        x = x + out + block.attn.w_o.bias.detach()
        h = ln(block.norm2, x)
        (w1, b1), (w2, b2) = ref.linear(block.ffn.hidden[0]), ref.linear(block.ffn.out)
        a = h @ w1.T + b1
        gelu = 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
        x = x + gelu @ w2.T + b2
    expected = ln(model.final_norm, x) @ model.tok_emb.weight.detach().T
    torch.testing.assert_close(model(ids[None])[0], expected, atol=1e-10, rtol=0)
