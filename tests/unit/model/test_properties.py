"""SPEC section 9 properties, the loss, gradients, memorisation, and bad configs."""

from __future__ import annotations

import pytest
import torch

from lmsys.core.config import compose, compose_model
from lmsys.core.errors import ConfigError
from lmsys.model.kv_cache import KVCache
from lmsys.model.transformer import Transformer, weighted_next_token_loss
from tests.unit.model import references as ref

SMALL = ["vocab_size=31", "d_model=16", "n_heads=4", "n_layers=2", "max_seq_len=12", "ffn.d_ff=24"]
CAUSAL_PRESETS = ["seed_gpt", "seed_trax", "seed_postln", "seed_compact", "gpt2_124m", "tiny"]
ALL_PRESETS = ["seed_gpt", "seed_trax", "seed_postln", "seed_compact", "gpt2_124m", "tiny"]


def small_model(preset: str, extra: list[str] | None = None, dtype=torch.float64) -> Transformer:
    torch.manual_seed(0)
    return Transformer(compose_model(preset, SMALL + (extra or []))).to(dtype)


@pytest.mark.parametrize("preset", CAUSAL_PRESETS)
def test_autoregressive(preset: str) -> None:
    """model(s[:i]) == model(s)[:i] for every i (seed 001)."""
    model = small_model(preset)
    ids = torch.randint(0, 31, (2, 12), generator=torch.Generator().manual_seed(5))
    full = model(ids)
    for i in range(1, 13):
        torch.testing.assert_close(model(ids[:, :i]), full[:, :i], atol=1e-12, rtol=0)


def test_bidirectional_is_not_autoregressive() -> None:
    model = small_model("seed_compact", ["attention.causal=false"])
    ids = torch.randint(0, 31, (1, 12), generator=torch.Generator().manual_seed(5))
    assert not torch.allclose(model(ids[:, :6]), model(ids)[:, :6])


@pytest.mark.parametrize("preset", ["seed_gpt", "seed_postln", "gpt2_124m"])
def test_permutation_covariance(preset: str) -> None:
    """Seed 003: with no positions and no mask, permuting the rows permutes the output rows."""
    model = small_model(preset, ["positions.kind=none", "attention.causal=false"])
    ids = torch.randint(0, 31, (1, 10), generator=torch.Generator().manual_seed(7))
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(model(ids[:, perm]), model(ids)[:, perm], atol=1e-12, rtol=0)
    causal = small_model(preset, ["positions.kind=none", "attention.causal=true"])
    assert not torch.allclose(causal(ids[:, perm]), causal(ids)[:, perm], atol=1e-6)


def test_factored_and_bilinear_head_forms_agree() -> None:
    """Seed 000 section 3: head(X) = softmax(X W_QK X^T) X W_OV^T equals the Q/K/V/O form."""
    model = small_model("seed_gpt", ["n_layers=1"])
    attn = model.blocks[0].attn
    x = torch.randn(1, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    factored = attn(x)[0]
    mask = torch.ones(9, 9, dtype=torch.bool).triu(1)
    bilinear = torch.zeros(9, 16, dtype=torch.float64)
    for hw in ref.heads_of(attn):
        w_qk = hw.wq @ hw.wk.T  # (D, D), rank <= d_qk
        w_ov = (hw.wv @ hw.wo).T  # (D, D), rank <= d_vo
        a = torch.softmax((x[0] @ w_qk @ x[0].T).masked_fill(mask, float("-inf")), dim=-1)
        bilinear += a @ x[0] @ w_ov.T
    torch.testing.assert_close(factored, bilinear, atol=1e-12, rtol=0)
    assert torch.linalg.matrix_rank(w_qk) <= attn.d_qk


def test_matrix_softmax_reference_option_normalises_whole_matrix() -> None:
    from lmsys.model import ops

    q, k, v = (torch.randn(1, 1, 5, 4, dtype=torch.float64) for _ in range(3))
    out = ops.matrix_softmax_attention(q, k, v, causal=True, scale=0.5)
    scores = (0.5 * q @ k.transpose(-1, -2)).masked_fill(torch.ones(5, 5).bool().triu(1), float("-inf"))
    weights = torch.exp(scores) / torch.exp(scores).sum()
    torch.testing.assert_close(out, weights @ v)
    model = small_model("seed_gpt", ["attention.softmax=matrix"])
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 31)


