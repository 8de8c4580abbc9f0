"""The zero_to_fp32.py of a run's checkpoints/ folder (lmsys/engine/zero_to_fp32.py, written over
DeepSpeed's copy at every commit), run as a user runs it, on real 2-rank ZeRO-2 and ZeRO-3
checkpoints of the tiny preset, whose embedding and unembedding are one tensor: with its flags
(--safe_serialization, --max_shard_size, --tag) it writes every weight lmsys itself consolidates,
and DeepSpeed's zero_to_torch.py beside it works through it (--dtype bf16)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from lmsys.engine.checkpoint import RECOVERY_SCRIPT, resolve
from lmsys.engine.zero import consolidated_state_dict
from lmsys.engine.zero_to_fp32 import safe_torch_load
from tests.fixtures.exports import child_env, run_side_by_side


def _tied(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of `state` whose storage an earlier name already holds."""
    seen, shared = set(), []
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        shared += [name] if ptr in seen else []
        seen.add(ptr)
    return shared


def _read(out, safe: bool) -> dict[str, torch.Tensor]:
    """The state dict a conversion wrote into `out`: one file, or the shards of its index."""
    index = out / ("model.safetensors.index.json" if safe else "pytorch_model.bin.index.json")
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else None
    files = files or ["model.safetensors" if safe else "pytorch_model.bin"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(out / name) if safe else safe_torch_load(out / name))
    return state


@pytest.fixture(scope="module")
def conversions(ds_checkpoints, tmp_path_factory):
    """Each checkpoints/ folder's scripts, run as a user runs them (`python zero_to_fp32.py DIR OUT`)."""
    root = tmp_path_factory.mktemp("zero_to_fp32")
    calls = {}
    for stage in (2, 3):
        folder = ds_checkpoints / "w2" / f"zero{stage}" / "checkpoints"
        assert "lmsys" in (folder / RECOVERY_SCRIPT).read_text(encoding="utf-8")  # not DeepSpeed's copy
        script, torch_script, out = (
            str(folder / RECOVERY_SCRIPT),
            str(folder / "zero_to_torch.py"),
            root / str(stage),
        )
        runs = {
            "safe": [script, str(folder), f"{out}-safe", "--safe_serialization"],
            "sharded": [script, str(folder), f"{out}-sharded", "--safe_serialization",
                        "--max_shard_size", "50KB", "--tag", "step_0000002"],
            "pickle": [script, str(folder), f"{out}-pickle"],
            "bf16": [torch_script, str(folder), f"{out}-bf16", "--dtype", "bf16", "--safe_serialization"],
        }  # fmt: skip
        for kind, argv in runs.items():
            calls[(stage, kind)] = ([sys.executable, *argv], child_env())
    results = run_side_by_side(calls, parallel=4, timeout=300)
    for key, proc in results.items():
        assert proc.returncode == 0, f"{key}: {proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return root


@pytest.mark.parametrize("stage", [2, 3])
def test_the_checkpoint_folders_script_works_on_a_tied_model(ds_checkpoints, conversions, stage):
    tag = ds_checkpoints / "w2" / f"zero{stage}" / "checkpoints" / "step_0000002"
    want = consolidated_state_dict(tag, resolve(tag).state.zero_stage)
    assert _tied(want), "the tiny preset ties its embedding and unembedding"
    for kind in ("safe", "sharded", "pickle"):
        got = _read(conversions / f"{stage}-{kind}", safe=kind != "pickle")
        assert got.keys() == want.keys(), kind
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (kind, name)
    assert len(list((conversions / f"{stage}-sharded").glob("model-*.safetensors"))) > 1
    assert _tied(_read(conversions / f"{stage}-pickle", safe=False))  # torch.save keeps the tie
    bf16 = load_file(conversions / f"{stage}-bf16" / "model.safetensors")
    assert bf16.keys() == want.keys() and all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(bf16[name], tensor.to(torch.bfloat16)) for name, tensor in want.items())
