"""kernels/runtime.py: the interpreter switch, the launching GPU and the one pruning rule every
kernel's tiling goes through. In process; nothing compiles."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import triton

from kernels import runtime
from tests.conftest import DEVICE


@pytest.mark.parametrize(
    "value,requested",
    [("1", True), ("true", True), (" On ", True), ("yes", True), ("0", False), ("", False), ("off", False)],
)
def test_interpreter_requested_reads_the_variable_as_triton_does(value, requested):
    assert runtime.interpreter_requested({"TRITON_INTERPRET": value}) is requested
    assert not runtime.interpreter_requested({})


def test_compiler_environment_drops_only_the_request():
    env = runtime.compiler_environment({"TRITON_INTERPRET": "1", "PATH": "/bin", "HOME": "/h"})
    assert env == {"PATH": "/bin", "HOME": "/h"}
    assert not runtime.interpreter_requested(env)


def test_this_session_runs_as_conftest_chose():
    assert runtime.interpreting() is (DEVICE == "cpu")
    assert runtime.triton_mode() == ("interpreter" if DEVICE == "cpu" else "compiled")


def test_importing_the_runtime_imports_no_triton():
    """lmsys reads the switch before it decides to set it: that must not import triton."""
    code = "import sys, kernels.runtime as r; print('triton' in sys.modules, r.triton_mode())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "None"]


def test_device_limits_off_cuda_are_none():
    assert runtime.device_limits("cpu") is None and runtime.device_limits(torch.device("meta")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device's limits")
def test_device_limits_of_this_gpu():
    limits = runtime.device_limits("cuda")
    major, minor = torch.cuda.get_device_capability()
    assert (
        limits.capability == 10 * major + minor and limits.sm_count > 0 and limits.smem_per_block > 48 * 1024
    )


GPU = runtime.DeviceLimits(capability=90, sm_count=132, smem_per_block=100)


def _config(name: int, smem: int, warps: int = 4) -> triton.Config:
    return triton.Config({"SIZE": name, "SMEM": smem}, num_warps=warps)


def _names(configs) -> list[int]:
    return [c.kwargs["SIZE"] for c in configs]


def _smem(config: triton.Config) -> int:
    return config.kwargs["SMEM"]


def test_prune_keeps_what_fits_in_order():
    configs = [_config(1, 120), _config(2, 100), _config(3, 50), _config(4, 10, warps=64)]
    assert _names(runtime.prune_configs(configs, GPU, _smem)) == [2, 3]  # 4: 2048 threads


def test_prune_prefers_and_never_returns_nothing():
    configs = [_config(1, 90), _config(2, 60), _config(3, 200), _config(4, 150)]
    assert _names(runtime.prune_configs(configs, GPU, _smem, prefer=lambda c: c.kwargs["SIZE"] == 2)) == [2]
    assert _names(runtime.prune_configs(configs, GPU, _smem, prefer=lambda c: False)) == [1, 2]
    assert _names(runtime.prune_configs(configs[2:], GPU, _smem)) == [4]  # the least shared memory


def test_prune_under_deterministic_algorithms_keeps_the_first():
    configs = [_config(1, 90), _config(2, 60)]
    torch.use_deterministic_algorithms(True)
    try:
        assert _names(runtime.prune_configs(configs, GPU, _smem)) == [1]
    finally:
        torch.use_deterministic_algorithms(False)


def test_config_from_a_fixed_tiling():
    config = runtime.config({"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8})
    assert config.kwargs == {"BLOCK_M": 64, "BLOCK_N": 32} and (config.num_warps, config.num_stages) == (8, 3)
    assert runtime.config({"BLOCK_V": 2048}).num_warps == 4  # Triton's defaults for a launch


def test_a_fixed_launch_keeps_its_one_config():
    launch = runtime.KernelLaunch("k", None, (1,), (), {}, configs=[_config(1, 10**9)])
    assert _names(launch.kept(GPU)) == [1]
