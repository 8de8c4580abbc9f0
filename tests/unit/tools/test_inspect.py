"""The static inspection of the kernels for sm_80 / sm_90 (`python -m tools.inspect`): the tiling
candidates the runtime keeps per target, and the analysis pieces the inspection rests on. The
compilation itself: tests/integration/tools/test_inspect_subset.py.
"""

from __future__ import annotations

import importlib
import itertools
from pathlib import Path

import pytest
import torch

from kernels import runtime
from tools.inspect import aot, candidates, inspector

REPO_ROOT = Path(__file__).resolve().parents[3]
FA = importlib.import_module("kernels.flash_attention")
LCE = importlib.import_module("kernels.linear_cross_entropy")

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


@pytest.mark.parametrize("target", sorted(aot.TARGETS))
def test_grouped_heads_leave_out_the_dkdv_tiles_that_spill_with_them(target):
    """At head width 128 a grouped dK/dV program (GROUP query heads in a loop) spills in tiles the
    plain one does not; the pruner drops them for grouped launches only and keeps a spill-free one
    with 128 keys on sm_90."""
    configs = FA._tuning_configs("dkdv", target >= FA.TMA_MIN_CAPABILITY)
    limits = aot.TARGETS[target].limits
    plain_args = _prune_args("dkdv", torch.bfloat16, 128, 128)
    plain = _tiles(FA.prune_configs("dkdv", configs, plain_args, limits))
    grouped = _tiles(FA.prune_configs("dkdv", configs, {**plain_args, "GROUP": 4}, limits))
    dropped = FA._VARIANT_SPILLS["grouped"]["dkdv"][128][target]
    assert set(plain) & dropped and not set(grouped) & dropped
    assert grouped == [t for t in plain if t not in dropped]
    if target >= 90:
        assert (16, 128, 8, 3) in grouped


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
def test_every_variant_keeps_a_tile_of_its_own_list(kind):
    """No table of spilling tiles empties a list (listed_configs would fall back to the spilling
    ones), and every tile it names is one the list has: a stale entry would drop nothing."""
    for width, generation in itertools.product((64, 128, 256), FA.GENERATIONS):
        plain = FA.listed_configs(kind, width, generation)
        tables = FA._VARIANT_SPILLS.values()
        spills = [table.get(kind, {}).get(width, {}).get(generation, set()) for table in tables]
        assert all(tiles <= set(plain) for tiles in spills), (kind, width, generation)
        both = FA.listed_configs(kind, width, generation, grouped=True, documents=True)
        assert both and not set(both) & set().union(*spills), (kind, width, generation)


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


def test_every_row_key_is_a_file_name():
    """--dump names each cubin after its row's key, so no part of a key may hold a path separator."""
    args = inspector.parse_args(["--rope-head-dims", "64,128", "--attn-variants", "plain,gqa-docs"])
    tasks = inspector.build_tasks(inspector.build_cases(args), wider=False, dump_dir=None)
    assert {t.case.family for t in tasks} >= {"attn", "ln", "rms", "rope", "glu", "lce"}
    for task in tasks:
        launch = next(lc for lc in inspector.case_launches(task.case) if lc.name == task.kernel)
        name = inspector.case_name(task.case, launch)
        assert "/" not in name and "/" not in str(dict(task.config)), (task.kernel, name)
