"""The static inspection of the kernels for sm_80 / sm_90 (`python -m kernels.inspect`), the resource
tables the autotune pruners trust, and the analysis pieces they rest on.

The CI subset compiles every kernel for both targets in a subprocess: this test process runs with
TRITON_INTERPRET=1 (tests/conftest.py), under which `@triton.jit` builds interpreted functions
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
import triton

from kernels import resource_tables
from kernels.inspect import aot
from tests import background

REPO_ROOT = Path(__file__).resolve().parents[2]
FA = importlib.import_module("kernels.flash_attention")

# The Triton tutorial's fused-attention forward (06-fused-attention.py, TMA variant), compiled for
# sm_90 at 128 x 128, 8 warps, 2 stages, head dim 128, causal: SASS instructions per warp in its
# steady-state loop, measured with the same loop detection (kernels/README.md).
TUTORIAL_LOOP_INSTRUCTIONS = 523

# The CI subset: every kernel, head dims 64 and 128, widths 768, 1600 and 8192 (plus 16384, the
# only width that runs the backward's row-sums kernel), both targets, the causal mask (every
# preset's; the full mask was a third of the compile time: `make inspect` compiles it, the tables
# list it, test_table_is_current_and_complete), the load path each target takes; the linear
# cross-entropy's training launches at gpt2_124m's shape.
SUBSET_ARGS = [
    "--arch", "80,90", "--dtype", "bf16", "--head-dims", "64,128", "--masks", "causal",
    "--loads", "auto", "--widths", "768,1600,8192,16384", "--lce-widths", "768", "--lce-variants", "train",
]  # fmt: skip
LCE_GEMMS = {"lce_fwd", "lce_bwd_dh", "lce_bwd_dw"}
ALL_KERNELS = {
    "attn_fwd", "attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq",
    "ln_fwd", "ln_fwd_residual", "ln_bwd", "ln_bwd_residual", "ln_bwd_row_sums",
    "lce_lse", *LCE_GEMMS,
}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The CI subset, compiled once per session in a subprocess without the interpreter
# ----------------------------------------------------------------------------------------------


def subset_command(out: Path) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = [sys.executable, "-m", "kernels.inspect", *SUBSET_ARGS, "--json", str(out / "report.json")]
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
    assert "OK: every kept config compiles without spills and launches" in proc.stdout
    for arch in ("sm_80", "sm_90"):
        assert {r["kernel"] for r in rows if r["arch"] == arch} == ALL_KERNELS, arch
    for r in rows:
        assert "error" not in r, r
        assert r["spill_bytes"] == 0 and r["stack_bytes"] == 0 and r["launchable"], r
        assert r["kept"], r  # only configs the pruner keeps are compiled outside --update-table
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


def test_subset_agrees_with_the_checked_in_tables(subset):
    """Staleness: every tuned row compiled just now has the registers, spills and shared memory its
    table claims, and the tables come from the installed Triton."""
    _, rows = subset
    tuned = [r for r in rows if r["kernel"] in FA.KERNEL_NAMES.values()]
    assert tuned
    for r in tuned:
        table = resource_tables.load_table(int(r["arch"].removeprefix("sm_")))
        assert table is not None and table.triton_version == triton.__version__, r["arch"]
        measured = table.lookup(r["kernel"], r["dtype"], r["case"], r["config"])
        assert measured is not None, r
        got = (r["registers"], r["spill_bytes"], r["smem_bytes"], r["launchable"])
        assert got == (measured.registers, measured.spill_bytes, measured.smem_bytes, measured.launchable), r


# ----------------------------------------------------------------------------------------------
# The tables and the pruner (in process)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capability", sorted(aot.TARGETS))
def test_table_is_current_and_complete(capability):
    """A table from another Triton, or missing a config of the tuning lists or a case the inspector
    covers, fails here: regenerate with `python -m kernels.inspect --update-table`."""
    table = resource_tables.load_table(capability)
    assert table is not None, resource_tables.table_path(capability)
    assert table.triton_version == triton.__version__
    loads = ("tma", "ptr") if capability >= FA.TMA_MIN_CAPABILITY else ("ptr",)
    for kind, configs in FA.CONFIGS.items():
        kernel = FA.KERNEL_NAMES[kind]
        for dtype in ("bf16", "fp16"):
            for d_qk, d_vo in _inspect_module().HEAD_DIMS:
                for causal in (True, False):
                    for path in loads:
                        case = resource_tables.case_key(d_qk, d_vo, causal, path)
                        for bm, bn, w, s in configs:
                            config = resource_tables.config_key(bm, bn, w, s)
                            assert table.lookup(kernel, dtype, case, config) is not None, (
                                kernel,
                                dtype,
                                case,
                                config,
                            )


def _inspect_module():
    # the inspector only imports here; it compiles nothing at import.
    import kernels.inspect.inspector

    return kernels.inspect.inspector


def _table_cases(capability: int):
    """(kind, dtype, d_qk, d_vo, causal, loads) of every case in a table."""
    table = resource_tables.load_table(capability)
    names = {v: k for k, v in FA.KERNEL_NAMES.items()}
    seen = set()
    for kernel, dtype, case, _ in table.rows:
        m = re.fullmatch(r"dqk(\d+)-dvo(\d+)-(causal|full)-(tma|ptr)", case)
        seen.add((names[kernel], dtype, int(m[1]), int(m[2]), m[3] == "causal", m[4]))
    return sorted(seen)


class _Meta:
    """What the pruner reads from Q: dtype, element size, device."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.device = dtype, torch.device("cuda", 0)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _prune_args(kind, dtype, d_qk, d_vo, causal, loads, t_bucket=1024):
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    flag = "QDO_TMA" if kind == "dkdv" else "KV_TMA"
    return {
        "Q": _Meta(torch_dtype),
        "T_BUCKET": t_bucket,
        "CAUSAL": causal,
        flag: loads == "tma",
        **FA._head_meta(d_qk, d_vo, torch_dtype),
    }


