"""The Llama family in and out of Hugging Face:

- HF -> lmsys -> HF (lmsys-import, then lmsys-export format=hf) gives back every tensor bit for bit,
  the same transformers class and config, and the same tokenizer.json, for Llama, Qwen2 (its
  vocabulary padded past the tokenizer's), Qwen3 and Mistral (read from shards and their index);
- a family model trained in lmsys (no import) exports as the architecture its function needs
  (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM), which AutoModelForCausalLM loads with
  lmsys's logits, and which lmsys reads back exactly;
- a rotary model whose function no architecture has is refused in one line (the command's other
  refusals: tests/integration/llama/test_hf_both_ways.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lmsys.core.config import compose_model
from lmsys.core.errors import ExportError
from lmsys.interop.export_dir import export_checkpoint, load_export, write_export
from lmsys.model.transformer import Transformer
from tests.fixtures.family import CONTEXT, FAMILIES, PIECES
from tests.hf_files import moved_off_init

# Config keys that shape the function (transformers' names); head_dim and rope_parameters as
# transformers fills them in.
FUNCTION_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                 "tie_word_embeddings", "rope_parameters", "attention_bias", "mlp_bias", "sliding_window",
                 "layer_types")  # fmt: skip


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers directory, across its shards."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_lmsys_to_hf_is_exact(tmp_path, family, hf_family, family_imports, transformers):
    source, imported = hf_family[family], family_imports[family]
    back = export_checkpoint(imported, tmp_path / "back", fmt="hf")
    original, again = _tensors(source), _tensors(back)
    assert sorted(original) == sorted(again)
    for name, tensor in original.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name
    first, second = (json.loads((d / "config.json").read_text()) for d in (source, back))
    assert second["model_type"] == first["model_type"] == family
    assert second["architectures"] == first["architectures"]
    auto = transformers.AutoConfig
    want, got = auto.from_pretrained(source).to_dict(), auto.from_pretrained(back).to_dict()
    assert {k: got.get(k) for k in FUNCTION_KEYS} == {k: want.get(k) for k in FUNCTION_KEYS}
    model = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert type(model).__name__ == first["architectures"][0]
    assert (back / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    cfg = load_export(imported)[0].cfg
    padded = family in ("qwen2", "qwen3")  # the import knows its tokenizer's pieces
    assert (cfg.vocab_size, cfg.tokenizer_vocab_size) == (PIECES + 16, PIECES) if padded else (PIECES, None)


SMALL = [
    f"vocab_size={PIECES}",
    "d_model=64",
    "n_layers=2",
    "n_heads=4",
    f"max_seq_len={CONTEXT}",
    "ffn.d_ff=96",
]
FROM_SCRATCH = {
    "LlamaForCausalLM": [],
    "Qwen2ForCausalLM": ["attention.q_bias=true", "attention.k_bias=true", "attention.v_bias=true"],
    "Qwen3ForCausalLM": ["attention.qk_norm=true", "attention.d_qk=24", "attention.d_vo=24"],
}


@pytest.mark.parametrize("architecture", FROM_SCRATCH)
@torch.no_grad()
def test_a_family_model_exports_as_its_architecture(tmp_path, architecture, hf_family, transformers):
    cfg = compose_model("llama_tiny", [*SMALL, *FROM_SCRATCH[architecture]])
    torch.manual_seed(0)
    model = moved_off_init(Transformer(cfg).eval())
    tokenizer = hf_family["llama"] / "tokenizer.json"
    out = write_export(tmp_path / "hf", cfg, model.state_dict(), tokenizer, {"step": 3}, fmt="hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == architecture
    ids = torch.randint(0, PIECES, (2, CONTEXT), generator=torch.Generator().manual_seed(3))
    want = model(ids)
    torch.testing.assert_close(hf(ids).logits, want, atol=1e-5 * want.abs().max().item(), rtol=0)
    back, _, meta = load_export(out)
    assert back.cfg == cfg and meta["format"] == "hf" and torch.equal(back(ids), want)
    assert f"Hugging Face format, {architecture}" in (out / "README.md").read_text()


def test_a_rotary_model_no_architecture_has_is_refused(tmp_path, hf_family):
    cfg = compose_model("llama_tiny", [*SMALL, "norm.formula=sqrt_var_eps"])
    tokenizer = hf_family["llama"] / "tokenizer.json"
    with pytest.raises(
        ExportError, match=r"LlamaForCausalLM .*; model\.norm\.formula=sqrt_var_eps differs \(llama: rms\)"
    ):
        write_export(tmp_path / "hf", cfg, Transformer(cfg).state_dict(), tokenizer, fmt="hf")
    assert list(tmp_path.iterdir()) == []
