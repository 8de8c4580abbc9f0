"""Triton kernels for lmsys, importable without lmsys.

Public, differentiable entry points, each in its module:
    kernels.flash_attention.flash_attention(q, k, v, causal=True, scale=None)
    kernels.layer_norm.layer_norm(x, weight=None, bias=None, eps=1e-5, formula="sqrt_var_eps")
    kernels.layer_norm.add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, formula=...)
    kernels.layer_norm.rms_norm(x, weight=None, eps=1e-6)
    kernels.layer_norm.add_rms_norm(x, residual, weight=None, eps=1e-6)
    kernels.rotary.rotary(q, k, cos, sin)
    kernels.gated.gated(gate, up, activation="silu")
    kernels.linear_cross_entropy.linear_cross_entropy(h, weight, targets, weights=None, bias=None, chunk=None)
flash_attention also takes grouped-query key/value heads and `documents=` (packed rows). Each
checks its inputs and calls its kernel's torch custom op, registered beside the kernel in the
same module (`torch.ops.lmsys.flash_attention_fwd`, `layer_norm_fwd`, `add_layer_norm_fwd`,
`rms_norm_fwd`, `add_rms_norm_fwd`, `rotary_fwd`, `gated_fwd`, `linear_cross_entropy_fwd`, with
their backward ops and autograd): the one differentiable path,
which torch.compile traces without a graph break. Importing a kernel module registers its ops.
Their torch definitions are in kernels.reference (torch only: importing it never imports triton),
which also holds the chunked torch path of the loss, `chunked_linear_cross_entropy`.

How the kernels run (the interpreter, the launching GPU, launch records and the tiling rule) is
kernels.runtime, which imports no triton either. The tools that benchmark and inspect the kernels
are in the top-level `tools/` package (`python -m tools.bench`, `python -m tools.inspect`).

Importing this package imports nothing: triton is imported with the first kernel module, so that
a program can still choose how Triton runs (its CPU interpreter: kernels.runtime) until then.
`from kernels import flash_attention` still gives the function when it is the first thing a
program takes from the package; the function names shadow their modules' otherwise, so import
from the modules (`from kernels.flash_attention import flash_attention`) in code that may run
after a module import.
"""

from __future__ import annotations

import importlib
from typing import Any

_ENTRY_POINTS = {
    "flash_attention": "kernels.flash_attention",
    "layer_norm": "kernels.layer_norm",
    "add_layer_norm": "kernels.layer_norm",
    "rms_norm": "kernels.layer_norm",
    "add_rms_norm": "kernels.layer_norm",
    "rotary": "kernels.rotary",
    "gated": "kernels.gated",
    "linear_cross_entropy": "kernels.linear_cross_entropy",
}
__all__ = list(_ENTRY_POINTS)


def __getattr__(name: str) -> Any:
    if name not in _ENTRY_POINTS:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    function = getattr(importlib.import_module(_ENTRY_POINTS[name]), name)
    globals()[name] = function  # importing the module bound its name here; the function wins
    return function
