"""The kernel self-check (lmsys/model/selfcheck.py) under the Triton CPU interpreter: the kernels
match their references at a model's widths; a kernel broken on purpose (debug.break_kernel)
is named with its error and tolerance, falls back to torch under model.kernels=auto and is an
error under model.kernels=triton."""

from __future__ import annotations

import pytest
import torch

from lmsys.core.config import compose
from lmsys.core.errors import TrainingError
from lmsys.model import ops
from lmsys.model.selfcheck import check_kernels, kernels_used, settle

TINY = ["model.vocab_size=512", "model.d_model=32", "model.n_heads=2", "model.max_seq_len=32"]


def test_a_broken_kernel_is_named_falls_back_under_auto_and_is_an_error_under_triton():
    model = compose([*TINY, "model.kernels=triton", "model.loss_impl=fused"]).model
    cpu = torch.device("cpu")
    assert kernels_used(model, cpu, torch.float32) == [
        "attention", "layer_norm", "add_layer_norm", "linear_cross_entropy"
    ]  # fmt: skip
    assert kernels_used(compose([*TINY, "model.kernels=auto"]).model, cpu, torch.float32) == []
    check = check_kernels(
        model, 32, cpu, torch.float32, break_kernel="layer_norm", kernels=["attention", "layer_norm"]
    )
    assert check.passed == ["attention"]
    (failure,) = check.failed
    assert failure.kernel == "layer_norm" and failure.error == "forward output differs by 1"
    assert failure.tolerance == 1e-4
    assert "layer_norm fell back to torch" in check.line() and "attention match torch" in check.line()

    with pytest.raises(TrainingError, match="kernel self-check failed: the Triton kernel layer_norm on cpu"):
        settle(check, "triton", warn=pytest.fail)
    warnings: list[str] = []
    x = torch.randn(4, 32)
    try:
        settle(check, "auto", warn=warnings.append)
        assert ops.use_triton(x, "triton", "layer_norm") is False  # its torch reference from now on
        assert ops.use_triton(x, "triton", "attention") is True
    finally:
        ops.reset_fallbacks()
    assert warnings == [
        "kernel self-check: the Triton kernel layer_norm on cpu (float32): forward output differs by 1 "
        "(tolerance 0.0001 of the largest value); it falls back to its torch reference for this run"
    ]


def test_the_llama_family_kernels_are_checked():
    """A Llama-family run with QK-norm and grouped-query attention checks the RMS norms, rotary
    and the gated activation too, attention with its grouped heads, and each matches."""
    model = compose(
        [
            "model=qwen3_0_6b", "model.vocab_size=64", "model.d_model=32", "model.n_heads=4",
            "model.attention.d_qk=16", "model.attention.d_vo=16", "model.attention.n_kv_heads=2",
            "model.ffn.d_ff=48", "model.max_seq_len=32", "model.kernels=triton", "model.loss_impl=chunked",
        ]
    ).model  # fmt: skip
    cpu = torch.device("cpu")
    names = kernels_used(model, cpu, torch.float32)
    assert names == ["attention", "rms_norm", "add_rms_norm", "rotary", "gated"]
    check = check_kernels(model, 17, cpu, torch.float32)
    assert check.passed == names and not check.failed, check.failed
    packed = check_kernels(model, 17, cpu, torch.float32, kernels=["attention"], documents=True)
    assert packed.passed == ["attention"] and not packed.failed, packed.failed
    broken = check_kernels(model, 17, cpu, torch.float32, "attention", ["attention"], documents=True)
    assert broken.failed[0].error == "forward output differs by 1"
