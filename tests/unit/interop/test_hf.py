"""format=hf: a directory that transformers' GPT2LMHeadModel loads, with lmsys's logits; and one
clear refusal naming the option for configs that are not GPT-2's function."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lmsys.core.config import compose_model
from lmsys.core.errors import ExportError
from lmsys.interop.export_dir import load_export, write_export
from lmsys.interop.hf import gpt2_difference, hf_config
from lmsys.model.transformer import Transformer
from tests.fixtures.exports import VOCAB, small_config

# GPT-2's function at a shape no GPT-2 has: width 48 over 3 heads, d_ff not 4x, another eps.
GPT2_SHAPED = ["d_model=48", "n_heads=3", "ffn.d_ff=100", "norm.eps=1e-6"]


def _noisy_model(cfg, seed: int = 0) -> Transformer:
    """Random weights with every bias and norm gain away from its initial 0 / 1, so a mapping
    that drops or misplaces one shows."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@torch.no_grad()
def test_hf_export_loads_in_gpt2lmheadmodel_with_equal_logits(tmp_path, tokenizer_path, gpt2_class):
    cfg = small_config("tiny", GPT2_SHAPED)
    model = _noisy_model(cfg)
    out = write_export(tmp_path / "hf", cfg, model.state_dict(), tokenizer_path, {"step": 7}, fmt="hf")
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    hf = gpt2_class.from_pretrained(out).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied in transformers too
    ids = torch.randint(0, VOCAB, (3, cfg.max_seq_len), generator=torch.Generator().manual_seed(1))
    want = model(ids)
    got = hf(ids).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)  # fp32, another matmul order
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Greedy decoding with transformers' own KV cache continues exactly like lmsys's.
    from lmsys.inference.generation import generate

    prompt = ids[:1, :6]
    hf_new = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=2)[0, 6:]
    ours = generate(model, prompt, 10, greedy=True, eos_id=2)[0]
    assert hf_new[: len(ours)].tolist() == ours
    # lmsys reads its hf export back exactly.
    loaded, _, meta = load_export(out)
    assert meta["format"] == "hf" and meta["step"] == 7
    assert torch.equal(loaded(ids), want)
    assert loaded.unembed.weight is loaded.tok_emb.weight


@pytest.mark.parametrize("preset", ["tiny", "gpt2_124m", "gpt2_350m", "gpt2_774m", "gpt2_1558m"])
def test_gpt2_presets_are_gpt2s_function(preset, gpt2_class):
    from transformers import GPT2Config

    cfg = compose_model(preset)
    assert gpt2_difference(cfg) is None
    hf = GPT2Config(**hf_config(cfg))
    assert (hf.n_embd, hf.n_layer, hf.n_head, hf.n_positions, hf.vocab_size) == (
        cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.max_seq_len, cfg.vocab_size,
    )  # fmt: skip


@pytest.mark.parametrize(
    "preset,option",
    [("seed_gpt", "model.block=none"), ("seed_trax", "model.positions.kind=sinusoidal"),
     ("seed_postln", "model.block=post"), ("seed_compact", "model.block=post")],
)  # fmt: skip
def test_other_presets_are_refused_naming_the_option(tmp_path, tokenizer_path, preset, option):
    cfg = small_config(preset)
    with pytest.raises(ExportError, match=r"format=hf needs GPT-2's function; " + re.escape(option)):
        write_export(tmp_path / "hf", cfg, Transformer(cfg).state_dict(), tokenizer_path, fmt="hf")
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left


@pytest.mark.parametrize(
    "override,named",
    [("attention.q_bias=false", "model.attention.q_bias=false"),
     ("attention.scale=0.5", "model.attention.scale=0.5"),
     ("attention.d_qk=8", "model.attention.d_qk=8"),
     ("ffn.activation=gelu", "model.ffn.activation=gelu"),
     ("ffn.n_hidden_layers=2", "model.ffn.n_hidden_layers=2"),
     ("norm.formula=std_plus_eps", "model.norm.formula=std_plus_eps"),
     ("final_norm=false", "model.final_norm=false"),
     ("tied_embeddings=false", "model.tied_embeddings=false"),
     ("unembed_bias=true", "model.unembed_bias=true"),
     ("bos_shift=true", "model.bos_shift=true")],
)  # fmt: skip
def test_one_differing_option_is_named(override, named):
    diff = gpt2_difference(small_config("tiny", [override]))
    assert diff is not None and diff.startswith(named + " differs (GPT-2: "), diff
