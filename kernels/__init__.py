"""Triton kernels for lmsys, importable without lmsys.

Public, differentiable entry points:
    flash_attention(q, k, v, causal=True, scale=None)
    layer_norm(x, weight=None, bias=None, eps=1e-5, formula="sqrt_var_eps")
    add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, formula="sqrt_var_eps")

Note: the functions shadow their submodules' names on this package; import module members with
`from kernels.flash_attention import ...`, never `import kernels.flash_attention as m`.
"""

from kernels.flash_attention import flash_attention
from kernels.layer_norm import add_layer_norm, layer_norm

__all__ = ["flash_attention", "layer_norm", "add_layer_norm"]
