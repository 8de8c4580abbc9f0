"""Attention benchmark: our FlashAttention kernels against torch SDPA, measured in the same run.

    python -m tools.bench attention [--smoke] [--dtype bf16|fp16|fp32]

`python -m tools.bench kernels` (tools/bench/kernel_table.py) calls `bench_attention` and prints
the combined table. For every shape and both masks there are three ops, each timed for ours and for
every torch `F.scaled_dot_product_attention` backend that runs for the shape (flash, cuDNN
where this torch has it, memory-efficient, math; one that raises, e.g. out of memory or
unsupported dtype, is skipped), one row per backend with its TFLOP/s and ratio = ours / that
backend's throughput (> 1: ours faster):

    attention fwd       the forward alone, under no_grad
    attention bwd       the backward alone: one forward is run (untimed) and kept with
                        retain_graph, then only torch.autograd.grad(out, (q, k, v), do) is timed;
                        each SDPA backend is measured the same way, its graph built under that
                        backend, so the backward is that backend's own kernel
    attention fwd+bwd   forward then backward, as a training step runs them

FLOPs (docs/DESIGN.md "Performance"): forward 4*B*H*T*T*d, half when causal; backward 2.5x forward,
forward+backward 3.5x. The same FLOPs are credited to the baseline, so the ratio is the inverse
ratio of times. The H100 bf16 targets read straight off the rows with d=128, causal=True,
T >= 4096 and baseline sdpa-flash: "attention fwd" ratio >= 1.3 and "attention bwd" ratio >= 1.2
(`tools.bench kernels` also prints the worst ratio over those rows).

Full grid (GPU): GPT-2's own shapes first (GPT2_SHAPES: B = 16, T = 1024, d = 64, 12 and 25
heads), then d in {64, 128}, T in {1024, ..., 16384}; B = max(1, 16384 // T) keeps ~16k tokens
per step at every length, and H = 2048 // d keeps the model width H*d at 2048 (a ~1B model's
attention layer: 32 heads of 64 or 16 of 128). Smoke: one tiny shape; on CPU the kernels
run through the Triton interpreter (fp32 only; the timings only prove the code path).
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import runtime
from kernels.flash_attention import flash_attention

FULL_HEAD_DIMS = (64, 128)
FULL_SEQ_LENS = (1024, 2048, 4096, 8192, 16384)
TOKENS_PER_STEP = 16384  # B * T on GPU
MODEL_WIDTH = 2048  # H * d
# GPT-2's own attention: 12 heads of 64 (124M) and 25 heads of 64 (1558M) over its 1024-token
# context, 16 sequences per step. The GPT-2 GPU targets read these rows (tools/bench/report.py).
GPT2_SHAPES = ((16, 12, 1024, 64), (16, 25, 1024, 64))  # (B, H, T, d)
SMOKE_GPU = (2, 4, 256, 64)  # (B, H, T, d)
SMOKE_CPU = (1, 2, 64, 32)


def _sdpa_backends() -> list[tuple[str, object]]:
    """(name, SDPBackend) for the backends this torch has, fastest-first by reputation."""

    names = [
        ("sdpa-flash", "FLASH_ATTENTION"),
        ("sdpa-cudnn", "CUDNN_ATTENTION"),
        ("sdpa-efficient", "EFFICIENT_ATTENTION"),
        ("sdpa-math", "MATH"),
    ]
    return [(name, getattr(SDPBackend, attr)) for name, attr in names if hasattr(SDPBackend, attr)]


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def _time_ms(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds per call: triton's do_bench on GPU, a short perf_counter loop on CPU."""
    if device.startswith("cuda"):
        import triton.testing  # GPU timings only: its benchmarking helpers are CUDA's

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up: the interpreter prepares the kernel on its first call
    samples = []
    for _ in range(2):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


# op name -> FLOPs as a multiple of the forward's (backward 2.5x forward).
OPS = {"attention fwd": 1.0, "attention bwd": 2.5, "attention fwd+bwd": 3.5}


def _flops(B: int, H: int, T: int, d: int, causal: bool, op: str) -> float:
    fwd = 4.0 * B * H * T * T * d * (0.5 if causal else 1.0)
    return fwd * OPS[op]


def _check_close(ours: torch.Tensor, base: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """A fast wrong kernel must not make the table: compare with the baseline before timing."""
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    scale = max(1.0, base.abs().max().item())
    torch.testing.assert_close(
        ours.float(), base.float(), atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}"
    )


