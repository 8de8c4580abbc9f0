"""Kernel benchmarks: `python -m kernels.bench [--smoke] [--dtype bf16|fp16|fp32] [--csv PATH]
[--peak-gbps GB/S]`; `python -m kernels.bench ce ...`: the linear cross-entropy (kernels/bench_ce.py).

Prints the device and date, then one row per measurement: our kernel's time and throughput
next to a baseline measured in the same run (F.layer_norm, torch SDPA), and their ratio.
ratio = ours / baseline throughput, so > 1 means our kernel is faster. Below the table, the
issue's H100 bf16 targets with the worst measured value of each (they apply to the full grid
on an H100 in bf16; elsewhere the lines only show which rows would be read):

    causal attention, d=128, T = 4k..16k: forward >= 1.3x and backward >= 1.2x SDPA's flash backend
        (rows "attention fwd" / "attention bwd", baseline sdpa-flash; see kernels/bench_attention.py)
    layer norm forward+backward: >= 90% of peak HBM bandwidth and >= 1.5x F.layer_norm
        (rows "layer_norm fwd+bwd": columns ours_pct_peak_hbm and ratio)

and the GPT-2 targets of issue #12 (GPT2_TARGETS; the full grid has GPT-2's shapes: attention
B=16, H=12 and 25, T=1024, d=64, causal; layer-norm widths 768, 1024, 1280, 1600):

    causal attention, d=64, T=1024: forward >= 290 and backward >= 300 TFLOP/s (column ours)
    layer norm forward, N >= 4096: >= 85% of peak HBM; forward+backward, N <= 8192: >= 70%
    layer norm, every row: >= 1.5x F.layer_norm (column ratio)

Layer-norm GB/s and % of peak HBM. GB/s = counted bytes / time; % of peak = that / the device's
peak HBM bandwidth, looked up by device name in PEAK_HBM_BYTES_PER_S (H100 SXM 3.35 TB/s, H100
PCIe 2.0, H200 4.8, A100 80GB SXM 2.039, A100 80GB PCIe 1.935, A100 40GB 1.555), or given with
--peak-gbps; "n/a" when unknown (always on CPU without the flag). The counted bytes are what the
op must move at least, each tensor once (M rows of width N; e = element size of x, y, dy, dx and,
in this benchmark, of weight and bias; P = the backward's row programs, `_bwd_row_programs`):

    forward:  read x (M N e), write y (M N e), read weight and bias (2 N e; every program reads
              them, but from L2 after the first), write the fp32 row mean and rstd (2 M 4)
    backward: read x and dy (2 M N e), read mean and rstd (2 M 4), read weight (N e), write dx
              (M N e), write the fp32 per-program dweight/dbias partial sums (2 P N 4) and read
              them back in the final torch .sum(0) (2 P N 4), write dweight and dbias (2 N e;
              the (N,) fp32 sums in between are not counted)
    fwd+bwd:  the sum of both

What the kernels move beyond that is charged to them: rows wider than one tile are read more
than once (forward N > 16384: x twice; backward N > 8192: x and dy twice, plus the (M,) fp32
row sums of the extra pass). In the full grid that is the N = 16384 backward, which moves
about 5 M N e where 3 M N e are counted, so its "layer_norm fwd+bwd" row reads at most
(2 + 3) / (2 + 5) = 71% of peak even at full bandwidth. F.layer_norm is credited with the same
bytes, so the ratio is the inverse ratio of times.

On a CUDA machine the default is the full grid in bf16, timed with triton.testing.do_bench.
Without CUDA it always runs the smoke grid (tiny shapes, fp32) on CPU tensors through the
Triton interpreter, timed with a perf_counter loop: the figures mean nothing there, but the code
path keeps working.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    # The interpreter must be chosen before triton is imported. Under `python -m kernels.bench`
    # the `kernels` package (and so triton) is imported before this module runs, so when that
    # already happened, the CLI starts again with the switch set. (Merely importing this module
    # never re-executes the process.)
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules and __name__ == "__main__":
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "kernels.bench", *sys.argv[1:]])

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from kernels.layer_norm import _bwd_row_programs, layer_norm  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Layer-norm grid: rows x widths. ~16k rows keep every width memory-bound on an H100.
LN_ROWS = 16384
# GPT-2's widths (124M ... 1558M: 768, 1024, 1280, 1600), then the wide rows.
LN_WIDTHS = (768, 1024, 1280, 1600, 2048, 4096, 8192, 16384)
LN_SMOKE_ROWS_GPU = 1024
LN_SMOKE_WIDTHS_GPU = (1024, 4096)
LN_SMOKE_ROWS_CPU = 8
LN_SMOKE_WIDTHS_CPU = (64, 256)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def time_ms(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds per call: do_bench on a GPU, a short perf_counter loop elsewhere."""
    if device.startswith("cuda"):
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up (the interpreter rewrites the kernel on its first call)
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _ln_bytes(m: int, n: int, dtype: torch.dtype, backward: bool, device: str) -> int:
    """Counted bytes of an affine layer norm over (m, n) in `dtype`, forward or forward+backward
    (the byte model of the module docstring; e = element size, P = backward row programs)."""
    e = torch.empty((), dtype=dtype).element_size()
    fwd = 2 * m * n * e + 2 * n * e + 2 * m * 4
    if not backward:
        return fwd
    partial_rows, _ = _bwd_row_programs(m, n, torch.device(device))
    bwd = 3 * m * n * e + 2 * m * 4 + n * e + 2 * 2 * partial_rows * n * 4 + 2 * n * e
    return fwd + bwd


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


