"""The CI subset of the static inspection (`python -m tools.inspect`): every kernel compiled for sm_80
and sm_90 without a GPU, in a subprocess, since this test process runs with the Triton interpreter
(tests/conftest.py), under which `@triton.jit` builds interpreted functions that cannot be compiled
for a GPU. Nothing here times anything: registers, spills, shared memory and SASS are properties of
the binaries. The tiling candidates and the analysis pieces: tests/unit/tools/test_inspect.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import runtime
from tests.unit.tools.test_inspect import FA, LCE, REPO_ROOT
from tools.inspect import aot

# The Triton tutorial's fused-attention forward (06-fused-attention.py, TMA variant), compiled for
# sm_90 at 128 x 128, 8 warps, 2 stages, head dim 128, causal: SASS instructions per warp in its
# steady-state loop, measured with the same loop detection (kernels/README.md).
TUTORIAL_LOOP_INSTRUCTIONS = 523

# The CI subset: every kernel, head dims 64 and 128, widths 768, 1600 and 8192 (plus 16384, the
# only width that runs the backward's row-sums kernel), both targets, the causal mask (every
# preset's; the full mask was a third of the compile time: `make inspect` compiles it), the load
# path each target takes; the linear cross-entropy's training launches at gpt2_124m's shape.
SUBSET_ARGS = [
    "--arch", "80,90", "--dtype", "bf16", "--head-dims", "64,128", "--masks", "causal",
    "--loads", "auto", "--widths", "768,1600,8192,16384", "--lce-widths", "768", "--lce-variants", "train",
    "--attn-variants", "plain,gqa-docs", "--rms-widths", "1024,16384", "--rope-head-dims", "128",
    "--glu-widths", "3072",
]  # fmt: skip
LCE_GEMMS = {"lce_fwd", "lce_bwd_dh", "lce_bwd_dw"}
ALL_KERNELS = {
    "attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq",
    "ln_fwd", "ln_fwd_residual", "ln_bwd", "ln_bwd_residual", "ln_bwd_row_sums",
    "rms_fwd", "rms_fwd_residual", "rms_bwd", "rms_bwd_residual", "rms_bwd_row_sums",
    "rope_fwd", "rope_bwd", "glu_fwd", "glu_bwd",
    "lce_lse", *LCE_GEMMS,
}  # fmt: skip


def subset_command(out: Path) -> tuple[list[str], dict[str, str]]:
    env = runtime.compiler_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = [sys.executable, "-m", "tools.inspect", *SUBSET_ARGS, "--json", str(out / "report.json")]
    return [*argv, "--dump", str(out / "cubins")], env


# About two minutes of ptxas on 2 cores, once for the module.
@pytest.fixture(scope="module")
def subset(tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect_subset")
    argv, env = subset_command(out)
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    report = out / "report.json"
    rows = json.loads(report.read_text())["rows"] if report.exists() else []
    return proc, rows


def test_subset_compiles_every_kernel_without_spills(subset):
    proc, rows = subset
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "OK: every listed config compiles without spills and launches" in proc.stdout
    for arch in ("sm_80", "sm_90"):
        assert {r["kernel"] for r in rows if r["arch"] == arch} == ALL_KERNELS, arch
    for r in rows:
        assert "error" not in r, r
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0 and r["launchable"], r
        assert r["listed"], r  # only the configs the runtime keeps are compiled outside --candidates
        for key in ("registers", "smem_bytes", "mma", "tma", "loop_instructions", "cubin", "config"):
            assert key in r, key
        assert (r["head_dim"] is None) != (r["width"] is None), r


def test_cubins_agree_with_cuobjdump(subset):
    """cuobjdump -res-usage of every dumped cubin: the reported registers, and no stack frame."""
    _, rows = subset
    assert rows
    cuobjdump = aot.NVIDIA_TOOLS / "cuobjdump"
    for r in rows:
        out = subprocess.run(
            [str(cuobjdump), "-res-usage", r["cubin"]], capture_output=True, text=True, check=True
        ).stdout
        line = next(line for line in out.splitlines() if "REG:" in line)
        assert int(re.search(r"REG:(\d+)", line)[1]) == r["registers"], (r["cubin"], line)
        assert int(re.search(r"STACK:(\d+)", line)[1]) == 0, (r["cubin"], line)
        assert Path(r["cubin"]).name.startswith(
            f"{r['kernel']}-{r['arch']}-{r['dtype']}-{r['case']}-{r['config']}"
        )


def test_target_paths_in_the_sass(subset):
    """sm_90 streams K/V (forward, dQ) and Q/dO (dK/dV) with TMA (UTMALDG) and multiplies with wgmma
    where a warpgroup tile exists (64+ rows); sm_80 uses cp.async (LDGSTS) and mma.sync."""
    _, rows = subset
    attention = [r for r in rows if r["kernel"] in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")]
    assert attention
    for r in attention:
        block_m, block_n, warps, _ = map(
            int, re.fullmatch(r"(\d+)x(\d+)-w(\d+)-s(\d+)", r["config"]).groups()
        )
        owned_rows = block_n if r["kernel"] == "attn_bwd_dkdv" else block_m  # the M of every dot
        if r["arch"] == "sm_90":
            assert r["tma"] and r["case"].endswith("-tma"), r
            if owned_rows >= 16 * warps:  # 64 rows per warpgroup of 4 warps
                assert r["mma"] == "wgmma", r
        else:
            assert not r["tma"] and "cp.async" in r["load_paths"] and r["mma"] == "mma.sync", r


def test_linear_cross_entropy_gemms_use_the_tensor_cores(subset):
    """The loss's three GEMM kernels multiply with wgmma on sm_90 and mma.sync on sm_80; the
    log-sum-exp pass is a plain memory-bound row kernel."""
    _, rows = subset
    lce = [r for r in rows if r["kernel"].startswith("lce_")]
    assert {r["case"] for r in lce} == {"d768-v50257"}
    for r in lce:
        if r["kernel"] in LCE_GEMMS:
            assert r["mma"] == ("wgmma" if r["arch"] == "sm_90" else "mma.sync"), r
            assert r["loop_instructions"], r  # the main loop over the reduction was found
        else:
            assert r["mma"] == "none", r


def test_forward_loop_at_or_below_the_tutorial(subset):
    _, rows = subset
    ref = [
        r
        for r in rows
        if (r["kernel"], r["arch"], r["case"], r["config"])
        == ("attn_fwd", "sm_90", "dqk128-dvo128-causal-tma", "128x128-w8-s2")
    ]
    assert ref, "the reference config should be kept at head dim 128 on sm_90"
    assert ref[0]["loop_instructions"] <= TUTORIAL_LOOP_INSTRUCTIONS, ref[0]


def test_layer_norm_backward_keeps_enough_loads_in_flight(subset):
    """At least twice what Little's law asks at peak bandwidth and 600 ns (static figures)."""
    _, rows = subset
    lnb = [r for r in rows if r["kernel"] in ("ln_bwd", "ln_bwd_residual")]
    assert {r["width"] for r in lnb} == {768, 1600, 8192, 16384}
    for r in lnb:
        target = next(t for t in aot.TARGETS.values() if t.name == r["arch"])
        assert r["in_flight_bytes_per_sm"] >= 2 * target.little_bytes_per_sm, r


