"""The static inspection of the kernels for sm_80 / sm_90 (`python -m tools.inspect`), the tiling
candidates the runtime keeps per target, and the analysis pieces they rest on.

The CI subset compiles every kernel for both targets in a subprocess: this test process runs with
the Triton interpreter (tests/conftest.py), under which `@triton.jit` builds interpreted functions
that cannot be compiled for a GPU. Nothing here times anything: registers, spills, shared memory
and SASS are properties of the binaries.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import runtime
from tests import background
from tools.inspect import aot, candidates

REPO_ROOT = Path(__file__).resolve().parents[2]
FA = importlib.import_module("kernels.flash_attention")
LCE = importlib.import_module("kernels.linear_cross_entropy")

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


# ----------------------------------------------------------------------------------------------
# The CI subset, compiled once per session in a subprocess without the interpreter
# ----------------------------------------------------------------------------------------------


def subset_command(out: Path) -> tuple[list[str], dict[str, str]]:
    env = runtime.compiler_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = [sys.executable, "-m", "tools.inspect", *SUBSET_ARGS, "--json", str(out / "report.json")]
    return [*argv, "--dump", str(out / "cubins")], env


# About two minutes of ptxas on 2 cores, independent of every other test: it starts when
# collection ends, on the cores the other tests leave idle (tests/background.py).
BACKGROUND_JOBS = {"subset": subset_command}


@pytest.fixture(scope="module")
def subset():
    done = background.result("subset", subset_command, timeout=900)
    print(f"\nCI inspection subset: {done.seconds:.0f} s, beside the other tests")  # -s shows it; not a check
    report = done.out / "report.json"
    rows = json.loads(report.read_text())["rows"] if report.exists() else []
    return done.proc, rows


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


def test_grouped_and_packed_attention_compile_for_both_targets(subset):
    """Grouped-query heads with packed documents: every listed tiling of the three attention
    kernels at both head widths, on both targets, beside the plain ones."""
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
            assert packed == plain and {d for d, _ in packed} == {64, 128}, (kernel, arch)
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


# ----------------------------------------------------------------------------------------------
# The candidates the runtime keeps (in process)
# ----------------------------------------------------------------------------------------------


class _Meta:
    """What the pruner reads from Q: dtype and element size."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _prune_args(kind, dtype, d_qk, d_vo, loads="tma", t_bucket=1024):
    flag = "QDO_TMA" if kind == "dkdv" else "KV_TMA"
    meta = FA._head_meta(d_qk, d_vo, dtype)
    return {"Q": _Meta(dtype), "T_BUCKET": t_bucket, "CAUSAL": True, flag: loads == "tma", **meta}


def _tiles(configs) -> list[tuple]:
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs]


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
def test_wide_head_lists_keep_the_candidates_order(kind):
    """Every list is a subset of the candidates, in their order of preference: under deterministic
    algorithms the first that fits is the one launched."""
    order = FA.CONFIGS[kind]
    for width, by_generation in FA._WIDE_HEADS[kind].items():
        assert width in (128, 256) and set(by_generation) == set(FA.GENERATIONS)
        for tiles in by_generation.values():
            assert tiles and tiles == sorted(tiles, key=order.index), (kind, width)


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("target", sorted(aot.TARGETS))
def test_model_family_widths_time_every_candidate(kind, target):
    """Head widths up to 64 (every preset's): nothing is dropped on sm_80 or sm_90."""
    configs = FA._tuning_configs(kind, target >= FA.TMA_MIN_CAPABILITY)
    for d in (16, 32, 48, 64):
        args = _prune_args(kind, torch.bfloat16, d, d)
        assert FA.prune_configs(kind, configs, args, aot.TARGETS[target].limits) == configs, (kind, d)