def _check_same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """A fast wrong kernel must not make the table: compare with the baseline before timing."""
    rtol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(
        got.float(), want.float(), atol=rtol * 10, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def bench_layer_norm(
    device: str, dtype: torch.dtype, smoke: bool, peak_bytes_per_s: float | None = None
) -> list[dict]:
    """Forward and forward+backward GB/s of our "sqrt_var_eps" affine layer norm vs F.layer_norm,
    and ours as a percentage of `peak_bytes_per_s` (None: unknown)."""
    if device.startswith("cuda"):
        rows, widths = (LN_SMOKE_ROWS_GPU, LN_SMOKE_WIDTHS_GPU) if smoke else (LN_ROWS, LN_WIDTHS)
    else:
        rows, widths = LN_SMOKE_ROWS_CPU, LN_SMOKE_WIDTHS_CPU
    gen = torch.Generator().manual_seed(0)
    return [
        row for n in widths for row in _bench_layer_norm_shape(rows, n, device, dtype, gen, peak_bytes_per_s)
    ]


def _bench_layer_norm_shape(
    rows: int, n: int, device: str, dtype: torch.dtype, gen: torch.Generator, peak_bytes_per_s: float | None
) -> list[dict]:
    x = torch.randn((rows, n), generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device=device, dtype=dtype).requires_grad_(True)
    b = (0.1 * torch.randn(n, generator=gen)).to(device=device, dtype=dtype).requires_grad_(True)
    dy = torch.randn((rows, n), generator=gen).to(device=device, dtype=dtype)
    inputs = (x, w, b)
    ours = lambda: layer_norm(x, w, b, eps=1e-5)
    base = lambda: F.layer_norm(x, (n,), w, b, eps=1e-5)
    ours_bwd = lambda: torch.autograd.grad(ours(), inputs, dy)
    base_bwd = lambda: torch.autograd.grad(base(), inputs, dy)

    _check_same(ours(), base(), dtype, "layer_norm forward")
    for got, want in zip(ours_bwd(), base_bwd()):
        _check_same(got, want, dtype, "layer_norm backward")

    results = []
    for op, backward, ours_fn, base_fn in [
        ("layer_norm fwd", False, ours, base),
        ("layer_norm fwd+bwd", True, ours_bwd, base_bwd),
    ]:
        with torch.set_grad_enabled(backward):
            ms = time_ms(ours_fn, device)
            base_ms = time_ms(base_fn, device)
        gbytes = _ln_bytes(rows, n, dtype, backward, device) / 1e9
        gbps, base_gbps = gbytes / (ms * 1e-3), gbytes / (base_ms * 1e-3)
        results.append(
            {
                "op": op,
                "shape": f"{rows}x{n}",
                "dtype": str(dtype).removeprefix("torch."),
                "device": device_name(device),
                "ms": ms,
                "gbps": gbps,
                "pct_peak_hbm": None if peak_bytes_per_s is None else 100 * gbps * 1e9 / peak_bytes_per_s,
                "n": n,
                "baseline": "F.layer_norm",
                "baseline_gbps": base_gbps,
                "ratio": gbps / base_gbps,
            }
        )
    return results


def _display(row: dict) -> dict:
    """One table/CSV line from a layer-norm row (GB/s) or an attention row (TFLOP/s)."""
    if "tflops" in row:
        shape = f"B={row['B']} H={row['H']} T={row['T']} d={row['d']} causal={row['causal']}"
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


# The targets (H100, bf16, full grid): (what, which rows, row key, threshold, unit).
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
# Issue #12's targets for a GPU session (H100 SXM, bf16): GPT-2's causal attention (d = 64,
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
    scope: str = "issue #3",
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["ce"]:  # the linear cross-entropy benchmark, its own command line
        from kernels.bench_ce import main as bench_ce

        return bench_ce(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (always on without CUDA)")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--csv", metavar="PATH", default=None, help="also write the table as CSV")
    parser.add_argument(
        "--peak-gbps",
        type=float,
        default=None,
        metavar="GB/S",
        help="peak HBM bandwidth in GB/s for the %% of peak column (default: looked up by device name)",
    )
    args = parser.parse_args(argv)
    if args.peak_gbps is not None and not (math.isfinite(args.peak_gbps) and args.peak_gbps > 0):
        parser.error(f"--peak-gbps must be a positive number of GB/s, got {args.peak_gbps}")

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    if not on_gpu:
        # CPU figures only prove the code path; one thread avoids OpenMP spin-waits that make
        # tiny torch ops take milliseconds on a busy machine.
        torch.set_num_threads(1)
    smoke = args.smoke or not on_gpu
    dtype = DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")]
    print(f"device: {device_name(device)}")
    print(f"date:   {datetime.datetime.now().isoformat(timespec='seconds')}")
    mode = "smoke" if smoke else "full"
    if not on_gpu:
        mode += ", Triton interpreter on CPU: timings are not meaningful"
    print(f"grid:   {mode}; ratio = ours / baseline throughput (> 1: ours faster)")
    peak = peak_hbm_bytes_per_s(device_name(device), args.peak_gbps)
    if peak is None:
        print("peak HBM: unknown for this device (% of peak: n/a; give --peak-gbps)")
    else:
        source = "--peak-gbps" if args.peak_gbps is not None else "by device name"
        print(f"peak HBM: {peak / 1e9:.0f} GB/s ({source})")
    print()

    rows = bench_layer_norm(device, dtype, smoke, peak)
    try:
        from kernels.bench_attention import bench_attention
    except ImportError as e:
        print(f"attention benchmark unavailable: {e}")
    else:
        rows += bench_attention(device, dtype, smoke)

    print(format_table(rows))
    print()
    full_h100_bf16 = on_gpu and not smoke and dtype == torch.bfloat16 and "H100" in device_name(device)
    print(format_targets(rows, verdicts=full_h100_bf16))
    print()
    print(format_targets(rows, full_h100_bf16, GPT2_TARGETS, "issue #12, GPT-2 shapes"))
    print(f"  {GPT2_ATTENTION_ANCHORS}")
    if args.csv:
        write_csv(rows, args.csv)
        print(f"\nwrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
