"""The kernel self-check: before a run's first step, each Triton kernel the run will use is
compared with its torch reference on this device, at the run's widths and dtype.

The kernels are tested against their references in CI, but under the Triton CPU interpreter: a
real GPU (a new architecture, another Triton or driver) can miscompile or fail to launch one.
So each kernel the model will call (attention, grouped-query attention included; layer norm, add +
layer norm; RMS norm, add + RMS norm; rotary positions; the gated activation; the fused linear
cross-entropy) runs once, forward and backward, on one small batch at the model's head counts and
widths, d_model, d_ff, vocabulary and dtype, against its reference in float64 on the same rounded
inputs. The
tolerance comes from the dtype (`TOLERANCE`). Under model.kernels=auto a kernel that differs or
fails to launch falls back to its torch reference for the rest of the process (lmsys.model.ops
.fall_back) with one warning naming it, the error and the tolerance; under model.kernels=triton it
is an error. On CPU, model.kernels=triton runs the same check under the interpreter.

`break_kernel` (debug.break_kernel) perturbs one kernel's output inside the check, so
tests can see the fallback and the error without a broken GPU.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.reference import (
    GATED_ACTIVATIONS,
    add_layer_norm_reference,
    attention_reference,
    document_attention_reference,
    gated_reference,
    layer_norm_reference,
    linear_cross_entropy_reference,
    repeat_kv,
    rms_norm_reference,
    rotary_reference,
)
from lmsys.core.config import ModelConfig, model_dims
from lmsys.core.errors import LmsysError, TrainingError
from lmsys.model import ops

KERNELS = (
    "attention", "layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm", "rotary", "gated",
    "linear_cross_entropy",
)  # fmt: skip
# (dtype) -> bound, as atol relative to the largest expected magnitude (at least 1) and as rtol:
# a few times the kernel tests' bounds against float64 (tests/unit/kernels/), far below what a wrong
# tile, mask or reduction gives (errors of the order of the values themselves).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 8e-2}
MAX_TOKENS = 128  # tokens (rows) per call, at most the run's sequence length; attention on a GPU: all


@dataclass(frozen=True)
class Failure:
    kernel: str
    error: str  # "forward output differs by 0.5" or the launch's exception, one line
    tolerance: float


@dataclass
class KernelCheck:
    """What the self-check found on this device."""

    device: str
    dtype: torch.dtype
    passed: list[str] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        """The startup line."""
        dtype = str(self.dtype).removeprefix("torch.")
        found = []
        if self.passed:
            found.append(f"{', '.join(self.passed)} match torch (forward and backward)")
        if self.failed:
            found.append(f"{', '.join(f.kernel for f in self.failed)} fell back to torch")
        return f"kernel self-check on {self.device} at {dtype}: {'; '.join(found)} ({self.seconds:.1f} s)"


def kernels_used(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The Triton kernels a training run of `cfg` calls on `device`."""
    probe = torch.empty(0, device=device, dtype=dtype)
    if not ops.use_triton(probe, cfg.kernels):
        used: list[str] = []
    else:
        norms = cfg.norm.formula not in ("none", "rms")
        rms = cfg.norm.formula == "rms"
        any_norm = cfg.final_norm or cfg.block in ("pre", "post", "parallel")
        used = [
            name
            for name, on in (
                ("attention", cfg.attention.softmax == "row"),
                ("layer_norm", norms and any_norm),
                ("add_layer_norm", norms and cfg.block in ("pre", "post")),
                ("rms_norm", (rms and any_norm) or cfg.attention.qk_norm),
                ("add_rms_norm", rms and cfg.block in ("pre", "post")),
                ("rotary", cfg.positions.kind == "rotary"),
                ("gated", cfg.ffn.gated and cfg.ffn.activation in GATED_ACTIVATIONS),
            )
            if on
        ]
    if ops.loss_implementation(probe, cfg.loss_impl, cfg.kernels) == "fused":
        used.append("linear_cross_entropy")
    return used