def tiles_dropped_for_grouped_documents(kernel: str, head_width: int, arch: str) -> set[str]:
    """The config names flash attention leaves out of a launch with grouped heads and packed
    documents (they spill)."""
    kind = {name: kind for kind, name in FA.KERNEL_NAMES.items()}[kernel]
    capability = int(arch.removeprefix("sm_"))
    plain = set(FA.listed_configs(kind, head_width, capability))
    dropped = plain - set(FA.listed_configs(kind, head_width, capability, grouped=True, documents=True))
    return {f"{bm}x{bn}-w{w}-s{s}" for bm, bn, w, s in dropped}


def test_grouped_and_packed_attention_compile_for_both_targets(subset):
    """Grouped-query heads with packed documents: every listed tiling of the three attention
    kernels at both head widths, on both targets: the plain ones but those that spill with
    grouped heads or the documents' bounds in registers (flash_attention's table, read off the
    full inspection)."""
    _, rows = subset
    for arch in ("sm_80", "sm_90"):
        for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"):
            plain = {
                (r["d_qk"], r["config"])
                for r in rows
                if (r["kernel"], r["arch"]) == (kernel, arch) and not r["docs"]
            }
            packed = {
                (r["d_qk"], r["config"])
                for r in rows
                if (r["kernel"], r["arch"]) == (kernel, arch) and r["docs"]
            }
            spill = {(d, c) for d in (64, 128) for c in tiles_dropped_for_grouped_documents(kernel, d, arch)}
            assert packed == plain - spill and {d for d, _ in packed} == {64, 128}, (kernel, arch)
            assert all(r["group"] == 4 for r in rows if r["kernel"] == kernel and r["docs"])


def test_rms_norm_backward_keeps_enough_loads_in_flight(subset):
    """The RMS formula's backward, as the layer norm's: twice what Little's law asks."""
    _, rows = subset
    rms = [r for r in rows if r["kernel"] in ("rms_bwd", "rms_bwd_residual")]
    assert {r["width"] for r in rms} == {1024, 16384}
    for r in rms:
        target = next(t for t in aot.TARGETS.values() if t.name == r["arch"])
        assert r["in_flight_bytes_per_sm"] >= 2 * target.little_bytes_per_sm, r


def test_shared_memory_estimates_bound_what_the_compiler_allocates(subset):
    """The runtime prunes on estimates (kernels/runtime.py): every compiled attention and loss tiling
    needs at most its estimate, so a config the estimate keeps on a target also launches there."""
    _, rows = subset
    checked = 0
    for r in rows:
        t = r["tiling"]
        if r["kernel"] in FA.KERNEL_NAMES.values():
            kind = {v: k for k, v in FA.KERNEL_NAMES.items()}[r["kernel"]]
            meta = FA._head_meta(r["d_qk"], r["d_vo"], torch.bfloat16)
            estimate = FA._shared_bytes(kind, t["BLOCK_M"], t["BLOCK_N"], t["num_stages"], meta, 2)
        elif r["kernel"] in LCE.KERNEL_NAMES:
            estimate = LCE._shared_bytes(r["kernel"], torch.bfloat16)(runtime.config(t))
        else:
            continue
        assert r["smem_bytes"] <= estimate, (r["kernel"], r["arch"], r["case"], r["config"], estimate)
        checked += 1
    assert checked > 20