DEVICES = [
    aot.SM80.limits,
    aot.SM90.limits,
    runtime.DeviceLimits(capability=89, sm_count=128, smem_per_block=99 * 1024),
    runtime.DeviceLimits(capability=100, sm_count=148, smem_per_block=227 * 1024),
]


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("d_qk,d_vo", [(128, 128), (64, 128), (96, 40), (256, 256), (200, 64)])
@pytest.mark.parametrize("device", DEVICES, ids=lambda d: f"sm_{d.capability}")
def test_wider_heads_take_their_generations_list(kind, d_qk, d_vo, device):
    """The list of the padded width and the device's generation, less what does not fit its shared
    memory: sm_80 and sm_89 (99 KiB) take the sm_80 list, sm_90 and later the sm_90 one."""
    configs = FA._tuning_configs(kind, False)
    args = _prune_args(kind, torch.float16, d_qk, d_vo, loads="ptr")
    width = max(args["BLOCK_DQK"], args["BLOCK_DVO"])
    listed = FA._WIDE_HEADS[kind][width][90 if device.capability >= 90 else 80]
    fits = [t for t in listed if FA._shared_bytes(kind, t[0], t[1], t[3], args, 2) <= device.smem_per_block]
    kept = _tiles(FA.prune_configs(kind, configs, args, device))
    assert kept == fits if fits else len(kept) == 1 and kept[0] in listed


# The spilling configs the inspection found on the H100 target (bf16): (kernel, head dim, config).
ISSUE_SPILLS = [
    ("fwd", 128, (128, 64, 4, 3)),
    ("dkdv", 128, (64, 128, 8, 2)),
    ("dkdv", 128, (64, 64, 4, 2)),
    ("dkdv", 64, (32, 128, 4, 3)),
    ("dq", 128, (32, 64, 4, 3)),
]


@pytest.mark.parametrize("kind,d,config", ISSUE_SPILLS)
@pytest.mark.parametrize("loads", ["tma", "ptr"])
def test_issue_spills_are_not_timed_on_sm90(kind, d, config, loads):
    """Each is either gone from the tuning candidates or not listed for its head width on sm_90."""
    configs = FA._tuning_configs(kind, loads == "tma")
    kept = FA.prune_configs(kind, configs, _prune_args(kind, torch.bfloat16, d, d, loads), aot.SM90.limits)
    assert config not in _tiles(kept)


def _row(kernel, config, tiling, ok=True, d=64, listed=True):
    return {
        "kernel": kernel, "arch": "sm_90", "config": config, "tiling": tiling, "listed": listed,
        "d_qk": d, "d_vo": d, "spill_bytes": 0 if ok else 8, "stack_bytes": 0, "launchable": True,
    }  # fmt: skip


def test_candidates_report_lists_what_passes_in_every_case():
    """A candidate passes its class only if every case of it compiled clean; the report writes the
    passing ones as the kernels' lists do, in the order they were compiled."""
    a = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 4}
    b = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    lse = {"BLOCK_V": 2048, "num_warps": 8, "num_stages": 3}
    rows = [
        _row("attn_fwd", "64x32-w4-s4", a, d=128),
        _row("attn_fwd", "128x64-w8-s3", b, d=128),
        _row("attn_fwd", "128x64-w8-s3", b, ok=False, d=96, listed=False),  # the same class: 128
        _row("attn_fwd", "128x64-w8-s3", b, d=64),
        _row("lce_lse", "2048-w8-s3", lse),
        _row("ln_fwd", "4x1024-w8-s3", {"BLOCK_M": 4, "BLOCK_N": 1024, "num_warps": 8, "num_stages": 3}),
    ]
    lines = candidates.report(rows).splitlines()[1:]
    assert lines == [
        "  attn_fwd head width 128 sm_90: [(64, 32, 4, 4)]",
        "  attn_fwd head width <= 64 sm_90: [(128, 64, 8, 3)]",
        '  lce_lse 16-bit sm_90: [{"BLOCK_V": 2048, "num_warps": 8, "num_stages": 3}]',
    ]


def test_wider_sets_start_with_every_listed_candidate():
    """--candidates compiles the lists themselves, then their neighbours."""
    for kind, name in FA.KERNEL_NAMES.items():
        launch = runtime.KernelLaunch(name, FA._attn_fwd_kernel, (1,), (), {})
        assert _tiles(candidates.wider_set(launch, "bf16"))[: len(FA.CONFIGS[kind])] == FA.CONFIGS[kind]
    for name in LCE.KERNEL_NAMES:
        launch = runtime.KernelLaunch(name, None, (1,), (), {})
        wider = [c.all_kwargs() for c in candidates.wider_set(launch, "fp16")]
        listed = [runtime.config(t).all_kwargs() for t in LCE.CONFIGS["16-bit"][name]]
        assert wider[: len(listed)] == listed, name


