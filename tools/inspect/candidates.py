"""The wider tiling sets of `python -m tools.inspect --candidates`, and their report: which
candidates compile without spilling and launch in every case of a class, per kernel and target.

The kernels list their candidates beside them (kernels/flash_attention.py: every candidate at head
widths up to 64 and a subset per wider class and GPU generation; kernels/linear_cross_entropy.py:
one per kernel and input width). This mode compiles each listed candidate and the neighbours below
for every case, and prints the passing ones in the lists' own form, so a developer can update the
lists after a compiler upgrade or a kernel change. Layer norm derives its geometry from the row
width: it has no candidates here.
"""

from __future__ import annotations

import importlib
from collections import defaultdict

import triton

from kernels import runtime

fa = importlib.import_module("kernels.flash_attention")
lce = importlib.import_module("kernels.linear_cross_entropy")

# Attention neighbours of the listed candidates: (BLOCK_M, BLOCK_N, num_warps, num_stages). Each
# spilled at head width 128 on sm_90 (Triton 3.9) and left the lists; they show what a failing
# candidate looks like in the report.
_ATTENTION_NEIGHBOURS = {
    "fwd": [(128, 64, 4, 3), (64, 64, 4, 3)],
    "dkdv": [(64, 64, 4, 2), (32, 128, 4, 3)],
    "dq": [(32, 64, 4, 3)],
}
# The loss's 16-bit tiles with fewer pipeline stages and half the rows: for GPUs with less
# shared memory per program than sm_80 and sm_90.
_LCE_NEIGHBOURS = {
    "lce_fwd": [
        {"BLOCK_M": 128, "BLOCK_V": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_V": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    ],
    "lce_bwd_dh": [{"BLOCK_M": 128, "BLOCK_D": 128, "BLOCK_V": 64, "num_warps": 8, "num_stages": 2}],
    "lce_bwd_dw": [{"BLOCK_V": 128, "BLOCK_D": 128, "BLOCK_M": 64, "num_warps": 8, "num_stages": 2}],
}


def _attention_set(kind: str) -> list[triton.Config]:
    tiles = [*fa.CONFIGS[kind], *_ATTENTION_NEIGHBOURS[kind]]
    return [
        runtime.config({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s})
        for bm, bn, w, s in tiles
    ]


def wider_set(launch: runtime.KernelLaunch, dtype: str) -> list[triton.Config]:
    """The tilings `--candidates` compiles for a launch: its kernel's wider set, with the ones the
    runtime keeps for the launch first (a launch without a wider set: those alone)."""
    kinds = {name: kind for kind, name in fa.KERNEL_NAMES.items()}
    wider: list[triton.Config] = []
    if launch.name in kinds:
        wider = _attention_set(kinds[launch.name])
    elif launch.name in lce.KERNEL_NAMES and dtype in ("bf16", "fp16"):
        listed = lce.CONFIGS["16-bit"][launch.name] + _LCE_NEIGHBOURS.get(launch.name, [])
        wider = [runtime.config(t) for t in listed]
    return wider


def head_width_class(d_qk: int, d_vo: int) -> int:
    """The lists' key for a head-width pair: the wider padded width, 64 for anything up to 64."""
    return max(64, triton.next_power_of_2(max(d_qk, d_vo)))


def _group(row: dict) -> tuple[str, str, str] | None:
    """(kernel, class, target) of a row whose kernel has lists; None for the others."""
    if row["kernel"] in fa.KERNEL_NAMES.values():
        width = head_width_class(row["d_qk"], row["d_vo"])
        return row["kernel"], "head width <= 64" if width == 64 else f"head width {width}", row["arch"]
    if row["kernel"] in lce.KERNEL_NAMES:
        return row["kernel"], "16-bit", row["arch"]
    return None


def passes(row: dict) -> bool:
    return "error" not in row and row["spill_bytes"] == 0 and row["stack_bytes"] == 0 and row["launchable"]


def _literal(row: dict) -> str:
    """A row's tiling as the kernel's list writes it: a tuple for attention, a dict for the loss."""
    t = row["tiling"]
    if row["kernel"] in fa.KERNEL_NAMES.values():
        return f"({t['BLOCK_M']}, {t['BLOCK_N']}, {t['num_warps']}, {t['num_stages']})"
    return "{" + ", ".join(f'"{k}": {v}' for k, v in t.items()) + "}"


def report(rows: list[dict]) -> str:
    """Per kernel, class and target: the candidates that pass in every case, in the wider set's
    order."""
    order: dict[tuple, dict[str, dict]] = defaultdict(dict)  # group -> config name -> a row of it
    failed: dict[tuple, set[str]] = defaultdict(set)
    for row in rows:
        group = _group(row)
        if group is None:
            continue
        order[group].setdefault(row["config"], row)
        if not passes(row):
            failed[group].add(row["config"])
    lines = [
        "candidates that compile without spills and launch in every case of their class in this run "
        "(the kernels' lists need every case: the default --arch, --dtype, --head-dims, --masks, --loads):"
    ]
    for group in sorted(order):
        kernel, what, arch = group
        good = [_literal(row) for name, row in order[group].items() if name not in failed[group]]
        lines.append(f"  {kernel} {what} {arch}: [{', '.join(good)}]")
    return "\n".join(lines)