# ----------------------------------------------------------------------------- loss


def test_loss_hand_computed_with_weights() -> None:
    # two rows, vocabulary 2; logits chosen so log-probabilities are simple
    logits = torch.tensor([[[0.0, 0.0], [0.0, 2.0]], [[1.0, 1.0], [3.0, 0.0]]], dtype=torch.float64)
    targets = torch.tensor([[0, 1], [1, 0]])
    weights = torch.tensor([[1.0, 0.5], [0.0, 1.0]], dtype=torch.float64)
    lp = torch.log_softmax(logits, -1)
    by_hand = -(1.0 * lp[0, 0, 0] + 0.5 * lp[0, 1, 1] + 0.0 * lp[1, 0, 1] + 1.0 * lp[1, 1, 0]) / 2.5
    torch.testing.assert_close(weighted_next_token_loss(logits, targets, weights), by_hand)
    import math

    expected = (math.log(2) + 0.5 * -(2 - math.log(1 + math.e**2)) + -(3 - math.log(math.e**3 + 1))) / 2.5
    assert weighted_next_token_loss(logits, targets, weights).item() == pytest.approx(expected, abs=1e-12)
    assert weighted_next_token_loss(logits, targets).item() == pytest.approx(
        -lp.gather(-1, targets[..., None]).mean().item()
    )


def test_whole_batch_mean_differs_from_mean_of_row_means() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 5, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 5, (2, 4), generator=g)
    weights = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    whole = weighted_next_token_loss(logits, targets, weights)
    rows = torch.stack(
        [
            weighted_next_token_loss(logits[i : i + 1], targets[i : i + 1], weights[i : i + 1])
            for i in range(2)
        ]
    )
    assert abs(whole.item() - rows.mean().item()) > 1e-3
    equal_sums = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    rows_eq = torch.stack(
        [
            weighted_next_token_loss(logits[i : i + 1], targets[i : i + 1], equal_sums[i : i + 1])
            for i in range(2)
        ]
    )
    torch.testing.assert_close(weighted_next_token_loss(logits, targets, equal_sums), rows_eq.mean())


def test_zero_weights_give_zero_loss_not_nan() -> None:
    logits = torch.randn(1, 3, 4, requires_grad=True)
    loss = weighted_next_token_loss(logits, torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logits.grad == 0)


