"""The pieces of the kernel benchmarks a reader relies on to check the targets compute what they
say: peak bandwidths by device name, the attention FLOP model, backward-only timing, the targets'
report and the GPT-2 grids. The benchmarks end to end: tests/integration/tools/test_kernel_bench.py.

No timing is asserted: timings belong in the benchmark's output, never in pass/fail tests."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tools.bench.attention import OPS, _flops, _time_op
from tools.bench.report import format_targets, peak_hbm_bytes_per_s

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "name,expected",
    [
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA A100-SXM4-80GB", 2.039e12),
        ("NVIDIA A100 80GB PCIe", 1.935e12),
        ("NVIDIA A100-SXM4-40GB", 1.555e12),
        ("NVIDIA A100-PCIE-40GB", 1.555e12),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("cpu", None),
    ],
)
def test_peak_hbm_by_device_name(name, expected):
    assert peak_hbm_bytes_per_s(name) == expected


def test_peak_hbm_override_wins():
    assert peak_hbm_bytes_per_s("cpu", 3000.0) == 3.0e12
    assert peak_hbm_bytes_per_s("NVIDIA H100 80GB HBM3", 1000.0) == 1.0e12


def test_attention_flops_model():
    """docs/DESIGN.md: forward 4*B*H*T*T*d, half when causal; backward 2.5x, forward+backward 3.5x."""
    fwd = 4.0 * 2 * 3 * 64 * 64 * 32
    assert _flops(2, 3, 64, 32, False, "attention fwd") == fwd
    assert _flops(2, 3, 64, 32, True, "attention fwd") == fwd / 2
    assert _flops(2, 3, 64, 32, True, "attention bwd") == 2.5 * fwd / 2
    assert _flops(2, 3, 64, 32, False, "attention fwd+bwd") == 3.5 * fwd
    assert list(OPS) == ["attention fwd", "attention bwd", "attention fwd+bwd"]


def test_backward_only_timing_runs_the_forward_once(monkeypatch):
    """'attention bwd' times the backward of one retained graph: the forward runs once in all, and
    every timed call produces the right gradients."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=gen).requires_grad_()
    w = torch.randn(8, 8, generator=gen).requires_grad_()
    dy = torch.randn(4, 8, generator=gen)
    forwards = 0

    def fwd():
        nonlocal forwards
        forwards += 1
        return torch.tanh(x @ w)

    def fwd_bwd():
        raise AssertionError("the backward-only op must not run forward+backward")

    original = torch.autograd.grad
    grads = []

    def recording_grad(*args, **kwargs):
        grads.append(original(*args, **kwargs))
        return grads[-1]

    monkeypatch.setattr(torch.autograd, "grad", recording_grad)
    _time_op("attention bwd", fwd, fwd_bwd, (x, w), dy, "cpu")
    monkeypatch.undo()
    assert forwards == 1 and len(grads) >= 2
    want = original(torch.tanh(x @ w), (x, w), dy)
    for got in grads:
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e)


def _ln_row(ratio: float, pct: float | None) -> dict:
    return {"op": "layer_norm fwd+bwd", "ratio": ratio, "pct_peak_hbm": pct}


def _attn_row(op: str, T: int, ratio: float, baseline="sdpa-flash", causal=True, d=128) -> dict:
    return {"op": op, "T": T, "d": d, "causal": causal, "baseline": baseline, "ratio": ratio}


