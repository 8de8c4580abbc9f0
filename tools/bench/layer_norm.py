"""The layer-norm rows of `python -m tools.bench kernels`: our "sqrt_var_eps" affine layer norm
(kernels.layer_norm, through its custom op) against F.layer_norm, forward and forward+backward.

GB/s and % of peak HBM. GB/s = counted bytes / time; % of peak = that / the device's peak HBM
bandwidth, looked up by device name in report.PEAK_HBM_BYTES_PER_S (H100 SXM 3.35 TB/s, H100
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
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from kernels.layer_norm import _bwd_row_programs, layer_norm

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