def _shapes(device: str, smoke: bool) -> list[tuple[int, int, int, int]]:
    if not device.startswith("cuda"):
        return [SMOKE_CPU]
    if smoke:
        return [SMOKE_GPU]
    return [
        *GPT2_SHAPES,
        *(
            (max(1, TOKENS_PER_STEP // T), MODEL_WIDTH // d, T, d)
            for d in FULL_HEAD_DIMS
            for T in FULL_SEQ_LENS
        ),
    ]


def bench_attention(device: str, dtype: torch.dtype, smoke: bool) -> list[dict]:
    """Time forward, backward and forward+backward (OPS) of ours and of every SDPA backend; one
    row per (op, shape, mask, backend).

    Row keys: op, causal, B, H, T, d, dtype, device, ms, tflops, baseline, baseline_tflops, ratio.
    On CPU (Triton interpreter) only the smoke shape runs, in fp32 whatever `dtype` says: the
    interpreter cannot multiply bf16.
    """
    if not device.startswith("cuda"):
        if not runtime.interpreting():
            raise RuntimeError(
                "bench_attention on CPU needs the Triton interpreter, selected before triton is "
                "imported (`python -m tools.bench attention` does)"
            )
        dtype = torch.float32
    rows = []
    gen = torch.Generator().manual_seed(0)
    for B, H, T, d in _shapes(device, smoke):
        for causal in (True, False):
            rows += _bench_shape(B, H, T, d, causal, device, dtype, gen)
    return rows


def _bench_shape(
    B: int, H: int, T: int, d: int, causal: bool, device: str, dtype: torch.dtype, gen: torch.Generator
) -> list[dict]:
    make = lambda: torch.randn((B, H, T, d), generator=gen).to(device=device, dtype=dtype)
    q, k, v = (make().requires_grad_() for _ in range(3))  # (B, H, T, d) each
    do = make()  # (B, H, T, d)
    inputs = (q, k, v)
    ours = lambda: flash_attention(q, k, v, causal=causal)
    ours_bwd = lambda: torch.autograd.grad(ours(), inputs, do)

    # Baselines that run for this shape, each checked against ours once (which also triggers the
    # one-time autotuning of our kernels before anything is timed).
    ours_out, ours_grads = ours().detach(), ours_bwd()
    baselines: list[tuple[str, Callable, Callable]] = []
    for name, backend in _sdpa_backends():
        fwd, bwd = _sdpa_fns(backend, q, k, v, do, causal)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "kernel not used because ..." for unsupported shapes
                base_out, base_grads = fwd().detach(), bwd()
        except (RuntimeError, NotImplementedError):  # unsupported shape/dtype/device, or out of memory
            _release(device)
            continue
        _check_close(ours_out, base_out, dtype, f"attention forward vs {name}")
        for g_ours, g_base, g_name in zip(ours_grads, base_grads, ("dq", "dk", "dv")):
            _check_close(g_ours, g_base, dtype, f"attention {g_name} vs {name}")
        del base_out, base_grads
        baselines.append((name, fwd, bwd))
    del ours_out, ours_grads

    results = []
    for op in OPS:
        flops = _flops(B, H, T, d, causal, op)
        ms = _time_op(op, ours, ours_bwd, inputs, do, device)
        timed = []  # (backend name, ms) for every backend that could be timed
        for name, fwd, bwd in baselines:
            try:
                timed.append((name, _time_op(op, fwd, bwd, inputs, do, device)))
            except RuntimeError:  # e.g. out of memory only once timing allocates more
                _release(device)
        tflops = flops / (ms * 1e-3) / 1e12
        common = {
            "op": op,
            "causal": causal,
            "B": B,
            "H": H,
            "T": T,
            "d": d,
            "dtype": str(dtype).removeprefix("torch."),
            "device": _device_name(device),
            "ms": ms,
            "tflops": tflops,
        }
        # One row per SDPA backend; a lone "none" row when no backend runs for this shape.
        for name, base_ms in timed or [("none", math.nan)]:
            base_tflops = flops / (base_ms * 1e-3) / 1e12
            results.append(
                {**common, "baseline": name, "baseline_tflops": base_tflops, "ratio": tflops / base_tflops}
            )
    return results


def _time_op(
    op: str,
    fwd: Callable[[], torch.Tensor],
    fwd_bwd: Callable[[], object],
    inputs: tuple[torch.Tensor, ...],
    do: torch.Tensor,
    device: str,
) -> float:
    """Median ms of one op (see OPS) for one implementation, given its forward and its
    forward+backward closures."""
    if op == "attention fwd":
        with torch.no_grad():
            return _time_ms(fwd, device)
    with torch.enable_grad():
        if op == "attention fwd+bwd":
            return _time_ms(fwd_bwd, device)
        # Backward alone: one untimed forward whose graph is kept (retain_graph) and reused, so
        # every timed call is exactly the backward kernels plus autograd's bookkeeping. The graph
        # is freed when this returns (the closure is its only owner).
        out = fwd()
        return _time_ms(lambda: torch.autograd.grad(out, inputs, do, retain_graph=True), device)


def _sdpa_fns(backend, q, k, v, do, causal: bool) -> tuple[Callable, Callable]:
    """Forward and forward+backward closures pinned to one SDPA backend (the backward kernel is
    the one chosen when the forward built the graph)."""

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def bwd():
        return torch.autograd.grad(fwd(), (q, k, v), do)

    return fwd, bwd


def _release(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
