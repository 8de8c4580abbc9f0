"""format=hf of a real ZeRO-3 checkpoint: a directory that transformers' GPT2LMHeadModel loads, with
the engine's logits."""

from __future__ import annotations

import pytest
import torch

from lmsys.interop.export_dir import export_checkpoint

# GPT-2's function at a shape no GPT-2 has: width 48 over 3 heads, d_ff not 4x, another eps.


@pytest.mark.slow
@torch.no_grad()
def test_hf_export_of_a_zero3_checkpoint(tmp_path, ds_checkpoints, gpt2_class):
    """ZeRO-3 on 2 processes -> DeepSpeed's consolidation -> transformers: the engine's logits."""
    from safetensors.torch import load_file

    run = ds_checkpoints / "w2" / "zero3"
    out = export_checkpoint(run, tmp_path / "hf", fmt="hf")
    ref = load_file(str(run / "reference_logits.safetensors"))
    hf = gpt2_class.from_pretrained(out).eval()
    torch.testing.assert_close(hf(ref["ids"]).logits, ref["logits"], atol=2e-5, rtol=1e-5)
    assert "model.safetensors" in {p.name for p in out.iterdir()}
