"""lmsys-import: a transformers GPT-2 directory (GPT2LMHeadModel.save_pretrained, a byte-level BPE
trained with `tokenizers`) becomes an lmsys export with transformers' logits and tokenizer ids;
.bin weights are read without unpickling code; HF -> lmsys -> HF gives back the same weights and
ids. The command and its mistakes: tests/integration/export/test_import.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from lmsys.data.tokenizer import Tokenizer
from lmsys.interop.export_dir import export_checkpoint, import_checkpoint, load_export
from tests.fixtures.data import UNICODE_SAMPLES
from tests.fixtures.exports import BPE_VOCAB, SEQ
from tests.stdlib_text import module_docstrings

TEXTS = [
    *UNICODE_SAMPLES,
    "a<|endoftext|>b",
    "def f(x):\n    return x  # 42\n\n",
    *module_docstrings("heapq"),
]


def _ids(n: int = 3) -> torch.Tensor:
    return torch.randint(0, BPE_VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def test_import_gives_transformers_logits_and_ids(hf_gpt2_dir, gpt2_import, transformers):
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_gpt2_dir).eval()
    model, tok, meta = load_export(gpt2_import)
    torch.testing.assert_close(model(_ids()), hf(_ids()).logits, atol=2e-5, rtol=1e-5)
    assert model.cfg.name == "gpt2-test" and model.unembed.weight is model.tok_emb.weight
    assert meta["imported_from"] == hf_gpt2_dir.name  # no local path in a model one may publish
    # the user's own tokenizer, as transformers reads those files (GPT2Tokenizer: <|endoftext|>)
    auto = transformers.AutoTokenizer.from_pretrained(hf_gpt2_dir)
    assert tok.kind == "hf" and tok.sha256 == Tokenizer(hf_gpt2_dir).sha256
    assert (tok.eos_id, tok.bos_id, tok.unk_id, tok.pad_id) == (
        auto.eos_token_id, auto.bos_token_id, auto.unk_token_id, auto.pad_token_id,
    ) == (BPE_VOCAB - 1, BPE_VOCAB - 1, BPE_VOCAB - 1, None)  # fmt: skip
    assert [tok.encode(t) for t in TEXTS] == [auto(t)["input_ids"] for t in TEXTS]
    assert sorted(p.name for p in gpt2_import.iterdir()) == [
        "README.md", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    card = (gpt2_import / "README.md").read_text()
    assert f"imported into lmsys from `{hf_gpt2_dir.name}`" in card and str(hf_gpt2_dir.parent) not in card


def _old_style_bin(source: Path, out: Path, transformers) -> Path:
    """pytorch_model.bin as transformers 4 and OpenAI's GPT-2 files hold it: torch.save of the state
    dict, names without `transformer.`, causal-mask buffers, no lm_head."""
    hf = transformers.GPT2LMHeadModel.from_pretrained(source)
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(hf.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    out.mkdir()
    torch.save(state, out / "pytorch_model.bin")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, out / name)
    return out


@torch.no_grad()
def test_bin_and_sharded_weights(tmp_path, hf_gpt2_dir, transformers):
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_gpt2_dir).eval()
    want = hf(_ids()).logits
    old = _old_style_bin(hf_gpt2_dir, tmp_path / "old", transformers)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (
        sharded / "model.safetensors"
    ).exists()
    shutil.copyfile(hf_gpt2_dir / "tokenizer.json", sharded / "tokenizer.json")
    for source in (old, sharded):
        model, _, _ = load_export(import_checkpoint(source, tmp_path / f"{source.name}-import"))
        torch.testing.assert_close(model(_ids()), want, atol=2e-5, rtol=1e-5)


@torch.no_grad()
def test_hf_to_lmsys_to_hf_gives_back_the_same_model_and_ids(
    tmp_path, hf_gpt2_dir, gpt2_import, transformers
):
    back = export_checkpoint(gpt2_import, tmp_path / "back", fmt="hf")  # lmsys-export EXPORT format=hf
    original = transformers.GPT2LMHeadModel.from_pretrained(hf_gpt2_dir).state_dict()
    again = transformers.GPT2LMHeadModel.from_pretrained(back).state_dict()
    assert original.keys() == again.keys() and all(torch.equal(original[k], again[k]) for k in original)
    assert (back / "tokenizer.json").read_bytes() == (hf_gpt2_dir / "tokenizer.json").read_bytes()
    first = transformers.AutoTokenizer.from_pretrained(hf_gpt2_dir)
    second = transformers.AutoTokenizer.from_pretrained(back)
    assert [second(t)["input_ids"] for t in TEXTS] == [first(t)["input_ids"] for t in TEXTS]
    assert (
        second.eos_token_id
        == first.eos_token_id
        == json.loads((back / "config.json").read_text())["eos_token_id"]
    )


@torch.no_grad()
def test_lmsys_to_hf_to_lmsys_keeps_the_sentencepiece_tokenizer(tmp_path, hf_export):
    imported = import_checkpoint(hf_export, tmp_path / "imported")
    (model, tok, _), (want, want_tok, _) = load_export(imported), load_export(hf_export)
    assert tok.kind == "sentencepiece" and tok.sha256 == want_tok.sha256
    ids = torch.randint(0, tok.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids), want(ids)) and model.cfg == want.cfg
    back = export_checkpoint(imported, tmp_path / "back", fmt="hf")
    assert (back / "tokenizer.json").read_bytes() == (hf_export / "tokenizer.json").read_bytes()
