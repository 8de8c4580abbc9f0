"""The Llama family in and out of Hugging Face:

- HF -> lmsys -> HF (lmsys-import, then lmsys-export format=hf) gives back every tensor bit for bit,
  the same transformers class and config, and the same tokenizer.json, for Llama, Qwen2 (its
  vocabulary padded past the tokenizer's), Qwen3 and Mistral (read from shards and their index);
- a family model trained in lmsys (no import) exports as the architecture its function needs
  (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM), which AutoModelForCausalLM loads with
  lmsys's logits, and which lmsys reads back exactly;
- what lmsys cannot express is refused in one line naming what is supported: sliding-window
  attention in use, a rope scaling other than default and llama3, an unknown model_type, a
  rotary model whose function no architecture has."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lmsys.core.config import compose_model
from lmsys.core.errors import ExportError
from lmsys.interop.export_dir import export_checkpoint, import_checkpoint, load_export, write_export
from lmsys.model.transformer import Transformer
from tests.export.conftest import assert_one_line_error, run_clis
from tests.hf_files import moved_off_init
from tests.llama.conftest import CONTEXT, FAMILIES, PIECES

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


def _edited(root: Path, source: Path, name: str, **changes) -> Path:
    """A copy of a checkpoint directory whose config.json has `changes` (None deletes a key)."""
    target = root / name
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return target


REFUSED = {
    "sliding": ("mistral", {"sliding_window": 16},
                "sliding-window attention (sliding_window=16, shorter than the context of 64) has no lmsys "
                "equivalent"),
    "qwen-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
                     "layer_types": None}, "sliding-window attention (sliding_window=16"),
    "yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
             "rope scaling 'yarn' has no lmsys equivalent; lmsys reads the default rotary positions and "
             "llama3's scaling"),
    "model-type": ("llama", {"model_type": "gemma"}, "has model_type 'gemma'; lmsys reads checkpoints of "
                   "model_type gpt2, llama, qwen2, qwen3, mistral"),
}  # fmt: skip


def test_what_lmsys_cannot_express_is_refused_in_one_line(tmp_path, hf_family):
    sources = {case: _edited(tmp_path, hf_family[family], case, **changes)
               for case, (family, changes, _) in REFUSED.items()}  # fmt: skip
    for case, (_, _, message) in REFUSED.items():  # the function's message, each
        with pytest.raises(ExportError, match=None) as info:
            import_checkpoint(sources[case], tmp_path / f"out-{case}")
        assert message in str(info.value) and "\n" not in str(info.value), (case, info.value)
    # the command's line, for one of them, and a window as long as the context is no window at all
    wide = _edited(tmp_path, hf_family["mistral"], "wide", sliding_window=CONTEXT)
    results = run_clis(
        {
            "sliding": ["lmsys.hf_import", str(sources["sliding"]), f"out={tmp_path / 'o1'}"],
            "wide": ["lmsys.hf_import", str(wide), f"out={tmp_path / 'o2'}"],
        },
        parallel=2,
    )
    assert_one_line_error(results["sliding"], "lmsys-import", REFUSED["sliding"][2])
    assert results["wide"].returncode == 0, results["wide"].stderr
    assert not (tmp_path / "o1").exists() and not list(tmp_path.glob(".tmp-*"))
