"""lmsys-export of real DeepSpeed checkpoints of every ZeRO stage (tests/integration/export/conftest.py):
the trained model's logits, bf16 training's fp32 master weights, and checkpoint loading that never
unpickles code."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from lmsys.core.errors import CheckpointError
from lmsys.interop.export_dir import export_checkpoint, load_export, load_model
from tests.unit.interop.test_export import _keys


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