def test_targets_report_the_worst_covered_row():
    rows = [
        _attn_row("attention fwd", 4096, 1.5),
        _attn_row("attention fwd", 16384, 1.31),
        _attn_row("attention fwd", 2048, 0.5),  # below T = 4k: not covered
        _attn_row("attention fwd", 8192, 0.1, baseline="sdpa-math"),  # not the flash baseline
        _attn_row("attention fwd", 8192, 0.1, causal=False),
        _attn_row("attention fwd", 8192, 0.1, d=64),
        _attn_row("attention bwd", 4096, 1.1),
        _attn_row("attention bwd", 8192, 1.4),
        _attn_row("attention bwd", 16384, math.nan, baseline="sdpa-flash"),  # no finite value: skipped
        _ln_row(1.6, 91.0),
        _ln_row(1.7, 88.5),
    ]
    lines = format_targets(rows).splitlines()
    fwd, bwd, hbm, ln = lines[1:]
    assert "attention fwd" in fwd and "worst 1.31x over 2 row(s)" in fwd and fwd.endswith(": met")
    assert "attention bwd" in bwd and "worst 1.1x over 2 row(s)" in bwd and bwd.endswith(": NOT met")
    assert "% of peak HBM" in hbm and "worst 88.5%" in hbm and hbm.endswith(": NOT met")
    assert "F.layer_norm" in ln and "worst 1.6x" in ln and ln.endswith(": met")


def test_targets_without_rows_or_verdicts():
    text = format_targets([_ln_row(0.01, None)], verdicts=False)
    assert "no verdict" in text.splitlines()[0]
    assert "met" not in text.replace("no verdict", "")
    hbm = next(line for line in text.splitlines() if "% of peak HBM" in line)
    assert "n/a" in hbm  # the peak bandwidth is unknown: no value, not 0%


def test_full_grids_cover_gpt2_shapes():
    """GPT-2's causal attention (d = 64, T = 1024) and its layer-norm widths are benched."""
    from tools.bench.attention import _shapes
    from tools.bench.layer_norm import LN_WIDTHS

    shapes = _shapes("cuda", smoke=False)  # the list only; nothing runs
    assert (16, 12, 1024, 64) in shapes and (16, 25, 1024, 64) in shapes
    assert {768, 1024, 1280, 1600} <= set(LN_WIDTHS) and max(LN_WIDTHS) == 16384


def _gpt2_lines(rows: list[dict], verdicts: bool = True) -> dict[str, str]:
    from tools.bench.report import GPT2_TARGETS

    text = format_targets(rows, verdicts, GPT2_TARGETS, "GPT-2 shapes")
    lines = text.splitlines()
    assert lines[0].startswith("targets (GPT-2 shapes")
    return {what: line for (what, *_), line in zip(GPT2_TARGETS, lines[1:])}


def test_gpt2_targets_read_the_right_rows():
    attn = lambda op, tflops, **kw: {"op": op, "causal": True, "d": 64, "T": 1024, "tflops": tflops, **kw}
    ln = lambda op, n, pct, ratio: {"op": op, "n": n, "pct_peak_hbm": pct, "ratio": ratio}
    rows = [
        attn("attention fwd", 295.0),
        attn("attention fwd", 100.0, T=4096),  # not GPT-2's length: not covered
        attn("attention fwd", 100.0, causal=False),
        attn("attention bwd", 280.0),
        ln("layer_norm fwd", 2048, 60.0, 2.0),  # below 4096: not covered by the 85% target
        ln("layer_norm fwd", 4096, 86.0, 1.6),
        ln("layer_norm fwd", 16384, 90.0, 1.7),
        ln("layer_norm fwd+bwd", 768, 71.0, 1.5),
        ln("layer_norm fwd+bwd", 16384, 40.0, 1.4),  # above 8192: not covered by the 70% target
    ]
    lines = _gpt2_lines(rows)
    fwd, bwd, ln_fwd, ln_both, ratio = lines.values()
    assert "worst 295 TFLOP/s over 1 row(s); target >= 290 TFLOP/s: met" in fwd
    assert "worst 280 TFLOP/s" in bwd and bwd.endswith(": NOT met")
    assert "worst 86% over 2 row(s)" in ln_fwd and ln_fwd.endswith(": met")
    assert "worst 71% over 1 row(s)" in ln_both and ln_both.endswith(": met")
    assert "worst 1.4x over 5 row(s)" in ratio and ratio.endswith(": NOT met")


def test_gpt2_targets_without_verdicts_or_rows():
    lines = _gpt2_lines([], verdicts=False)
    assert all("n/a" in line and "met" not in line for line in lines.values())
