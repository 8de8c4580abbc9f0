"""The benchmark's table, CSV and target lines (`python -m tools.bench kernels`).

One row per measurement: our kernel's time and throughput next to a baseline measured in the
same run (F.layer_norm, torch SDPA), and their ratio. ratio = ours / baseline throughput, so
> 1 means our kernel is faster. Below the table, the kernels' H100 bf16 targets with the worst
measured value of each (they apply to the full grid on an H100 in bf16; elsewhere the lines
only show which rows would be read):

    causal attention, d=128, T = 4k..16k: forward >= 1.3x and backward >= 1.2x SDPA's flash backend
        (rows "attention fwd" / "attention bwd", baseline sdpa-flash; see tools/bench/attention.py)
    layer norm forward+backward: >= 90% of peak HBM bandwidth and >= 1.5x F.layer_norm
        (rows "layer_norm fwd+bwd": columns ours_pct_peak_hbm and ratio)

and the GPT-2 targets (GPT2_TARGETS; the full grid has GPT-2's shapes: attention
B=16, H=12 and 25, T=1024, d=64, causal; layer-norm widths 768, 1024, 1280, 1600):

    causal attention, d=64, T=1024: forward >= 290 and backward >= 300 TFLOP/s (column ours)
    layer norm forward, N >= 4096: >= 85% of peak HBM; forward+backward, N <= 8192: >= 70%
    layer norm, every row: >= 1.5x F.layer_norm (column ratio)

The device's peak HBM bandwidth, looked up by name in PEAK_HBM_BYTES_PER_S, is what the layer
norm's % of peak column divides by (tools/bench/layer_norm.py).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable

# Peak HBM bandwidth in bytes/s by device name: (substrings that must all occur in the upper-cased
# name, bytes/s or None for "known, but not in this table"); the first matching entry wins.
# Vendor datasheet figures. Names as torch.cuda.get_device_name reports them, e.g. "NVIDIA H100
# 80GB HBM3" (the SXM5 board), "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe".
PEAK_HBM_BYTES_PER_S: tuple[tuple[tuple[str, ...], float | None], ...] = (
    (("GH200",), None),  # 4.0 or 4.9 TB/s depending on the memory fitted: give --peak-gbps
    (("H200",), 4.8e12),
    (("H100", "NVL"), None),  # not in the table: give --peak-gbps
    (("H100", "PCIE"), 2.0e12),
    (("H100", "HBM3"), 3.35e12),
    (("H100", "SXM"), 3.35e12),
    (("A100", "PCIE", "80GB"), 1.935e12),
    (("A100", "80GB"), 2.039e12),
    (("A100", "40GB"), 1.555e12),
)


def peak_hbm_bytes_per_s(name: str, override_gbps: float | None = None) -> float | None:
    """The device's peak memory bandwidth in bytes/s: `override_gbps` (GB/s) when given, else
    the PEAK_HBM_BYTES_PER_S entry matching `name`, else None (unknown; e.g. "cpu")."""
    if override_gbps is not None:
        return override_gbps * 1e9
    upper = name.upper()
    for needles, peak in PEAK_HBM_BYTES_PER_S:
        if all(needle in upper for needle in needles):
            return peak
    return None


def _display(row: dict) -> dict:
    """One table/CSV line from a layer-norm row (GB/s) or an attention row (TFLOP/s)."""
    if "tflops" in row:
        shape = f"B={row['B']} H={row['H']} T={row['T']} d={row['d']} causal={row['causal']}"
        shape += row.get("shape_note", "")  # grouped key/value heads, packed documents
        ours, base, unit = row["tflops"], row["baseline_tflops"], "TFLOP/s"
        pct = "-"  # compute-bound: HBM bandwidth is not its measure
    else:
        shape, ours, base, unit = row["shape"], row["gbps"], row["baseline_gbps"], "GB/s"
        pct = "n/a" if row.get("pct_peak_hbm") is None else f"{row['pct_peak_hbm']:.3g}%"
    dtype = row["dtype"]
    return {
        "op": row["op"],
        "shape": shape,
        "dtype": dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."),
        "device": row["device"],
        "ours_ms": f"{row['ms']:.4f}",
        "ours": f"{ours:.4g} {unit}",
        "ours_pct_peak_hbm": pct,
        "baseline": row["baseline"],
        "baseline_figure": f"{base:.4g} {unit}",
        "ratio": f"{row['ratio']:.3g}",
    }


# The kernels' targets (H100, bf16, full grid): (what, which rows, row key, threshold, unit).
ATTENTION_TARGET_T = (4096, 16384)  # inclusive range of sequence lengths the targets cover


def _attention_target_rows(op: str) -> Callable[[dict], bool]:
    lo, hi = ATTENTION_TARGET_T
    return lambda r: (
        r["op"] == op
        and r.get("baseline") == "sdpa-flash"
        and r.get("causal") is True
        and r.get("d") == 128
        and lo <= r.get("T", 0) <= hi
    )


def _ln_fwd_bwd_rows(r: dict) -> bool:
    return r["op"] == "layer_norm fwd+bwd"


_ATTN = "causal, d=128, T=4k..16k"
TARGETS: tuple[tuple[str, Callable[[dict], bool], str, float, str], ...] = (
    (f"attention fwd vs sdpa-flash, {_ATTN}", _attention_target_rows("attention fwd"), "ratio", 1.3, "x"),
    (f"attention bwd vs sdpa-flash, {_ATTN}", _attention_target_rows("attention bwd"), "ratio", 1.2, "x"),
    ("layer_norm fwd+bwd, % of peak HBM", _ln_fwd_bwd_rows, "pct_peak_hbm", 90.0, "%"),
    ("layer_norm fwd+bwd vs F.layer_norm", _ln_fwd_bwd_rows, "ratio", 1.5, "x"),
)


def _gpt2_attention_rows(op: str) -> Callable[[dict], bool]:
    return lambda r: r["op"] == op and r.get("causal") is True and r.get("d") == 64 and r.get("T") == 1024


def _ln_rows(op: str, lo: int = 0, hi: int = 1 << 30) -> Callable[[dict], bool]:
    return lambda r: r["op"] == op and lo <= r.get("n", 0) <= hi


_ANY_LN = lambda r: r["op"].startswith("layer_norm")
# GPT-2's targets for a GPU session (H100 SXM, bf16): GPT-2's causal attention (d = 64,
# T = 1024) in absolute TFLOP/s, the layer norm against peak HBM bandwidth and F.layer_norm.
GPT2_TARGETS: tuple[tuple[str, Callable[[dict], bool], str, float, str], ...] = (
    (
        "attention fwd, causal d=64 T=1024 (GPT-2)",
        _gpt2_attention_rows("attention fwd"),
        "tflops",
        290.0,
        " TFLOP/s",
    ),
    (
        "attention bwd, causal d=64 T=1024 (GPT-2)",
        _gpt2_attention_rows("attention bwd"),
        "tflops",
        300.0,
        " TFLOP/s",
    ),
    (
        "layer_norm fwd, N >= 4096, % of peak HBM",
        _ln_rows("layer_norm fwd", lo=4096),
        "pct_peak_hbm",
        85.0,
        "%",
    ),
    (
        "layer_norm fwd+bwd, N <= 8192, % of peak HBM",
        _ln_rows("layer_norm fwd+bwd", hi=8192),
        "pct_peak_hbm",
        70.0,
        "%",
    ),
    ("layer_norm fwd and fwd+bwd vs F.layer_norm", _ANY_LN, "ratio", 1.5, "x"),
)
# Published H100 figures for GPT-2's attention shape (causal, d = 64, T = 1024), for reading the
# rows above; not measured by this benchmark: forward FlashAttention-2 ~229, Triton ~291, cuDNN
# ~288 TFLOP/s; backward FlashAttention-2 ~238, cuDNN ~348 TFLOP/s.
GPT2_ATTENTION_ANCHORS = (
    "H100 anchors (published): fwd FA2 ~229, Triton ~291, cuDNN ~288; bwd FA2 ~238, cuDNN ~348 TFLOP/s"
)


def format_targets(
    rows: list[dict],
    verdicts: bool = True,
    targets: tuple = TARGETS,
    scope: str = "the kernel grid",
) -> str:
    """One line per target: the worst value over the rows it covers, the threshold and, with
    `verdicts` (a full bf16 run on an H100), met or not. Rows without a finite value (an unknown
    peak bandwidth, a failed baseline) are left out."""
    if verdicts:
        lines = [f"targets ({scope}; H100, bf16, full grid):"]
    else:
        lines = [f"targets ({scope}; H100, bf16, full grid; not such a run, so values only, no verdict):"]
    for what, selects, key, threshold, unit in targets:
        values = [r[key] for r in rows if selects(r) and r.get(key) is not None and math.isfinite(r[key])]
        target = f"target >= {threshold:g}{unit}"
        if not values:
            lines.append(f"  {what}: n/a (no such rows with a value in this run); {target}")
            continue
        worst = min(values)
        line = f"  {what}: worst {worst:.3g}{unit} over {len(values)} row(s); {target}"
        if verdicts:
            line += ": met" if worst >= threshold else ": NOT met"
        lines.append(line)
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = [_display(r) for r in rows]
    if not lines:
        return "(no measurements)"
    cols = list(lines[0])
    widths = {c: max(len(c), *(len(line[c]) for line in lines)) for c in cols}
    out = ["  ".join(c.ljust(widths[c]) for c in cols)]
    out.append("  ".join("-" * widths[c] for c in cols))
    out += ["  ".join(line[c].ljust(widths[c]) for c in cols) for line in lines]
    return "\n".join(out)


def write_csv(rows: list[dict], path: str) -> None:
    lines = [_display(r) for r in rows]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(lines[0]) if lines else ["op"])
        writer.writeheader()
        writer.writerows(lines)
