"""The Llama family's rows of `python -m tools.bench kernels` (`kernels --only llama` alone):
each kernel against the torch path lmsys runs without it, measured in the same run.

    rms_norm fwd / fwd+bwd        kernels.layer_norm.rms_norm vs rms_norm_reference      GB/s
    rotary fwd+bwd                kernels.rotary.rotary vs rotary_reference on q and k    GB/s
    swiglu fwd+bwd                kernels.gated.gated vs F.silu(gate) * up                GB/s
    attention gqa fwd+bwd         grouped K/V heads read in place vs SDPA (enable_gqa)    TFLOP/s
    attention docs fwd+bwd        packed documents, tiles skipped, vs SDPA with the       TFLOP/s
                                  document mask, and vs our kernel over the same rows as
                                  one document (the work the skipping saves)

ratio = ours / baseline throughput (> 1: ours faster). Counted bytes (GB/s rows) are what the op
must move at least, each tensor once (e = element size; M rows of width N): RMS norm forward
reads x and writes y (2 M N e) plus the gain and the fp32 rstd, the backward reads x, dy and
writes dx (3 M N e) plus rstd and the gain's gradient; rotary reads and writes q and k each way
(4 (H + Hkv) B T d e) plus the two tables each way; SwiGLU forward reads gate and up and writes
h (3 M N e), backward reads dh, gate, up and writes dgate, dup (5 M N e). FLOPs of attention are
those of the visible pairs (tools/bench/attention.py's convention: forward 4 d per pair, the
backward 2.5x): causal T (T + 1) / 2 pairs per head, with documents the sum of L (L + 1) / 2 over
the documents. The baselines are credited with the same bytes and FLOPs.

On a GPU the full grid runs in bf16 (the Llama presets' widths and heads) unless --smoke; without
CUDA the smoke grid runs in fp32 through the Triton interpreter: its timings only prove the code
path.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.flash_attention import flash_attention
from kernels.gated import gated
from kernels.layer_norm import rms_norm
from kernels.reference import document_mask, rms_norm_reference, rotary_reference
from kernels.rotary import rotary
from tools.bench.layer_norm import device_name, time_ms

# (rows, width): Llama 3.2 1B's and Qwen3's d_model, a wide row, and the QK-norm over 16 heads of 128
RMS_SHAPES_FULL = ((16384, 1024), (16384, 2048), (16384, 4096), (16384 * 16, 128))
RMS_SHAPES_SMOKE = ((8, 64),)
# (B, T, H, Hkv, d): Llama 3.2 1B's heads, and Qwen3-0.6B's
ROPE_SHAPES_FULL = ((4, 4096, 32, 8, 64), (4, 4096, 16, 8, 128))
ROPE_SHAPES_SMOKE = ((1, 8, 2, 1, 16),)
# (rows, d_ff): Qwen3-0.6B, Llama 3.2 1B, Llama 3 8B
GLU_SHAPES_FULL = ((16384, 3072), (16384, 8192), (16384, 14336))
GLU_SHAPES_SMOKE = ((8, 64),)
# (B, H, Hkv, T, d): Llama 3 8B's grouped heads
GQA_SHAPES_FULL = ((4, 32, 8, 4096, 128),)
GQA_SHAPES_SMOKE = ((1, 4, 2, 64, 32),)
# (B, H, T, d, document length): 8 documents of 512 per row of 4096
DOC_SHAPES_FULL = ((4, 16, 4096, 128, 512), (4, 16, 4096, 128, 256))
DOC_SHAPES_SMOKE = ((1, 1, 128, 16, 32),)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator, grad=True):
    x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return x.requires_grad_(grad)


def _check_same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """A fast wrong kernel must not make the table: compare with the baseline before timing."""
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(
        got.float(), want.float(), atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}"
    )


def _fwd_bwd(fn: Callable[[], torch.Tensor | tuple], inputs: tuple, grads: tuple) -> Callable[[], tuple]:
    """forward then backward of `fn` with the output gradients `grads`."""

    def run():
        out = fn()
        outs = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(outs, inputs, grads)

    return run


def _bandwidth_rows(
    op: str,
    shape: str,
    ours: Callable,
    base: Callable,
    baseline: str,
    nbytes: int,
    device: str,
    dtype: torch.dtype,
) -> dict:
    ms, base_ms = time_ms(ours, device), time_ms(base, device)
    gbps, base_gbps = nbytes / 1e9 / (ms * 1e-3), nbytes / 1e9 / (base_ms * 1e-3)
    return {
        "op": op, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "device": device_name(device),
        "ms": ms, "gbps": gbps, "pct_peak_hbm": None, "baseline": baseline, "baseline_gbps": base_gbps,
        "ratio": gbps / base_gbps,
    }  # fmt: skip


def _checked(ours: Callable, base: Callable, dtype: torch.dtype, what: str) -> None:
    got, want = ours(), base()
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        _check_same(g, w, dtype, what)


def bench_rms_norm(device: str, dtype: torch.dtype, gen: torch.Generator, full: bool) -> list[dict]:
    shapes = RMS_SHAPES_FULL if full else RMS_SHAPES_SMOKE
    return [row for m, n in shapes for row in _rms_norm_shape(m, n, device, dtype, gen)]


def _rms_norm_shape(m: int, n: int, device: str, dtype: torch.dtype, gen: torch.Generator) -> list[dict]:
    x, w = _randn((m, n), dtype, device, gen), _randn((n,), dtype, device, gen)
    dy = _randn((m, n), dtype, device, gen, grad=False)
    e = x.element_size()
    fwd_bytes = 2 * m * n * e + n * e + 4 * m
    ours, base = lambda: rms_norm(x, w, 1e-6), lambda: rms_norm_reference(x, w, 1e-6)
    rows = []
    for op, backward in (("rms_norm fwd", False), ("rms_norm fwd+bwd", True)):
        if backward:
            ours, base = _fwd_bwd(ours, (x, w), (dy,)), _fwd_bwd(base, (x, w), (dy,))
        _checked(ours, base, dtype, op)
        nbytes = fwd_bytes + (3 * m * n * e + 4 * m + 2 * n * e if backward else 0)
        with torch.set_grad_enabled(backward):
            rows.append(
                _bandwidth_rows(op, f"{m}x{n}", ours, base, "rms_norm_reference", nbytes, device, dtype)
            )
    return rows


def bench_rotary(device: str, dtype: torch.dtype, gen: torch.Generator, full: bool) -> list[dict]:
    shapes = ROPE_SHAPES_FULL if full else ROPE_SHAPES_SMOKE
    return [_rotary_shape(*shape, device, dtype, gen) for shape in shapes]


def _rotary_shape(
    b: int, t: int, h: int, h_kv: int, d: int, device: str, dtype: torch.dtype, gen: torch.Generator
) -> dict:
    q = _randn((b, t, h, d), dtype, device, gen).transpose(1, 2)  # the model's layout
    k = _randn((b, t, h_kv, d), dtype, device, gen).transpose(1, 2)
    angles = torch.rand((t, d // 2), generator=gen).repeat(1, 2).to(device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    dq, dk = (torch.randn(x.shape, generator=gen).to(device, dtype) for x in (q, k))
    ours = _fwd_bwd(lambda: rotary(q, k, cos, sin), (q, k), (dq, dk))
    base = _fwd_bwd(lambda: (rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)), (q, k), (dq, dk))
    _checked(ours, base, dtype, "rotary fwd+bwd")
    nbytes = 2 * (2 * (h + h_kv) * b * t * d + 2 * t * d) * q.element_size()
    shape = f"B={b} T={t} H={h} Hkv={h_kv} d={d}"
    return _bandwidth_rows("rotary fwd+bwd", shape, ours, base, "rotary_reference", nbytes, device, dtype)


def bench_swiglu(device: str, dtype: torch.dtype, gen: torch.Generator, full: bool) -> list[dict]:
    shapes = GLU_SHAPES_FULL if full else GLU_SHAPES_SMOKE
    return [_swiglu_shape(m, n, device, dtype, gen) for m, n in shapes]


def _swiglu_shape(m: int, n: int, device: str, dtype: torch.dtype, gen: torch.Generator) -> dict:
    gate, up = _randn((m, n), dtype, device, gen), _randn((m, n), dtype, device, gen)
    dh = _randn((m, n), dtype, device, gen, grad=False)
    ours = _fwd_bwd(lambda: gated(gate, up, "silu"), (gate, up), (dh,))
    base = _fwd_bwd(lambda: F.silu(gate) * up, (gate, up), (dh,))
    _checked(ours, base, dtype, "swiglu fwd+bwd")
    nbytes = 8 * m * n * gate.element_size()
    return _bandwidth_rows(
        "swiglu fwd+bwd", f"{m}x{n}", ours, base, "F.silu(gate) * up", nbytes, device, dtype
    )


def _attention_row(
    op: str,
    shape: tuple[int, int, int, int],  # (B, H, T, d)
    note: str,  # what the shape column adds: grouped heads, documents
    pairs: int,  # visible (query, key) pairs per head
    timings: tuple[float, str, float | None],  # (ours ms, baseline name, baseline ms or None)
    device: str,
    dtype: torch.dtype,
) -> dict:
    """A TFLOP/s row, forward and backward over the visible pairs (the module docstring)."""
    b, h, t, d = shape
    ms, baseline, base_ms = timings
    base_ms = math.nan if base_ms is None else base_ms
    flops = 4.0 * b * h * pairs * d * 3.5
    tflops, base_tflops = flops / (ms * 1e-3) / 1e12, flops / (base_ms * 1e-3) / 1e12
    return {
        "op": op, "causal": True, "B": b, "H": h, "T": t, "d": d, "shape_note": note,
        "dtype": str(dtype).removeprefix("torch."), "device": device_name(device), "ms": ms, "tflops": tflops,
        "baseline": baseline, "baseline_tflops": base_tflops, "ratio": tflops / base_tflops,
    }  # fmt: skip


def _sdpa(backend, q, k, v, **kwargs) -> Callable[[], torch.Tensor]:
    def run():
        with sdpa_kernel(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return run


def _timed_baseline(fn: Callable, ours_grads: tuple, dtype, what: str, device: str) -> float | None:
    """ms of a baseline forward+backward after checking it against ours; None when it cannot run."""
    try:
        _checked(lambda: ours_grads, fn, dtype, what)
        return time_ms(fn, device)
    except (RuntimeError, NotImplementedError):  # a backend that cannot take the shape or dtype
        return None


def bench_gqa(device: str, dtype: torch.dtype, gen: torch.Generator, full: bool) -> list[dict]:
    shapes = GQA_SHAPES_FULL if full else GQA_SHAPES_SMOKE
    return [_gqa_shape(*shape, device, dtype, gen) for shape in shapes]


def _gqa_shape(
    b: int, h: int, h_kv: int, t: int, d: int, device: str, dtype: torch.dtype, gen: torch.Generator
) -> dict:
    on_gpu = device.startswith("cuda")
    q = _randn((b, h, t, d), dtype, device, gen)
    k, v = _randn((b, h_kv, t, d), dtype, device, gen), _randn((b, h_kv, t, d), dtype, device, gen)
    do = _randn((b, h, t, d), dtype, device, gen, grad=False)
    ours = _fwd_bwd(lambda: flash_attention(q, k, v, causal=True), (q, k, v), (do,))
    grads = ours()
    ms = time_ms(ours, device)
    backend = SDPBackend.FLASH_ATTENTION if on_gpu else SDPBackend.MATH
    base = _fwd_bwd(_sdpa(backend, q, k, v, is_causal=True, enable_gqa=True), (q, k, v), (do,))
    base_ms = _timed_baseline(base, grads, dtype, "attention gqa", device)
    name = f"{'sdpa-flash' if on_gpu else 'sdpa-math'} (enable_gqa)"
    pairs = t * (t + 1) // 2
    return _attention_row(
        "attention gqa fwd+bwd", (b, h, t, d), f" Hkv={h_kv}", pairs, (ms, name, base_ms), device, dtype
    )


def bench_documents(device: str, dtype: torch.dtype, gen: torch.Generator, full: bool) -> list[dict]:
    shapes = DOC_SHAPES_FULL if full else DOC_SHAPES_SMOKE
    return [row for shape in shapes for row in _documents_shape(*shape, device, dtype, gen)]


def _documents_shape(
    b: int, h: int, t: int, d: int, length: int, device: str, dtype: torch.dtype, gen: torch.Generator
) -> list[dict]:
    on_gpu = device.startswith("cuda")
    q, k, v = (_randn((b, h, t, d), dtype, device, gen) for _ in range(3))
    do = _randn((b, h, t, d), dtype, device, gen, grad=False)
    documents = (torch.arange(t, device=device) // length).expand(b, t)  # (B, T): T / length each
    ours = _fwd_bwd(lambda: flash_attention(q, k, v, causal=True, documents=documents), (q, k, v), (do,))
    grads = ours()
    ms = time_ms(ours, device)
    one_document = _fwd_bwd(lambda: flash_attention(q, k, v, causal=True), (q, k, v), (do,))
    backend = SDPBackend.EFFICIENT_ATTENTION if on_gpu else SDPBackend.MATH
    mask = document_mask(documents, causal=True)  # (B, 1, T, T)
    masked = _fwd_bwd(_sdpa(backend, q, k, v, attn_mask=mask), (q, k, v), (do,))
    pairs = (t // length) * length * (length + 1) // 2
    note = f" docs={t // length}x{length}"
    name = f"{'sdpa-efficient' if on_gpu else 'sdpa-math'} (document mask)"
    baselines = (
        (name, _timed_baseline(masked, grads, dtype, "attention docs", device)),
        ("ours, one document", time_ms(one_document, device)),
    )
    return [
        _attention_row("attention docs fwd+bwd", (b, h, t, d), note, pairs, (ms, *baseline), device, dtype)
        for baseline in baselines
    ]


def bench_llama(device: str, dtype: torch.dtype, smoke: bool) -> list[dict]:
    """Every row of the module docstring: the full grid on a GPU, else the smoke grid (on CPU, the
    interpreter, in fp32)."""
    if not device.startswith("cuda"):
        dtype = torch.float32  # the interpreter cannot multiply bf16
    full = device.startswith("cuda") and not smoke
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bench in (bench_rms_norm, bench_rotary, bench_swiglu, bench_gqa, bench_documents):
        rows += bench(device, dtype, gen, full)
    return rows
