"""The kernel table: `python -m tools.bench kernels [--smoke] [--dtype bf16|fp16|fp32] [--csv PATH]
[--peak-gbps GB/S] [--only attention|layer_norm|llama]`; `python -m tools.bench attention ...` /
`layer_norm ...` run their rows alone.

Prints the device and date, then one row per measurement (the layer norm, tools/bench/layer_norm.py;
the attention, tools/bench/attention.py; the Llama family's kernels, tools/bench/llama.py: RMS
norm, rotary, SwiGLU, grouped-query and packed-documents attention), and below the table the
kernels' targets with the worst measured value of each (tools/bench/report.py).

On a CUDA machine the default is the full grid in bf16, timed with triton.testing.do_bench.
Without CUDA it always runs the smoke grid (tiny shapes, fp32) on CPU tensors through the
Triton interpreter (selected by `python -m tools.bench` before triton is imported), timed with a
perf_counter loop: the figures mean nothing there, but the code path keeps working.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys

import torch

from lmsys.cli import run_cli
from tools.bench.attention import bench_attention
from tools.bench.layer_norm import bench_layer_norm, device_name
from tools.bench.llama import bench_llama
from tools.bench.report import (
    GPT2_ATTENTION_ANCHORS,
    GPT2_TARGETS,
    format_table,
    format_targets,
    peak_hbm_bytes_per_s,
    write_csv,
)

PROG = "tools.bench kernels"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_cli(PROG, lambda: run(argv))


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        choices=["attention", "layer_norm", "llama"],
        default=None,
        help="one group's rows (default: all)",
    )
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

    rows = []
    if args.only in (None, "layer_norm"):
        rows += bench_layer_norm(device, dtype, smoke, peak)
    if args.only in (None, "attention"):
        rows += bench_attention(device, dtype, smoke)
    if args.only in (None, "llama"):
        rows += bench_llama(device, dtype, smoke)

    print(format_table(rows))
    print()
    full_h100_bf16 = on_gpu and not smoke and dtype == torch.bfloat16 and "H100" in device_name(device)
    print(format_targets(rows, verdicts=full_h100_bf16))
    print()
    print(format_targets(rows, full_h100_bf16, GPT2_TARGETS, "GPT-2 shapes"))
    print(f"  {GPT2_ATTENTION_ANCHORS}")
    if args.csv:
        write_csv(rows, args.csv)
        print(f"\nwrote {args.csv}")
    return 0
