"""The Llama family's options of the one Transformer (docs/SPEC.md section 11), in process:

- each option computes its formula, checked against the definition written out here in float64:
  RMS norm, the gated feed-forward, rotary positions (a head pair turned by p * f_i; scores that
  depend on positions only through their difference), llama3's frequencies, grouped-query attention
  (the multi-head model whose key/value heads are repeated per group);
- the presets have their published shapes (parameter counts, and transformers builds the same
  model from their format=hf config) and llama_tiny trains;
- the properties of every causal model (autoregressive, the KV cache exact, a padded row as alone),
  every model.kernels setting (Triton through its interpreter, GQA with repeated K/V), activation
  checkpointing, torch.compile without a graph break, Muon's share, lmsys-plan;
- bad input is one error line before any model is built."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.reference import rotary_reference
from lmsys.core.config import compose, compose_model
from lmsys.core.errors import ConfigError
from lmsys.engine.muon import split_parameters
from lmsys.engine.zero import apply_activation_checkpointing
from lmsys.model.kv_cache import KVCache, StaticKVCache
from lmsys.model.transformer import Transformer, rope_inverse_frequencies, rotary_tables
from tests.hf_files import moved_off_init

SMALL = ["vocab_size=41", "d_model=32", "n_heads=4", "n_layers=2", "max_seq_len=24", "ffn.d_ff=40"]
# every new option at once: rotary with llama3 scaling, GQA 4 over 2, QK-norm, q/k/v biases
FULL = ["attention.n_kv_heads=2", "attention.qk_norm=true", "attention.q_bias=true", "attention.k_bias=true",
        "attention.v_bias=true", "positions.rope_scaling.kind=llama3", "positions.rope_scaling.factor=4",
        "positions.rope_scaling.original_max_seq_len=8"]  # fmt: skip


def family_model(extra: list[str] | None = None, dtype=torch.float64, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return moved_off_init(Transformer(compose_model("llama_tiny", [*SMALL, *(extra or [])])).to(dtype))


def ids(batch: int = 2, length: int = 24, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 41, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the formulas


def test_rms_norm_is_its_formula():
    model = family_model()
    norm = model.blocks[0].norm1
    assert norm.bias is None and norm.formula == "rms"
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + norm.eps) * norm.weight
    torch.testing.assert_close(norm(x), want, atol=1e-14, rtol=0)


def test_the_gated_feed_forward_is_its_formula():
    ffn = family_model().blocks[0].ffn
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    w_gate, w_up, w_down = ffn.gate.weight, ffn.hidden[0].weight, ffn.out.weight
    silu = lambda z: z / (1 + torch.exp(-z))  # noqa: E731
    torch.testing.assert_close(ffn(x), (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T, atol=1e-14, rtol=0)
    gelu = family_model(["ffn.activation=gelu"]).blocks[0].ffn  # GeGLU
    phi = lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))  # noqa: E731
    want = (phi(x @ gelu.gate.weight.T) * (x @ gelu.hidden[0].weight.T)) @ gelu.out.weight.T
    torch.testing.assert_close(gelu(x), want, atol=1e-14, rtol=0)


def test_rotary_turns_each_half_split_pair_by_its_angle():
    cfg = compose_model("llama_tiny", SMALL)  # d_qk = 8: pairs (0, 4), (1, 5), (2, 6), (3, 7)
    positions = torch.arange(6)
    cos, sin = rotary_tables(cfg, positions, torch.float64)  # (6, 8)
    x = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    got = rotary_reference(x, cos, sin)
    f = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)  # theta^(-2i/d)
    for p in range(6):
        for i in range(4):
            a = p * f[i]
            x1, x2 = x[..., p, i], x[..., p, i + 4]
            torch.testing.assert_close(got[..., p, i], x1 * math.cos(a) - x2 * math.sin(a), atol=1e-6, rtol=0)
            torch.testing.assert_close(
                got[..., p, i + 4], x2 * math.cos(a) + x1 * math.sin(a), atol=1e-6, rtol=0
            )


def test_rotary_scores_depend_on_the_distance_only():
    cfg = compose_model("llama_tiny", SMALL)
    q, k = torch.randn(2, 1, 1, 8, dtype=torch.float64), torch.randn(2, 1, 1, 8, dtype=torch.float64)

    def score(m: int, n: int) -> torch.Tensor:
        cq, sq = rotary_tables(cfg, torch.tensor([m]), torch.float64)
        ck, sk = rotary_tables(cfg, torch.tensor([n]), torch.float64)
        return (rotary_reference(q, cq, sq) * rotary_reference(k, ck, sk)).sum(-1)

    for m, n in ((5, 2), (9, 9), (3, 11)):
        torch.testing.assert_close(score(m, n), score(m + 13, n + 13), atol=1e-5, rtol=0)
    assert not torch.allclose(score(5, 2), score(5, 3))


def test_llama3_frequencies_follow_the_three_bands():
    """Llama 3.1's rule, written from its definition: wavelengths below original / high_freq_factor
    keep their frequency, above original / low_freq_factor are divided by factor, in between
    interpolate smoothly."""
    cfg = compose_model("llama3_2_1b")
    got = rope_inverse_frequencies(cfg).double()
    s = cfg.positions.rope_scaling
    base = 500000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    want = []
    for f in base.tolist():
        wavelength = 2 * math.pi / f
        if wavelength < s.original_max_seq_len / s.high_freq_factor:
            want.append(f)
        elif wavelength > s.original_max_seq_len / s.low_freq_factor:
            want.append(f / s.factor)
        else:
            smooth = (s.original_max_seq_len / wavelength - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            want.append((1 - smooth) * f / s.factor + smooth * f)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    assert got[0] == base[0].float() and got[-1] < base[-1] / 31  # the fastest kept, the slowest scaled


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_grouped_query_attention_is_multi_head_with_shared_key_values(n_kv_heads):
    """GQA equals the multi-head model whose key/value heads are copies, head h reading copy h // g."""
    gqa = family_model(
        [f"attention.n_kv_heads={n_kv_heads}", "attention.k_bias=true", "attention.v_bias=true"]
    )
    mha = family_model(["attention.n_kv_heads=4", "attention.k_bias=true", "attention.v_bias=true"])
    group, d = 4 // n_kv_heads, 8
    state = gqa.state_dict()
    for i in range(2):
        a = f"blocks.{i}.attn."
        q, k, v = state[a + "w_qkv.weight"].split([4 * d, n_kv_heads * d, n_kv_heads * d])
        repeat = lambda w: w.view(n_kv_heads, 1, d, -1).expand(-1, group, -1, -1).reshape(4 * d, -1)  # noqa: E731
        state[a + "w_qkv.weight"] = torch.cat([q, repeat(k), repeat(v)])
        for name in ("k_bias", "v_bias"):
            state[a + name] = repeat(state[a + name][:, None])[:, 0]
    mha.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(mha(ids()), gqa(ids()), atol=1e-12, rtol=0)
    assert gqa.blocks[0].attn.w_qkv.weight.shape == ((4 + 2 * n_kv_heads) * d, 32)


