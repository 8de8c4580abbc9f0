"""Kernel benchmarks: `python -m kernels.bench [--smoke] [--dtype bf16|fp16|fp32] [--csv PATH]`.

Prints the device and date, then one row per measurement: our kernel's time and throughput
next to a baseline measured in the same run (F.layer_norm, torch SDPA), and their ratio.
ratio = ours / baseline throughput, so > 1 means our kernel is faster.

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
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from kernels.layer_norm import _bwd_row_programs, layer_norm  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Layer-norm grid: rows x widths. ~16k rows keep every width memory-bound on an H100.
LN_ROWS = 16384
LN_WIDTHS = (1024, 2048, 4096, 8192, 16384)
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
    """Byte model for layer norm with weight and bias (e = element size, P = partial rows).

    forward:  read x (m n e) + write y (m n e) + read weight, bias (2 n e) + write mean, rstd (2 m 4)
    backward: read x, dy (2 m n e) + read mean, rstd (2 m 4) + read weight (n e) + write dx (m n e)
              + write and re-read the fp32 dweight/dbias partial sums (2 * 2 P n 4)
              + write dweight, dbias (2 n e)
    "fwd+bwd" is the sum of both. Each tensor counts once: re-reads (the chunked path for wide
    rows reads x and dy twice) earn nothing. The same bytes are credited to F.layer_norm, so the
    ratio is the inverse ratio of times.
    """
    e = torch.empty((), dtype=dtype).element_size()
    fwd = 2 * m * n * e + 2 * n * e + 2 * m * 4
    if not backward:
        return fwd
    partial_rows, _ = _bwd_row_programs(m, n, torch.device(device))
    bwd = 3 * m * n * e + 2 * m * 4 + n * e + 2 * 2 * partial_rows * n * 4 + 2 * n * e
    return fwd + bwd


def _check_same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """A fast wrong kernel must not make the table: compare with the baseline before timing."""
    rtol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(
        got.float(), want.float(), atol=rtol * 10, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def bench_layer_norm(device: str, dtype: torch.dtype, smoke: bool) -> list[dict]:
    """Forward and forward+backward GB/s of our "sqrt_var_eps" affine layer norm vs F.layer_norm."""
    if device.startswith("cuda"):
        rows, widths = (LN_SMOKE_ROWS_GPU, LN_SMOKE_WIDTHS_GPU) if smoke else (LN_ROWS, LN_WIDTHS)
    else:
        rows, widths = LN_SMOKE_ROWS_CPU, LN_SMOKE_WIDTHS_CPU
    gen = torch.Generator().manual_seed(0)
    return [row for n in widths for row in _bench_layer_norm_shape(rows, n, device, dtype, gen)]


def _bench_layer_norm_shape(
    rows: int, n: int, device: str, dtype: torch.dtype, gen: torch.Generator
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
    else:
        shape, ours, base, unit = row["shape"], row["gbps"], row["baseline_gbps"], "GB/s"
    dtype = row["dtype"]
    return {
        "op": row["op"],
        "shape": shape,
        "dtype": dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."),
        "device": row["device"],
        "ours_ms": f"{row['ms']:.4f}",
        "ours": f"{ours:.4g} {unit}",
        "baseline": row["baseline"],
        "baseline_figure": f"{base:.4g} {unit}",
        "ratio": f"{row['ratio']:.3g}",
    }


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
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (always on without CUDA)")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--csv", metavar="PATH", default=None, help="also write the table as CSV")
    args = parser.parse_args(argv)

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
    print()

    rows = bench_layer_norm(device, dtype, smoke)
    try:
        from kernels.bench_attention import bench_attention
    except ImportError as e:
        print(f"attention benchmark unavailable: {e}")
    else:
        rows += bench_attention(device, dtype, smoke)

    print(format_table(rows))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"\nwrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
