"""Packed documents in the flash-attention kernels (`documents=`): a packed row's attention and its
gradients equal each document run alone, the torch reference masks the same, and the kernels visit
only the tiles inside the documents, so their work grows with the sum of the squared document
lengths. Through the Triton interpreter on CPU, fp32, with grouped-query heads.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels.flash_attention import document_bounds, flash_attention, visited_tiles
from kernels.reference import document_attention_reference, repeat_kv
from tests.conftest import DEVICE
from tests.unit.model.test_documents import spans  # (row, start, end) of every document

INTERPRETER_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the tiling is fixed only under the interpreter; autotuned on GPU"
)
TOL = 1e-5  # fp32, relative to the largest magnitude compared

# (lengths of each row's documents, H, H_kv, d_qk, d_vo, causal, tiling (BLOCK_M, BLOCK_N) or None)
CASES = [
    # odd lengths, one-token documents, a row that is one document; groups of 2
    ([[5, 1, 30, 1, 33], [70]], 4, 2, 16, 16, True, None),
    # not causal, multi-query, unequal head widths, blocks of 16 and 32 rows
    ([[1, 17, 1, 1, 20], [33, 7]], 3, 1, 24, 16, False, (16, 32)),
    # causal, blocks of 32 and 16 rows: documents straddling both, a row of one-token documents
    ([[16, 3, 29, 1, 1], [1] * 50], 2, 2, 16, 8, True, (32, 16)),
]


def _set_tiling(monkeypatch, tiling: tuple[int, int] | None) -> None:
    if tiling is None:
        return
    fa = importlib.import_module("kernels.flash_attention")
    block_m, block_n = tiling
    for kind in ("fwd", "dkdv", "dq"):
        monkeypatch.setitem(fa.INTERPRETER_TILES, kind, {"BLOCK_M": block_m, "BLOCK_N": block_n})
    monkeypatch.setitem(fa.INTERPRETER_TILES, "preprocess", {"BLOCK_M": block_m})


def _documents(lengths: list[list[int]]) -> torch.Tensor:
    """(B, T) ids: row b's documents numbered from 7 * b (ids need only be non-decreasing)."""
    rows = [[7 * b + i for i, n in enumerate(row) for _ in range(n)] for b, row in enumerate(lengths)]
    return torch.tensor(rows, device=DEVICE)


def _close(got: torch.Tensor, want: torch.Tensor, what: str, floor: float = 1e-30) -> None:
    """Within TOL of the largest magnitude compared, or of `floor` (the whole tensor's largest: a
    one-token document's dq is 0 in exact arithmetic, rounding noise in both runs)."""
    scale = max(want.abs().max().item(), floor)
    error = (got.double() - want.double()).abs().max().item()
    assert error <= TOL * scale, f"{what}: {error} > {TOL} x {scale}"


@INTERPRETER_ONLY
@pytest.mark.parametrize("case", CASES, ids=["gqa2-causal", "mqa-full-16x32", "causal-32x16"])
def test_a_packed_row_is_each_document_alone(case, monkeypatch):
    lengths, h, h_kv, d_qk, d_vo, causal, tiling = case
    _set_tiling(monkeypatch, tiling)
    t = sum(lengths[0])
    gen = torch.Generator().manual_seed(len(lengths[0]))
    make = lambda heads, d: torch.randn(len(lengths), heads, t, d, generator=gen).to(DEVICE).requires_grad_()
    q, k, v = make(h, d_qk), make(h_kv, d_qk), make(h_kv, d_vo)
    do = torch.randn(len(lengths), h, t, d_vo, generator=gen).to(DEVICE)
    documents = _documents(lengths)
    out = flash_attention(q, k, v, causal=causal, documents=documents)
    out.backward(do)

    # the torch reference masks the same (float64, the key/value heads repeated)
    q64, k64, v64 = (x.detach().double() for x in (q, k, v))
    groups = h // h_kv
    want = document_attention_reference(
        q64, repeat_kv(k64, groups), repeat_kv(v64, groups), documents, causal
    )
    _close(out, want, "packed vs reference")

    for b, start, end in spans(lengths):
        qa, ka, va = (x.detach()[b : b + 1, :, start:end].clone().requires_grad_() for x in (q, k, v))
        alone = flash_attention(qa, ka, va, causal=causal)
        alone.backward(do[b : b + 1, :, start:end])
        where = f"row {b} document [{start}, {end})"
        _close(out[b : b + 1, :, start:end], alone, f"o of {where}")
        for name, packed, own in (("dq", q.grad, qa.grad), ("dk", k.grad, ka.grad), ("dv", v.grad, va.grad)):
            _close(packed[b : b + 1, :, start:end], own, f"{name} of {where}", packed.abs().max().item())


@INTERPRETER_ONLY
def test_work_grows_with_the_sum_of_squared_document_lengths():
    """Tiles visited (counted by the kernels' own programs) by the forward, dK/dV and dQ kernels at
    the interpreter's 32 x 32 tiles: 8 documents of 64 in a row of 512 visit 8 x (1 + 2) tiles of
    each kernel, one document of 512 16 x 17 / 2, over five times as many."""
    q = torch.randn(1, 1, 512, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    eight = visited_tiles(q, q, q, causal=True, documents=torch.arange(512, device=DEVICE)[None] // 64)
    one = visited_tiles(q, q, q, causal=True, documents=torch.zeros(1, 512, dtype=torch.long, device=DEVICE))
    assert eight == {"fwd": 24, "dkdv": 24, "dq": 24}
    assert one == {"fwd": 136, "dkdv": 136, "dq": 136}
    for kernel in one:
        assert 3 * eight[kernel] < one[kernel], kernel


@INTERPRETER_ONLY
def test_tiles_without_documents_not_causal_and_grouped():
    """At T = 128 (4 x 4 tiles of 32): one document visits what no documents do; not causal, each
    document's blocks see the whole document; grouped heads count each query head's tiles."""
    q = torch.randn(1, 4, 128, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    four = torch.arange(128, device=DEVICE)[None] // 32  # 4 documents of 32
    k = q[:, :1]
    plain = visited_tiles(q[:, :1], k, k, causal=True)
    assert plain == visited_tiles(q[:, :1], k, k, causal=True, documents=torch.zeros_like(four)) == {
        "fwd": 10, "dkdv": 10, "dq": 10
    }  # fmt: skip
    assert visited_tiles(q[:, :1], k, k, causal=False, documents=four) == {"fwd": 4, "dkdv": 4, "dq": 4}
    assert visited_tiles(q, k, k, causal=True, documents=four) == {"fwd": 16, "dkdv": 16, "dq": 16}


def test_document_bounds():
    documents = torch.tensor([[0, 0, 3, 3, 3, 9], [2, 2, 2, 2, 2, 2]])
    start, end = document_bounds(documents)
    assert start.dtype == end.dtype == torch.int32
    assert start.tolist() == [[0, 0, 2, 2, 2, 5], [0] * 6]
    assert end.tolist() == [[2, 2, 5, 5, 5, 6], [6] * 6]


def test_bad_documents_raise_one_clear_error():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"documents must be \(B, T\) = \(1, 8\)"):
        flash_attention(q, q, q, documents=torch.zeros(1, 7, dtype=torch.long, device=DEVICE))
    with pytest.raises(TypeError, match="integer tensor"):
        flash_attention(q, q, q, documents=torch.zeros(1, 8, device=DEVICE))
