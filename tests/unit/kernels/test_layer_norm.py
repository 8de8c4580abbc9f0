"""Layer-norm kernels against the float64 autograd of the torch reference.

Without a GPU these run on CPU tensors through the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so rows are few (3-6) and the widths are the odd ones of docs/DESIGN.md.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from kernels import runtime
from kernels.layer_norm import (
    FORMULAS,
    add_layer_norm,
    add_layer_norm_reference,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
    layer_norm_reference,
)
from tests.conftest import DEVICE

# The interpreter evaluates 1/0 for the "exact" formula on constant rows with numpy, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

WIDTHS = [1, 7, 1023, 1500, 4096]
AFFINES = ["weight+bias", "weight", "none"]
# (dtype, atol, rtol) against float64: fp32 tight; fp16/bf16 are limited by rounding the result.
FP32 = (torch.float32, 1e-5, 1e-5)
FP16 = (torch.float16, 5e-3, 5e-3)
# bf16 on CPU: the interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even), one
# more ulp at most, well inside these bounds.
BF16 = (torch.bfloat16, 4e-2, 2e-2)
EPS = {"sqrt_var_eps": 1e-5, "std_plus_eps": 1e-6, "exact": 0.0}  # SPEC defaults (exact ignores eps)


def _bf16_ok() -> bool:
    """bf16 runs on a GPU and, with numpy-emulated bf16, under the Triton interpreter."""
    try:
        x = torch.randn(2, 8, device=DEVICE).to(torch.bfloat16)
        return bool(torch.isfinite(layer_norm(x)).all())
    except Exception:  # the interpreter cannot represent bf16 on this install
        return False


BF16_CASE = pytest.param(
    *BF16, marks=pytest.mark.skipif(not _bf16_ok(), reason="bf16 needs CUDA on this Triton install")
)


def _randn(shape, dtype, gen, scale=1.0, shift=0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale + shift).to(dtype).to(DEVICE)


def _params(n: int, dtype: torch.dtype, affine: str, gen) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    weight = _randn((n,), dtype, gen, 0.5, 1.0) if affine in ("weight+bias", "weight") else None
    bias = _randn((n,), dtype, gen, 0.5) if affine == "weight+bias" else None
    return weight, bias


def _leaf(t: torch.Tensor | None, dtype=None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.detach().to(dtype or t.dtype).clone().requires_grad_(True)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def _grads(tensors) -> list[torch.Tensor | None]:
    return [None if t is None else t.grad for t in tensors]


@pytest.mark.parametrize("formula", list(FORMULAS))
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("affine", AFFINES)
@pytest.mark.parametrize("dtype, atol, rtol", [FP32, FP16])
def test_layer_norm_matches_float64_reference(formula, n, affine, dtype, atol, rtol):
    _check_layer_norm(formula, n, affine, dtype, atol, rtol, shape=(5, n))


@pytest.mark.parametrize("formula", list(FORMULAS))
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("dtype, atol, rtol", [BF16_CASE])
def test_layer_norm_bf16(formula, n, dtype, atol, rtol):
    _check_layer_norm(formula, n, "weight+bias", dtype, atol, rtol, shape=(4, n))


@pytest.mark.parametrize("formula", list(FORMULAS))
def test_layer_norm_leading_dims(formula):
    _check_layer_norm(formula, 1500, "weight+bias", torch.float32, 1e-5, 1e-5, shape=(2, 3, 1500))


@pytest.mark.parametrize("formula", list(FORMULAS))
@pytest.mark.parametrize("n", [7, 1500])
def test_layer_norm_eps_dominates(formula, n):
    """Rows with std ~ 0.05 and eps = 0.1: the formulas differ by O(1) here, not by 1e-6."""
    _check_layer_norm(formula, n, "weight+bias", torch.float32, 1e-5, 1e-5, shape=(4, n), scale=0.05, eps=0.1)


def _check_layer_norm(formula, n, affine, dtype, atol, rtol, shape, scale=2.0, eps=None):
    gen = torch.Generator().manual_seed(1000 * n + len(affine))
    eps = EPS[formula] if eps is None else eps
    x = _randn(shape, dtype, gen, scale, 0.5)
    weight, bias = _params(n, dtype, affine, gen)
    dy = _randn(shape, dtype, gen)

    xs, ws, bs = _leaf(x), _leaf(weight), _leaf(bias)
    y = layer_norm(xs, ws, bs, eps=eps, formula=formula)
    y.backward(dy)
    assert y.dtype == dtype and y.shape == x.shape

    if formula == "exact" and n == 1:
        # A single-element row is constant: var = 0 and "exact" has no eps, so 0/0 = NaN.
        assert torch.isnan(y).all() and torch.isnan(xs.grad).all()
        return

    x64, w64, b64 = _leaf(x, torch.float64), _leaf(weight, torch.float64), _leaf(bias, torch.float64)
    y64 = layer_norm_reference(x64, w64, b64, eps=eps, formula=formula)
    y64.backward(dy.double())
    expected_dx = x64.grad
    if formula == "std_plus_eps" and n == 1:
        # The output is constant in x (x - mean = 0), so dx = 0; autograd through sqrt(0) gives
        # 0 * inf = NaN here, the kernel gives the true derivative.
        expected_dx = torch.zeros_like(x64)

    _assert_close(y, y64, atol, rtol, "y")
    _assert_close(xs.grad, expected_dx, atol, rtol, "dx")
    for name, got, want in zip(("dweight", "dbias"), _grads([ws, bs]), _grads([w64, b64])):
        if want is not None:
            assert got is not None and got.dtype == dtype, name
            _assert_close(got, want, atol * 4, rtol, name)  # summed over rows


def _assert_is_sum(summed: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> None:
    """`summed` is x + residual rounded once to the input dtype, bitwise what torch computes.

    One exception: the Triton CPU interpreter (triton 3.x) converts fp32 to bf16 by truncation
    (round toward zero) where torch and the GPU round to nearest even. So on CPU each bf16 element
    must be torch's sum or the fp32 sum truncated to bf16 (one ulp apart at most); on a GPU the
    bf16 sum is held to bitwise equality like the others."""
    expected = x + residual
    if summed.dtype == torch.bfloat16 and summed.device.type == "cpu":
        fp32_sum = x.float() + residual.float()
        truncated = (fp32_sum.view(torch.int32) & -65536).view(torch.float32).bfloat16()  # exact
        assert ((summed == expected) | (summed == truncated)).all(), "summed is not x + residual"
    else:
        assert torch.equal(summed, expected), "summed must be exactly x + residual in the input dtype"


@pytest.mark.parametrize("formula", list(FORMULAS))
@pytest.mark.parametrize("n", [1, 7, 1500, 4096])
@pytest.mark.parametrize("dtype, atol, rtol", [FP32, FP16, BF16_CASE])
def test_add_layer_norm_matches_float64_reference(formula, n, dtype, atol, rtol):
    shape = (2, 2, n)
    gen = torch.Generator().manual_seed(n)
    eps = EPS[formula]
    x, residual = _randn(shape, dtype, gen, 2.0, 0.5), _randn(shape, dtype, gen)
    weight, bias = _params(n, dtype, "weight+bias", gen)
    dnormed, dsummed = _randn(shape, dtype, gen), _randn(shape, dtype, gen)

    leaves = [_leaf(t) for t in (x, residual, weight, bias)]
    normed, summed = add_layer_norm(*leaves, eps=eps, formula=formula)
    torch.autograd.backward([normed, summed], [dnormed, dsummed])
    _assert_is_sum(summed, x, residual)
    assert normed.dtype == summed.dtype == dtype

    if formula == "exact" and n == 1:
        assert torch.isnan(normed).all() and torch.isnan(leaves[0].grad).all()
        return

    leaves64 = [_leaf(t, torch.float64) for t in (x, residual, weight, bias)]
    normed64, summed64 = add_layer_norm_reference(*leaves64, eps=eps, formula=formula)
    torch.autograd.backward([normed64, summed64], [dnormed.double(), dsummed.double()])
    expected = _grads(leaves64)
    if formula == "std_plus_eps" and n == 1:  # see _check_layer_norm: only the add's gradient
        expected[0] = expected[1] = dsummed.double()

    _assert_close(normed, normed64, atol, rtol, "normed")
    for name, got, want in zip(("dx", "dresidual", "dweight", "dbias"), _grads(leaves), expected):
        _assert_close(got, want, atol * (4 if name in ("dweight", "dbias") else 1), rtol, name)


def test_add_layer_norm_single_output_used():
    """Post-LN uses only `normed`, pre-LN graphs may use only `summed`: both backward paths."""
    gen = torch.Generator().manual_seed(7)
    x, residual = _randn((3, 33), torch.float32, gen), _randn((3, 33), torch.float32, gen)
    weight, bias = _params(33, torch.float32, "weight+bias", gen)

    leaves = [_leaf(t) for t in (x, residual, weight, bias)]
    _, summed = add_layer_norm(*leaves)
    summed.sum().backward()
    assert torch.equal(leaves[0].grad, torch.ones_like(x)) and torch.equal(leaves[1].grad, torch.ones_like(x))
    assert leaves[2].grad is None and leaves[3].grad is None

    leaves = [_leaf(t) for t in (x, residual, weight, bias)]
    normed, _ = add_layer_norm(*leaves)
    (normed * normed).sum().backward()
    leaves64 = [_leaf(t, torch.float64) for t in (x, residual, weight, bias)]
    normed64, _ = add_layer_norm_reference(*leaves64)
    (normed64 * normed64).sum().backward()
    for name, got, want in zip(("dx", "dresidual", "dweight", "dbias"), _grads(leaves), _grads(leaves64)):
        _assert_close(got, want, 1e-5, 1e-5, name)


@pytest.mark.parametrize("formula", list(FORMULAS))
@pytest.mark.parametrize("n, block_n", [(1023, 512), (1500, 512)])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("scale, eps", [(3.0, None), (0.05, 0.1)], ids=["spec-eps", "large-eps"])
def test_chunked_wide_row_path(formula, n, block_n, fused, scale, eps):
    """Rows wider than one tile (N > 16384 forward, > 8192 backward on real shapes) loop over
    column chunks: Welford statistics forward, row sums then column-parallel dx backward. A small
    block_n reaches that path at interpreter-friendly widths."""
    gen = torch.Generator().manual_seed(n + fused)
    eps = EPS[formula] if eps is None else eps
    x, residual = _randn((3, n), torch.float32, gen, scale, -1.0), _randn((3, n), torch.float32, gen, scale)
    weight, bias = _params(n, torch.float32, "weight+bias", gen)
    dy, ds = _randn((3, n), torch.float32, gen), _randn((3, n), torch.float32, gen)

    y, summed, mean, rstd = layer_norm_forward(
        x, weight, bias, eps, formula, residual=residual if fused else None, block_n=block_n
    )
    ln_input = summed if fused else x
    dx, dw, db = layer_norm_backward(
        dy, ln_input, mean, rstd, weight, bias, eps, formula, dsummed=ds if fused else None, block_n=block_n
    )

    leaves64 = [_leaf(t, torch.float64) for t in (x, residual, weight, bias)]
    x64, r64, w64, b64 = leaves64
    s64 = x64 + r64 if fused else x64
    y64 = layer_norm_reference(s64, w64, b64, eps, formula)
    outs, grads = [y64], [dy.double()]
    if fused:
        outs.append(s64)
        grads.append(ds.double())
    torch.autograd.backward(outs, grads)
    _assert_close(y, y64, 1e-5, 1e-5, "y")
    _assert_close(dx, x64.grad, 1e-5, 1e-5, "dx")
    _assert_close(dw, w64.grad, 4e-5, 1e-5, "dweight")
    _assert_close(db, b64.grad, 4e-5, 1e-5, "dbias")
    _assert_close(mean, s64.detach().mean(-1), 1e-5, 1e-6, "mean")


def test_weight_gradient_is_deterministic():
    gen = torch.Generator().manual_seed(3)
    x = _randn((37, 1023), torch.float32, gen)
    weight, bias = _params(1023, torch.float32, "weight+bias", gen)
    dy = _randn((37, 1023), torch.float32, gen)
    runs = []
    for _ in range(2):
        leaves = [_leaf(t) for t in (x, weight, bias)]
        layer_norm(*leaves, formula="std_plus_eps").backward(dy)
        runs.append(_grads(leaves))
    for name, a, b in zip(("dx", "dweight", "dbias"), *runs):
        assert torch.equal(a, b), f"{name} differs between two identical backward passes"


def test_mixed_precision_weight_and_non_contiguous_input():
    """fp16 activations with fp32 parameters; x a transposed (non-contiguous) view."""
    gen = torch.Generator().manual_seed(11)
    x = _randn((40, 6), torch.float16, gen).t()  # (6, 40), column stride 6
    weight, bias = _params(40, torch.float32, "weight+bias", gen)
    leaves = [_leaf(t) for t in (x, weight, bias)]
    y = layer_norm(*leaves)
    y.backward(torch.ones_like(y))
    leaves64 = [_leaf(t, torch.float64) for t in (x, weight, bias)]
    layer_norm_reference(*leaves64).backward(torch.ones_like(y, dtype=torch.float64))
    assert y.dtype == torch.float16 and leaves[1].grad.dtype == torch.float32
    _assert_close(y, layer_norm_reference(*leaves64), 5e-3, 5e-3, "y")
    for name, got, want in zip(("dx", "dweight", "dbias"), _grads(leaves), _grads(leaves64)):
        _assert_close(got, want, 2e-2, 5e-3, name)


def test_empty_rows():
    x = torch.zeros((0, 16), device=DEVICE, requires_grad=True)
    weight = torch.ones(16, device=DEVICE, requires_grad=True)
    y = layer_norm(x, weight)
    y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 16)
    assert torch.equal(weight.grad, torch.zeros(16, device=DEVICE))


def test_reference_matches_torch_layer_norm():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=gen)
    w, b = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    torch.testing.assert_close(layer_norm_reference(x, w, b), F.layer_norm(x, (64,), w, b, eps=1e-5))


def test_exact_formula_constant_row_is_nan():
    x = torch.full((2, 16), 3.0, device=DEVICE)
    x[1] = torch.arange(16.0, device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        y = layer_norm(x, formula="exact")
    assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()
    # The eps formulas are finite on the same row: sqrt_var_eps and std_plus_eps give 0.
    for formula in ("sqrt_var_eps", "std_plus_eps"):
        assert torch.equal(layer_norm(x, formula=formula)[0], torch.zeros(16, device=DEVICE))


def _bad_inputs():
    x = torch.randn(3, 8, device=DEVICE)
    w8 = torch.ones(8, device=DEVICE)
    formulas = r"'rms'.*sqrt_var_eps, std_plus_eps, exact"
    return [
        ("formula", lambda: layer_norm(x, formula="rms"), ValueError, formulas),
        ("weight shape", lambda: layer_norm(x, torch.ones(7, device=DEVICE)), ValueError, r"weight.*\(8,\)"),
        (
            "bias shape",
            lambda: layer_norm(x, w8, torch.ones(8, 1, device=DEVICE)),
            ValueError,
            r"bias.*\(8,\)",
        ),
        ("residual shape", lambda: add_layer_norm(x, x[:2]), ValueError, "x and residual shapes differ"),
        ("residual dtype", lambda: add_layer_norm(x, x.half()), TypeError, "dtypes differ"),
        ("device", lambda: layer_norm(x, torch.ones(8, device="meta")), ValueError, "share a device"),
        ("float64", lambda: layer_norm(x.double()), TypeError, "unsupported dtype float64"),
        ("int", lambda: layer_norm(x.long()), TypeError, "unsupported dtype int64"),
        ("int weight", lambda: layer_norm(x, w8.int()), TypeError, "weight.*int32"),
        ("too wide", lambda: layer_norm(torch.empty(1, 65537, device=DEVICE)), ValueError, "N <= 65536"),
        ("negative eps", lambda: layer_norm(x, eps=-1e-5), ValueError, "eps must be a finite number >= 0"),
        ("scalar x", lambda: layer_norm(torch.tensor(1.0)), ValueError, "last dimension"),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_inputs_raise_one_clear_error(case):
    _, call, exc, match = case
    with pytest.raises(exc, match=match):
        call()


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(runtime, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors, or TRITON_INTERPRET=1"):
        layer_norm(torch.randn(2, 8))