@pytest.mark.parametrize("capability", sorted(aot.TARGETS))
def test_pruner_keeps_exactly_what_the_table_measured_to_fit(capability):
    table = resource_tables.load_table(capability)
    target = aot.TARGETS[capability]
    dropped_for_spills = 0
    for kind, dtype, d_qk, d_vo, causal, loads in _table_cases(capability):
        configs = FA._tuning_configs(kind, loads == "tma")
        args = _prune_args(kind, dtype, d_qk, d_vo, causal, loads)
        kept = FA.prune_configs(kind, configs, args, capability, target.smem_per_block)
        case = resource_tables.case_key(d_qk, d_vo, causal, loads)
        fits = [
            c
            for c in configs
            if table.lookup(
                FA.KERNEL_NAMES[kind],
                dtype,
                case,
                resource_tables.config_key(
                    c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages
                ),
            ).fits
        ]
        assert fits, f"no config fits {kind} {dtype} {case} on {target.name}"
        assert kept == fits, (kind, dtype, case)
        dropped_for_spills += len(configs) - len(fits)
    assert dropped_for_spills > 0  # the table does drop configs (d = 256 spills everywhere)


# The spilling configs the issue found on the H100 target (bf16): (kernel, head dim, config).
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
    """Each is either gone from the tuning candidates or dropped by the pruner on sm_90."""
    configs = FA._tuning_configs(kind, loads == "tma")
    args = _prune_args(kind, "bf16", d, d, True, loads)
    kept = FA.prune_configs(kind, configs, args, 90, aot.SM90.smem_per_block)
    as_tuple = lambda c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
    assert config not in [as_tuple(c) for c in kept]


def _rows_everywhere(kind, dtype, d, loads, cfg):
    """The rows of every checked-in table for this config at head width d (causal)."""
    key = resource_tables.config_key(
        cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages
    )
    case = resource_tables.case_key(d, d, True, loads)
    return [
        resource_tables.load_table(c).lookup(FA.KERNEL_NAMES[kind], dtype, case, key)
        for c in sorted(aot.TARGETS)
    ]


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_without_a_table_keeps_what_fits_on_every_measured_target(kind, d):
    """sm_89 (no table, 99 KiB per CTA): a config is kept only if it fits in every table and its
    largest measured shared memory fits the device."""
    configs = FA._tuning_configs(kind, False)
    args = _prune_args(kind, "bf16", d, d, True, "ptr")
    expect = []
    for c in configs:
        rows = _rows_everywhere(kind, "bf16", d, "ptr", c)
        if all(m.fits for m in rows) and max(m.smem_bytes for m in rows) <= 99 * 1024:
            expect.append(c)
    kept = FA.prune_configs(kind, configs, args, 89, 99 * 1024)
    assert kept == expect if expect else len(kept) == 1  # nothing fits: the last resort alone


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
def test_tables_of_another_triton_are_not_trusted_as_exact(monkeypatch, kind):
    configs = FA._tuning_configs(kind, True)
    args = _prune_args(kind, "bf16", 128, 128, True, "tma")
    assert FA.measured(kind, args, configs[0], 90) is not None
    monkeypatch.setattr(triton, "__version__", "0.0.0")
    assert FA.measured(kind, args, configs[0], 90) is None
    for c in FA.prune_configs(kind, configs, args, 90, aot.SM90.smem_per_block):
        assert all(m.fits for m in _rows_everywhere(kind, "bf16", 128, "tma", c) if m is not None), c


def test_nothing_measured_uses_the_tile_estimate():
    """fp32 (never tabled) and a head-width pair no table has fall back to `_estimate_fits`."""
    configs = FA._tuning_configs("fwd", False)
    for dtype, d_qk, d_vo in ((torch.float32, 64, 64), (torch.float16, 32, 256)):
        args = {"Q": _Meta(dtype), "T_BUCKET": 4096, "CAUSAL": True, **FA._head_meta(d_qk, d_vo, dtype)}
        assert FA.measured_anywhere("fwd", args, configs[0]) == []
        elem = torch.empty((), dtype=dtype).element_size()
        pool = [c for c in configs if elem == 2 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 32]
        expect = [c for c in pool if FA._estimate_fits("fwd", c, args, elem, aot.SM90.smem_per_block)]
        assert FA.prune_configs("fwd", configs, args, 90, aot.SM90.smem_per_block) == expect


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