# ----------------------------------------------------------------------------- presets


PUBLISHED = {  # preset: (parameters, transformers' class of its format=hf config)
    "llama3_2_1b": (1_235_814_400, "LlamaForCausalLM"),
    "qwen2_5_0_5b": (494_032_768, "Qwen2ForCausalLM"),
    "qwen3_0_6b": (596_049_920, "Qwen3ForCausalLM"),
    "smollm2_135m": (134_515_008, "LlamaForCausalLM"),
}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_presets_have_the_published_shapes(preset):
    from lmsys.interop.hf_llama import hf_config
    from lmsys.planning.trace import fake_model

    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = compose([f"model={preset}", "data.seq_len=1024"])
    n, architecture = PUBLISHED[preset]
    assert fake_model(cfg, None, "meta", torch.bfloat16).num_parameters() == n  # what lmsys-plan counts
    config = hf_config(cfg.model)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    assert type(theirs).__name__ == architecture
    assert sum(p.numel() for p in theirs.parameters()) == n


def test_llama_tiny_trains():
    torch.manual_seed(0)
    model = Transformer(compose_model("llama_tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.arange(33).repeat(2, 1) % 7  # a repeating pattern it can learn
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = model.loss(tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(2048), rel=0.05) and losses[-1] < losses[0] - 1.0, losses


# ----------------------------------------------------------------------------- properties and settings


@torch.no_grad()
def test_autoregressive_cached_and_padded():
    model = family_model(FULL).eval()
    s = ids(2, 24)
    full = model(s)
    for i in (1, 7, 24):
        torch.testing.assert_close(model(s[:, :i]), full[:, :i], atol=1e-12, rtol=0)
    for cache in (KVCache.empty(model.cfg, 2, 24, s.device, torch.float64),
                  StaticKVCache.empty(model.cfg, 2, 24, s.device, torch.float64)):  # fmt: skip
        assert cache.keys[0].shape == (2, 2, 24, 8)  # n_kv_heads key/value heads
        steps = [model(s[:, :10], cache)] + [model(s[:, t : t + 1], cache) for t in range(10, 24)]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=0)
    # row 1 padded on the left by 6: its tokens numbered from its first one, as alone
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, :6] = False
    padded = model(s, mask=mask)
    torch.testing.assert_close(padded[1, 6:], model(s[1:, 6:])[0], atol=1e-12, rtol=0)


