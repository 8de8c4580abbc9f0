"""A CPU launch promises no DeepSpeed op to build (lmsys/engine/quiet.py). A failing sweep job and
the rest of DeepSpeed's noise in a real multirun: tests/integration/training/test_sweep_failure.py."""

from __future__ import annotations

import torch

from lmsys.engine.quiet import ops_to_build


def test_a_cpu_launch_builds_no_deepspeed_op(tmp_path, monkeypatch):
    """DeepSpeed's CPU shared-memory collectives (a C++ op it JIT-builds at init_distributed, about
    100 CPU-seconds once per machine) are marked unavailable: DeepSpeed neither builds nor loads
    them, and the start line promises no build."""
    from deepspeed.comm.torch import build_shm_op

    from lmsys.engine.quiet import skip_cpu_collectives_op

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # a build would land here
    skip_cpu_collectives_op()
    assert build_shm_op() is None
    assert not ops_to_build(torch.device("cpu"))
    assert list(tmp_path.iterdir()) == []
