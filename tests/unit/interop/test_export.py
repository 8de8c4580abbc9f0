"""lmsys-export: the export directory, its loader, and real DeepSpeed checkpoints of every ZeRO stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lmsys.core.errors import ExportError
from lmsys.interop.export_dir import load_export, write_export
from lmsys.model.transformer import Transformer
from tests.fixtures.exports import SEQ, VOCAB, small_config


def _ids(n: int = 2, t: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


def _keys(path: Path) -> list[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


# ----------------------------------------------------------------------------- the directory


@pytest.mark.parametrize(
    "preset,extra",
    [("tiny", []), ("seed_trax", []), ("seed_gpt", ["tied_embeddings=false"]), ("seed_postln", []),
     ("seed_compact", ["attention.d_qk=8", "attention.d_vo=12"]),
     ("seed_trax", ["positions.trainable=false"])],
    ids=["tiny", "seed_trax", "seed_gpt-untied", "seed_postln", "seed_compact", "sinusoidal-buffer"],
)  # fmt: skip
def test_round_trip_gives_equal_logits(tmp_path, tokenizer_path, preset, extra):
    cfg = small_config(preset, extra)
    torch.manual_seed(1)
    model = Transformer(cfg).eval()
    out = write_export(tmp_path / "e", cfg, model.state_dict(), tokenizer_path, {"step": 5})
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.model",
    ]
    loaded, tok, meta = load_export(out)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))
    assert tok.vocab_size == VOCAB and meta["step"] == 5 and meta["format"] == "lmsys"
    if cfg.tied_embeddings:
        assert "unembed.weight" not in _keys(out) and "tok_emb.weight" in _keys(out)
        assert loaded.unembed.weight is loaded.tok_emb.weight
    else:
        assert "unembed.weight" in _keys(out)


def test_config_json_rebuilds_the_model(random_export):
    from lmsys.core.config import model_config_from_dict

    cfg = model_config_from_dict(json.loads((random_export / "config.json").read_text()))
    assert cfg == small_config()


def test_bf16_export_stores_bf16_and_loads(tmp_path, tokenizer_path):
    cfg = small_config()
    model = Transformer(cfg).eval()
    out = write_export(tmp_path / "bf16", cfg, model.state_dict(), tokenizer_path, dtype=torch.bfloat16)
    tensors = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    loaded, _, meta = load_export(out)
    assert meta["dtype"] == "bf16"
    rounded = Transformer(cfg).eval()
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        assert torch.equal(rounded(_ids()), loaded(_ids()))


def test_write_is_atomic(tmp_path, tokenizer_path, monkeypatch):
    from lmsys.interop import export_dir as export  # the module's own verify_export is patched

    cfg = small_config()
    state = Transformer(cfg).state_dict()
    out = write_export(tmp_path / "e", cfg, state, tokenizer_path)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ExportError, match="already exists"):
        write_export(tmp_path / "e", cfg, Transformer(cfg).state_dict(), tokenizer_path)

    def broken(*args, **kwargs):
        raise ExportError("simulated failure while writing")

    monkeypatch.setattr(export, "verify_export", broken)
    with pytest.raises(ExportError, match="simulated"):
        write_export(tmp_path / "e", cfg, Transformer(cfg).state_dict(), tokenizer_path, overwrite=True)
    with pytest.raises(ExportError, match="simulated"):
        write_export(tmp_path / "new", cfg, state, tokenizer_path)
    assert (out / "model.safetensors").read_bytes() == before  # the old export is untouched
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e"]  # no temporary directory left


def test_model_card(random_export):
    card = (random_export / "README.md").read_text()
    for fragment in ("`tiny`", "optimizer steps", "tokens seen", "final train loss", "final validation loss"):
        assert fragment in card


# ----------------------------------------------------------------------------- bad files


def test_mismatching_safetensors_names_the_tensor(tmp_path, random_export):
    bad = tmp_path / "bad"
    shutil.copytree(random_export, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["blocks.1.ffn.out.weight"] = torch.zeros(32, 65)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ExportError, match=r"blocks\.1\.ffn\.out\.weight.*\[32, 65\].*\[32, 64\]"):
        load_export(bad)
    del tensors["blocks.1.ffn.out.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ExportError, match=r"no tensor 'blocks\.1\.ffn\.out\.weight'"):
        load_export(bad)


def test_loading_never_unpickles(random_export, monkeypatch):
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling during load_export")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    load_export(random_export)


def _other_texts() -> list[str]:
    import importlib

    texts = []
    for name in ("enum", "decimal", "datetime", "calendar", "statistics", "fractions"):
        module = importlib.import_module(name)
        texts += [d for d in (getattr(module, a).__doc__ for a in dir(module)) if isinstance(d, str)]
    return texts


def test_tokenizer_that_does_not_match_is_refused(tmp_path, random_export):
    from lmsys.data.tokenizer import train_tokenizer

    other = tmp_path / "other"
    shutil.copytree(random_export, other)
    train_tokenizer(_other_texts(), VOCAB - 100, other / "tokenizer.model")
    with pytest.raises(ExportError, match="tokenizer does not match the model.*412 pieces.*512"):
        load_export(other)
    train_tokenizer(_other_texts(), VOCAB, other / "tokenizer.model")  # same size, another corpus
    with pytest.raises(ExportError, match="tokenizer does not match the model.*sha256"):
        load_export(other)


# ----------------------------------------------------------------------------- DeepSpeed checkpoints