def _random(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """None when `got` is within the tolerance of `want` (float64), else what differs."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    bound = tol * max(1.0, want.abs().max().item()) + tol * want.abs()
    if got.shape != want.shape:
        return f"{name} has shape {tuple(got.shape)}, not {tuple(want.shape)}"
    error = (got - want).abs()
    if not torch.isfinite(got).all() or (error > bound).any():
        return f"{name} differs by {error.max().item():.3g}"
    return None


def _run_case(
    kernel: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    reference: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: list[torch.Tensor],
    names: list[str],
    tol: float,
    perturb: bool,
    gen: torch.Generator,
) -> str | None:
    """Forward and backward of `kernel` and of `reference` (float64) on `inputs`; what differs."""
    ours = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    theirs = [x.detach().double().requires_grad_(True) if x.is_floating_point() else x for x in inputs]
    out = kernel(*ours)
    want = reference(*theirs)
    outs = list(out) if isinstance(out, tuple) else [out]
    wants = list(want) if isinstance(want, tuple) else [want]
    if perturb:  # debug.break_kernel: a kernel that computes something else
        outs[0] = outs[0] + 1.0
    for i, (o, w) in enumerate(zip(outs, wants)):
        what = f"forward output {i}" if len(outs) > 1 else "forward output"
        if (diff := _compare(what, o, w, tol)) is not None:
            return diff
    grads = [_random(tuple(w.shape), torch.float32, torch.device("cpu"), gen) for w in wants]
    torch.autograd.backward(outs, [g.to(o.device, o.dtype) for g, o in zip(grads, outs)])
    torch.autograd.backward(wants, [g.double() for g in grads])
    for name, a, b in zip(names, ours, theirs):
        if a.is_floating_point() and b.grad is not None:
            if a.grad is None:
                return f"backward gave no gradient for {name}"
            if (diff := _compare(f"backward d{name}", a.grad, b.grad, tol)) is not None:
                return diff
    return None


def _kernel(module: str, name: str) -> Callable[..., Any]:
    """A kernel's public function, imported only when the check calls it (triton's import order:
    ops.prepare_kernels; an import that fails is that kernel's failure)."""
    return lambda *args: getattr(importlib.import_module(f"kernels.{module}"), name)(*args)


def _cases(
    cfg: ModelConfig,
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    documents: bool = False,
):
    """kernel name -> (kernel, reference, inputs, input names), each one small call at the run's
    widths; attention over a row packed with two documents when the run packs them."""
    dims = model_dims(cfg)
    t = max(1, min(seq_len, MAX_TOKENS))
    d, h = cfg.d_model, cfg.n_heads
    affine = cfg.norm.affine
    weight = _random((d,), dtype, device, gen) if affine else None
    bias = _random((d,), dtype, device, gen) if affine else None
    norm_params = [p for p in (weight, bias) if p is not None]
    eps, formula = cfg.norm.eps, cfg.norm.formula

    def with_affine(fn):  # (x, [residual], *affine) -> fn(x, [residual], weight, bias)
        def call(*args):
            n = len(args) - len(norm_params)
            params = list(args[n:])
            w = params.pop(0) if weight is not None else None
            b = params.pop(0) if bias is not None else None
            return fn(*args[:n], w, b)

        return call

    causal, scale = cfg.attention.causal, dims.attention_scale
    # On a GPU attention runs at the run's sequence length: its autotuning and compilation (keyed
    # on T's power of two and the head widths, not on B) are then the ones the first step needs.
    t_attn = seq_len if device.type == "cuda" else t
    h_kv, groups = dims.n_kv_heads, h // dims.n_kv_heads
    q = _random((1, h, t_attn, dims.d_qk), dtype, device, gen)  # (B=1, H, T, d_qk)
    k = _random((1, h_kv, t_attn, dims.d_qk), dtype, device, gen)  # (B=1, Hkv, T, d_qk)
    v = _random((1, h_kv, t_attn, dims.d_vo), dtype, device, gen)
    flash_attention = _kernel("flash_attention", "flash_attention")
    # two documents in the row, the second from a third of it on
    packed = (torch.arange(t_attn, device=device) >= t_attn // 3).long()[None] if documents else None
    layer_norm, add_layer_norm = _kernel("layer_norm", "layer_norm"), _kernel("layer_norm", "add_layer_norm")
    linear_cross_entropy = _kernel("linear_cross_entropy", "linear_cross_entropy")
    x, residual = _random((t, d), dtype, device, gen), _random((t, d), dtype, device, gen)
    hidden = _random((t, d), dtype, device, gen)
    unembed = _random((cfg.vocab_size, d), dtype, device, gen) * d**-0.5
    targets = torch.randint(0, cfg.vocab_size, (t,), generator=gen).to(device)
    return {
        "attention": (
            lambda q, k, v: flash_attention(q, k, v, causal, scale, packed),
            lambda q, k, v: _attention_reference(
                q, repeat_kv(k, groups), repeat_kv(v, groups), causal, scale, packed
            ),
            [q, k, v],
            ["q", "k", "v"],
        ),
        **_llama_cases(cfg, t, dtype, device, gen),
        "layer_norm": (
            with_affine(lambda x, w, b: layer_norm(x, w, b, eps, formula)),
            with_affine(lambda x, w, b: layer_norm_reference(x, w, b, eps, formula)),
            [x, *norm_params],
            ["x", *(["weight"] if affine else []), *(["bias"] if affine else [])],
        ),
        "add_layer_norm": (
            with_affine(lambda x, r, w, b: add_layer_norm(x, r, w, b, eps, formula)),
            with_affine(lambda x, r, w, b: add_layer_norm_reference(x, r, w, b, eps, formula)),
            [x, residual, *norm_params],
            ["x", "residual", *(["weight"] if affine else []), *(["bias"] if affine else [])],
        ),
        "linear_cross_entropy": (
            lambda h_, w_, t_: linear_cross_entropy(h_, w_, t_),
            lambda h_, w_, t_: linear_cross_entropy_reference(h_, w_, t_),
            [hidden, unembed, targets],
            ["h", "weight", "targets"],
        ),
    }


def _attention_reference(q, k, v, causal: bool, scale: float, documents: torch.Tensor | None):
    if documents is None:
        return attention_reference(q, k, v, causal, scale)
    return document_attention_reference(q, k, v, documents, causal, scale)


def _llama_cases(cfg: ModelConfig, t: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    """The Llama family's kernels (RMS norm, add + RMS norm, rotary, the gated activation) at the
    run's widths: the RMS norm at d_model (at d_qk when only QK-norm uses it)."""
    dims = model_dims(cfg)
    width = cfg.d_model if cfg.norm.formula == "rms" else dims.d_qk
    eps = cfg.norm.eps
    gain = _random((width,), dtype, device, gen)
    x, residual = _random((t, width), dtype, device, gen), _random((t, width), dtype, device, gen)
    q = _random((1, cfg.n_heads, t, dims.d_qk), dtype, device, gen)  # (B=1, H, T, d_qk)
    k = _random((1, dims.n_kv_heads, t, dims.d_qk), dtype, device, gen)  # (B=1, Hkv, T, d_qk)
    angles = torch.rand((t, dims.d_qk // 2), generator=gen) * 2 * torch.pi
    angles = torch.cat((angles, angles), dim=-1)  # (T, d_qk): one angle per pair (i, i + d/2)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    d_ff = dims.d_ff
    gate, up = _random((t, d_ff), dtype, device, gen), _random((t, d_ff), dtype, device, gen)
    activation = cfg.ffn.activation if cfg.ffn.activation in GATED_ACTIVATIONS else "silu"
    rms_norm, add_rms_norm = _kernel("layer_norm", "rms_norm"), _kernel("layer_norm", "add_rms_norm")
    rotary, gated = _kernel("rotary", "rotary"), _kernel("gated", "gated")

    def add_rms_reference(x, r, w):
        summed = x + r
        return rms_norm_reference(summed, w, eps), summed

    return {
        "rms_norm": (
            lambda x, w: rms_norm(x, w, eps),
            lambda x, w: rms_norm_reference(x, w, eps),
            [x, gain],
            ["x", "weight"],
        ),
        "add_rms_norm": (
            lambda x, r, w: add_rms_norm(x, r, w, eps),
            add_rms_reference,
            [x, residual, gain],
            ["x", "residual", "weight"],
        ),
        "rotary": (  # the tables are no inputs: they get no gradient
            lambda q, k: rotary(q, k, cos, sin),
            lambda q, k: (
                rotary_reference(q, cos.double(), sin.double()),
                rotary_reference(k, cos.double(), sin.double()),
            ),
            [q, k],
            ["q", "k"],
        ),
        "gated": (
            lambda g, u: gated(g, u, activation),
            lambda g, u: gated_reference(g, u, activation),
            [gate, up],
            ["gate", "up"],
        ),
    }


def check_kernels(
    cfg: ModelConfig,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    break_kernel: str = "",
    kernels: list[str] | None = None,
    documents: bool = False,
) -> KernelCheck:
    """Compare each kernel in `kernels` (default: those the run uses) with its reference;
    `documents`: the run packs documents (data.document_masking), so attention is checked with
    them."""
    started = time.perf_counter()
    names = kernels_used(cfg, device, dtype) if kernels is None else kernels
    result = KernelCheck(str(device), dtype)
    if not names:
        return result
    tol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    gen = torch.Generator().manual_seed(0)
    if device.type == "cpu" and "linear_cross_entropy" in names:
        # the fused loss on CPU needs the interpreter: selected, or one user error line (ops')
        ops.prepare_interpreted_loss(torch.empty(0, dtype=dtype), cfg.kernels)
    cases = _cases(cfg, seq_len, dtype, device, gen, documents)
    for name in names:
        kernel, reference, inputs, input_names = cases[name]
        try:
            error = _run_case(kernel, reference, inputs, input_names, tol, break_kernel == name, gen)
        except LmsysError:  # a setting that cannot run here: the user's to fix, not a kernel's fault
            raise
        except Exception as exc:  # a launch failure, a compile error: the kernel cannot serve
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        if error is None:
            result.passed.append(name)
        else:
            result.failed.append(Failure(name, error, tol))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    result.seconds = time.perf_counter() - started
    return result


def settle(result: KernelCheck, mode: str, warn: Callable[[str], None]) -> None:
    """Act on the check: under model.kernels=triton a failure is an error; otherwise each failed
    kernel falls back to torch, with one warning. The fallbacks are this check's alone (a
    multirun's earlier job may have left others)."""
    ops.reset_fallbacks()
    for failure in result.failed:
        what = (
            f"the Triton kernel {failure.kernel} on {result.device} "
            f"({str(result.dtype).removeprefix('torch.')}): {failure.error} "
            f"(tolerance {failure.tolerance:g} of the largest value)"
        )
        if mode == "triton":
            raise TrainingError(
                f"kernel self-check failed: {what}; model.kernels=auto falls back to torch for it, "
                "model.kernels=torch uses torch everywhere"
            )
        ops.fall_back(failure.kernel)
        warn(f"kernel self-check: {what}; it falls back to its torch reference for this run")
