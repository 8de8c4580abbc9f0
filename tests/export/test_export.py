"""lmsys-export: the export directory, its loader, and real DeepSpeed checkpoints of every ZeRO stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lmsys.core.errors import CheckpointError, ExportError
from lmsys.interop.export_dir import export_checkpoint, load_export, load_model, write_export
from lmsys.model.transformer import Transformer
from tests.export.conftest import SEQ, VOCAB, small_config


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


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,stage", [(2, 0), (2, 1), (2, 2), (2, 3), (1, 2), (1, 3)], ids=lambda v: str(v)
)
def test_checkpoint_export_equals_trained_model(tmp_path, ds_checkpoints, world, stage):
    """Consolidated by DeepSpeed, exported, loaded: the logits are exactly the engine's own on
    the trained weights; the tied embedding is stored once and re-tied."""
    run = ds_checkpoints / f"w{world}" / f"zero{stage}"
    out = export_checkpoint(run, tmp_path / "export")
    model, tok, meta = load_export(out)
    ref = load_file(str(run / "reference_logits.safetensors"))
    with torch.no_grad():
        assert torch.equal(model(ref["ids"]), ref["logits"])
    assert meta["step"] == 2 and meta["zero_stage"] == stage and meta["world_size"] == world
    assert model.unembed.weight is model.tok_emb.weight
    assert "unembed.weight" not in _keys(out)
    assert f"ZeRO stage {stage} on {world} process(es)" in (out / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_bf16_checkpoint_exports_the_fp32_master_weights(tmp_path, ds_checkpoints, stage):
    """A bf16 run's ZeRO partitions are files named bf16_zero_pp_rank_*: the export consolidates
    them (fp32 master weights, not the bf16 module copy), at every stage; the logits agree with
    the engine's bf16 forward to bf16 precision."""
    run = ds_checkpoints / "w2-bf16" / f"zero{stage}"
    out = export_checkpoint(run, tmp_path / "export")
    model, _, meta = load_export(out)
    assert meta["zero_stage"] == stage
    ref = load_file(str(run / "reference_logits.safetensors"))
    with torch.no_grad():
        logits = model(ref["ids"])
    assert torch.allclose(logits, ref["logits"], atol=0.1, rtol=0.05), (logits - ref["logits"]).abs().max()
    if stage >= 1:  # master weights carry more than bf16's 8 significant bits
        weight = model.tok_emb.weight.detach()
        assert not torch.equal(weight, weight.bfloat16().float())


@pytest.mark.slow
def test_checkpoint_loading_is_weights_only(ds_checkpoints, monkeypatch):
    """DeepSpeed's consolidation runs with every torch.load forced to weights_only=True."""
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    for stage in (0, 3):
        load_model(ds_checkpoints / "w2" / f"zero{stage}")
    assert calls and all(w is True for w in calls), calls


@pytest.mark.slow
def test_malicious_pickle_is_refused(tmp_path, ds_checkpoints):
    """A checkpoint file whose pickle would run code is refused, and the code never runs."""
    import hashlib
    import os

    from lmsys.engine.checkpoint import MARKER

    run = tmp_path / "evil"
    shutil.copytree(ds_checkpoints / "w2" / "zero2", run)
    tag = run / "checkpoints" / "step_0000002"
    flag = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {flag}",))

    victim = tag / "mp_rank_00_model_states.pt"
    state = torch.load(victim, weights_only=False)  # our own file, written by the fixture
    state["lr_scheduler"] = Evil()
    torch.save(state, victim)
    marker = json.loads((tag / MARKER).read_text())  # re-sign it so only the loader can object
    data = victim.read_bytes()
    marker["files"][victim.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (tag / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="refuses to load"):
        export_checkpoint(run, tmp_path / "out")
    assert not flag.exists()
    assert not (tmp_path / "out").exists()
