"""`python -m tools.bench train`'s GPU path builds its config and imports, without a GPU. The
benchmark end to end: tests/integration/tools/test_train_bench.py."""

from __future__ import annotations


def test_gpu_path_builds_its_config_and_imports():
    """The CUDA path (gpt2_124m, T=1024, bf16, compile + SDPA) cannot run here; check that its
    configuration composes and its code imports."""
    from lmsys.core.config import compose
    from lmsys.core.runtime import split_batch
    from tools.bench.train import GPU_DEFAULTS, PlainLoop  # noqa: F401

    cfg = compose(GPU_DEFAULTS)
    plan = split_batch(cfg, 1)
    assert cfg.model.name == "gpt2_124m" and plan.seq_len == 1024 and plan.grad_accum == 1
