"""Measured resource use of every tuning config, per GPU target: what the autotune pruners trust.

`kernels/targets/sm_80.json` and `sm_90.json` hold, for each tuned kernel, head widths, mask,
dtype, load path and config, the registers, spill bytes and shared memory that ptxas reported
when `python -m kernels.inspect --update-table` compiled it for that target, and whether a CTA
fits the target at all. Code generation changes with the compiler, so a table is only used with
the Triton version that produced it exactly; with any other version, or on a GPU without a table,
the pruner asks every table instead (see `flash_attention.prune_configs`).

Only the standard library is needed: the tables are read by every process that tunes a kernel.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

TABLE_DIR = Path(__file__).resolve().parent / "targets"


def table_path(capability: int) -> Path:
    return TABLE_DIR / f"sm_{capability}.json"


def case_key(d_qk: int, d_vo: int, causal: bool, loads: str) -> str:
    """'dqk64-dvo64-causal-tma': the shape-dependent part of an attention row's key."""
    return f"dqk{d_qk}-dvo{d_vo}-{'causal' if causal else 'full'}-{loads}"


def config_key(block_m: int, block_n: int, num_warps: int, num_stages: int) -> str:
    """'128x64-w4-s3': BLOCK_M x BLOCK_N, warps, pipeline stages."""
    return f"{block_m}x{block_n}-w{num_warps}-s{num_stages}"


@dataclass(frozen=True)
class Measured:
    registers: int
    spill_bytes: int
    smem_bytes: int
    launchable: bool

    @property
    def fits(self) -> bool:
        """Compiles without spilling and a CTA launches on the target."""
        return self.launchable and self.spill_bytes == 0


@dataclass(frozen=True)
class ResourceTable:
    target: str  # "sm_90"
    triton_version: str  # the Triton that compiled the rows
    rows: dict[tuple[str, str, str, str], Measured]  # (kernel, dtype, case, config) -> measurement
    cases: frozenset[tuple[str, str, str]]  # the (kernel, dtype, case) of the rows

    def lookup(self, kernel: str, dtype: str, case: str, config: str) -> Measured | None:
        return self.rows.get((kernel, dtype, case, config))

    def has_case(self, kernel: str, dtype: str, case: str) -> bool:
        return (kernel, dtype, case) in self.cases


def parse_table(data: dict) -> ResourceTable:
    rows = {
        (r["kernel"], r["dtype"], r["case"], r["config"]): Measured(
            int(r["registers"]), int(r["spill_bytes"]), int(r["smem_bytes"]), bool(r["launchable"])
        )
        for r in data["rows"]
    }
    return ResourceTable(data["target"], data["triton_version"], rows, frozenset(key[:3] for key in rows))


@functools.cache
def load_table(capability: int) -> ResourceTable | None:
    """The checked-in table for a compute capability (90 for sm_90), or None when there is none."""
    path = table_path(capability)
    if not path.is_file():
        return None
    return parse_table(json.loads(path.read_text()))


def table_capabilities() -> list[int]:
    """Capabilities with a checked-in table (80, 90)."""
    return sorted(int(p.stem.removeprefix("sm_")) for p in TABLE_DIR.glob("sm_*.json"))


def current_table(capability: int | None, triton_version: str) -> ResourceTable | None:
    """The table to trust on this device: one exists and the installed Triton produced it."""
    if capability is None:
        return None
    table = load_table(capability)
    if table is None or table.triton_version != triton_version:
        return None
    return table