def test_usual_shift_and_bos_shift_targets() -> None:
    model = small_model("tiny")
    tokens = torch.randint(0, 31, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    torch.testing.assert_close(model.loss(tokens), weighted_next_token_loss(logits, tokens[:, 1:]))
    shifted = small_model("tiny", ["bos_shift=true", "bos_shift_id=3"])
    inputs = torch.cat([torch.full((2, 1), 3), tokens[:, :-1]], dim=1)
    torch.testing.assert_close(shifted.loss(tokens), weighted_next_token_loss(shifted(inputs), tokens))


# ----------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("preset", ["tiny", "seed_trax", "seed_postln"])
def test_kv_cache_matches_full_forward(preset: str) -> None:
    model = small_model(preset)
    ids = torch.randint(0, 31, (2, 10), generator=torch.Generator().manual_seed(4))
    full = model(ids)
    cache = KVCache.empty(model.cfg, batch=2, max_len=12, device=ids.device, dtype=torch.float64)
    parts = [model(ids[:, :4], cache)] + [model(ids[:, t : t + 1], cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-12, rtol=0)
    assert cache.length == 10


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_every_parameter_receives_a_gradient(preset: str) -> None:
    model = small_model(preset, dtype=torch.float32)
    tokens = torch.randint(0, 31, (2, 12))
    model.loss(tokens).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{preset}: {name} has no gradient"
        assert torch.count_nonzero(p.grad) > 0, f"{preset}: {name} has an all-zero gradient"


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_memorises_a_repeated_batch(preset: str) -> None:
    torch.manual_seed(0)
    model = Transformer(
        compose_model(
            preset,
            ["vocab_size=64", "d_model=32", "n_heads=4", "n_layers=2", "max_seq_len=32", "ffn.d_ff=64"],
        )
    )
    tokens = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first = model.loss(tokens).item()
    for _ in range(200):
        opt.zero_grad()
        loss = model.loss(tokens)
        loss.backward()
        opt.step()
    assert first > 3.5  # about log(64) at initialisation
    assert loss.item() < 0.2 * first, f"{preset}: loss {first:.3f} -> {loss.item():.3f}"


@pytest.mark.parametrize("preset", ["seed_trax", "tiny"])
def test_activation_checkpointing_keeps_the_padded_forward_and_its_gradients(preset: str) -> None:
    """engine.apply_activation_checkpointing re-runs each block in the backward with all of its
    arguments, the padding mask included."""
    from lmsys.engine.zero import apply_activation_checkpointing  # the engine room; DeepSpeed not needed

    ids = torch.randint(0, 31, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :4] = False  # row 1 padded on the left
    results = []
    for wrap in (False, True):
        model = small_model(preset)
        if wrap:
            assert apply_activation_checkpointing(model) == 2
        logits = model(ids, mask=mask)
        logits[mask].sum().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    (plain, plain_grads), (wrapped, wrapped_grads) = results
    torch.testing.assert_close(wrapped, plain, atol=0, rtol=0)
    for a, b in zip(wrapped_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_parameter_and_flops_helpers() -> None:
    model = Transformer(compose_model("gpt2_124m"))
    assert model.num_parameters() == 124_439_808  # GPT-2 small, tied embeddings counted once
    n = model.matmul_parameters()
    assert n == 124_439_808 - 1024 * 768
    assert model.flops_per_token(1024) == 6 * n + 12 * 12 * 12 * 64 * 1024


# ----------------------------------------------------------------------------- bad configs


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.heads=4"], "model.heads"),
        (["model.n_heads=5"], "model.n_heads"),
        (["model.ffn.activation=swishy"], "model.ffn.activation"),
        (["model.positions.kind=sinusoidal", "model.d_model=33", "model.n_heads=1"], "model.d_model"),
        (["model.d_model=wide"], "model.d_model"),
        (["model.norm.formula=l2"], "model.norm.formula"),
        (["model.block=sandwich"], "model.block"),
        (["model.kernels=cuda"], "model.kernels"),
        (["model.attention.scale=-1"], "model.attention.scale"),
        (["model.block=pre", "model.norm.formula=none"], "model.norm.formula"),
        (["model.max_seq_len=64", "data.seq_len=128"], "data.seq_len"),
        (["deepspeed.stage=4"], "deepspeed.stage"),
    ],
)
def test_bad_config_fails_at_composition_naming_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    message = str(info.value)
    assert key in message, message
    assert "\n" not in message


def test_unknown_preset_lists_the_available_ones() -> None:
    with pytest.raises(ConfigError, match="seed_trax"):
        compose(["model=seed_nope"])


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("optim.lrr=1", "did you mean optim.lr?"),
        ("trainer.max_step=3", "did you mean trainer.max_steps?"),
        ("model.attention.cusal=false", "did you mean model.attention.causal?"),
        ("model=tny", "did you mean model=tiny?"),
        ("optim.xyzzy=1", None),  # nothing close: no guess
    ],
)
def test_a_misspelled_key_or_choice_gets_the_nearest_one(override: str, suggestion: str | None) -> None:
    with pytest.raises(ConfigError) as info:
        compose([override])
    message = str(info.value)
    assert message.endswith(suggestion) if suggestion else "did you mean" not in message, message


def test_every_preset_composes_and_builds() -> None:
    for preset in ["seed_gpt", "seed_trax", "seed_postln", "seed_compact", "tiny"]:
        cfg = compose([f"model={preset}"])
        assert cfg.model.name == preset
    for preset in ["gpt2_124m", "gpt2_350m", "gpt2_774m", "gpt2_1558m"]:
        with torch.device("meta"):
            model = Transformer(compose([f"model={preset}"]).model)
        expected = {
            "gpt2_124m": 124_439_808,
            "gpt2_350m": 354_823_168,
            "gpt2_774m": 774_030_080,
            "gpt2_1558m": 1_557_611_200,
        }
        assert model.num_parameters() == expected[preset]