def _loss_and_grads(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model.loss(tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kernels", ["auto", "triton"])
def test_every_kernels_setting_computes_the_torch_function(kernels):
    """On CPU, auto is torch; triton runs the family's kernels in the interpreter (flash attention
    with grouped key/value heads, RMS norm, rotary and the gated activation)."""
    want = _loss_and_grads(family_model([*FULL, "kernels=torch"], torch.float32), ids())
    got = _loss_and_grads(family_model([*FULL, f"kernels={kernels}"], torch.float32), ids())
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for name, grad in want[1].items():
        torch.testing.assert_close(
            got[1][name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_activation_checkpointing_recomputes_the_same_gradients():
    want = _loss_and_grads(family_model(FULL), ids())
    model = family_model(FULL)
    assert apply_activation_checkpointing(model) == 2
    got = _loss_and_grads(model, ids())
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, atol=1e-12, rtol=0)


def _explain(fn, *args):
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args)


def test_compile_traces_the_family_without_a_graph_break():
    """The loss, the forward, and generation's prompt and decode steps through a StaticKVCache:
    one graph each; compiled (aot_eager, what inductor is handed) equals eager."""
    model = family_model([*FULL, "kernels=torch"], torch.float32)
    tokens = ids()
    for what, out in (("loss", _explain(model.loss, tokens)), ("forward", _explain(model, tokens))):
        assert out.graph_break_count == 0 and out.graph_count == 1, (what, out.break_reasons)
    with torch.inference_mode():
        cache = StaticKVCache.empty(model.cfg, 2, 24, tokens.device, torch.float32)
        mask = torch.ones(2, 10, dtype=torch.bool)
        mask[0, :3] = False
        for what, out in (("prompt", _explain(model, tokens[:, :10], cache, mask)),
                          ("decode step", _explain(model, tokens[:, 10:11], cache))):  # fmt: skip
            assert out.graph_break_count == 0 and out.graph_count == 1, (what, out.break_reasons)
    want = _loss_and_grads(model, tokens)
    torch._dynamo.reset()
    compiled = torch.compile(model.loss, backend="aot_eager", fullgraph=True)
    model.zero_grad(set_to_none=True)
    loss = compiled(tokens)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want[0], atol=1e-6, rtol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[1][name], atol=1e-6, rtol=1e-6)


# What Muon steps in each block of the family (the rest: AdamW)
MUON_MATRICES = (
    "attn.w_qkv.weight",
    "attn.w_o.weight",
    "ffn.gate.weight",
    "ffn.hidden.0.weight",
    "ffn.out.weight",
)


def test_muon_takes_the_attention_and_feed_forward_matrices():
    model = family_model(FULL)
    muon, _, _ = split_parameters(model)
    names = {name for name, p in model.named_parameters() if any(p is m for m in muon)}
    assert names == {f"blocks.{i}.{n}" for i in range(2) for n in MUON_MATRICES}


@pytest.mark.parametrize("preset", ["llama_tiny", "qwen3_0_6b", "llama3_2_1b"])
def test_lmsys_plan_plans_the_family(preset):
    from lmsys.core.devices import device_spec
    from lmsys.planning.planner import plan_launch

    seq = 128 if preset == "llama_tiny" else 2048
    cfg = compose([f"model={preset}", f"data.seq_len={seq}", "trainer.micro_batch_size=1",
                   f"trainer.global_batch_tokens={8 * seq}", "deepspeed=zero3"])  # fmt: skip
    plan = plan_launch(cfg, 8, device_spec("h100"))
    assert plan.peak_bytes > plan.components["parameters"] > 0, plan.as_json()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "override, fragment",
    [("attention.n_kv_heads=3", "model.attention.n_kv_heads=3 must divide model.n_heads=4"),
     ("attention.d_qk=7", "model.attention.d_qk=7 is odd: rotary positions rotate pairs"),
     ("positions.rope_scaling.kind=yarn", "model.positions.rope_scaling.kind='yarn' is not valid; choose one "
      "of: none, llama3"),
     ("ffn.n_hidden_layers=2", "model.ffn.gated=true has one hidden layer")],
)  # fmt: skip
def test_bad_input_is_one_line_before_any_model(override, fragment):
    with pytest.raises(ConfigError) as info:
        compose_model("llama_tiny", [override])
    assert fragment in str(info.value) and "\n" not in str(info.value), info.value