# ----------------------------------------------------------------------------------------------
# The analysis pieces
# ----------------------------------------------------------------------------------------------

PTXAS_LOG = """
ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_attn_fwd_kernel' for 'sm_90a'
ptxas info    : Function properties for _attn_fwd_kernel
    288 bytes stack frame, 388 bytes spill stores, 836 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
"""


def test_parse_ptxas_log():
    usage = aot.parse_ptxas_log(PTXAS_LOG)
    assert (usage.registers, usage.stack_bytes, usage.spill_bytes) == (255, 288, 388 + 836)
    with pytest.raises(ValueError):
        aot.parse_ptxas_log("ptxas info : nothing")


def test_occupancy_rules():
    # 197 registers x 8 warps: 6400 registers per warp, two such warps per sub-partition: one CTA.
    occ = aot.occupancy(aot.SM90, 197, 164864, 8)
    assert (occ.ctas_per_sm, occ.launchable) == (1, True) and set(occ.limiters) == {"registers", "smem"}
    # 1024 threads fit at 64 registers each and not at 65 (the per-warp allocation rounds to 2304).
    assert aot.occupancy(aot.SM90, 64, 0, 32).launchable
    assert not aot.occupancy(aot.SM90, 65, 0, 32).launchable
    # Shared memory beyond the per-CTA maximum: no launch (163 KiB on sm_80, 227 KiB on sm_90).
    assert not aot.occupancy(aot.SM80, 128, 164 * 1024, 4).launchable
    assert aot.occupancy(aot.SM90, 128, 164 * 1024, 4).launchable
    # Small kernels: bounded by the 64 warps of an SM.
    occ = aot.occupancy(aot.SM80, 32, 0, 4)
    assert (occ.ctas_per_sm, occ.warps_per_sm, occ.limiters) == (16, 64, ("registers", "warps"))


def _ins(address: int, opcode: str, operands: str = "") -> aot.Instruction:
    return aot.Instruction(address, opcode, "", operands)


def test_innermost_loops_by_back_edges():
    """A loop of 10 instructions nested in another, a 2-instruction spin-wait (not a loop of the
    kernel) and a jump back from an out-of-line block placed after EXIT (neither)."""
    body = [_ins(16 * i, "FFMA") for i in range(40)]
    body[5] = _ins(16 * 5, "HMMA")
    body[14] = _ins(16 * 14, "BRA", "`(.L_x_1)")  # back to address 16 * 5: the inner loop
    body[20] = _ins(16 * 20, "BRA", "`(.L_x_0)")  # back to 16 * 2: the outer loop
    body[23] = _ins(16 * 23, "BRA", "`(.L_x_2)")  # spin-wait back to 16 * 22
    body[30] = _ins(16 * 30, "EXIT")
    body[35] = _ins(16 * 35, "BRA", "`(.L_x_3)")  # back to 16 * 25, across the EXIT
    sass = aot.Sass(body, {".L_x_0": 16 * 2, ".L_x_1": 16 * 5, ".L_x_2": 16 * 22, ".L_x_3": 16 * 25})
    loops = aot.innermost_loops(sass)
    assert [(loop[0].address // 16, loop[-1].address // 16) for loop in loops] == [(5, 14)]
    assert aot.main_loop(loops) is loops[0] and aot.mma_kind(loops[0]) == "mma.sync"


def test_load_bytes_from_modifiers():
    ldg = [
        aot.Instruction(0, "LDG", ".E.128", ""),
        aot.Instruction(16, "LDG", ".E.U16", ""),
        aot.Instruction(32, "LDGSTS", ".E.BYPASS.128", ""),
        aot.Instruction(48, "LDS", ".128", ""),
    ]
    assert aot.ldg_bytes(ldg, num_warps=2) == (16 + 2 + 16) * 32 * 2
    assert aot.global_load_paths(ldg) == ["cp.async", "ldg"]
