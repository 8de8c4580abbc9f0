"""The check before every checkpoint save (lmsys/engine/checkpoint.py): each weight reduced to a
norm in one pass, a NaN or an inf named, huge finite values cleared. Asynchronous saves in real
runs: tests/integration/training/test_async_save.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lmsys.engine import checkpoint as ckpt


def test_the_nonfinite_weight_check_names_the_weight_and_clears_huge_finite_ones():
    """The check before every save reduces each weight to a norm in one pass; a norm that
    overflows on finite values (1e30 squared) is cleared by the exact check, a NaN or an inf is
    named."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine = SimpleNamespace(module=SimpleNamespace(named_parameters=lambda: (
        (f"model.{name}", p) for name, p in model.named_parameters()
    )))  # fmt: skip
    with torch.no_grad():
        model[0].weight[0, 0] = 1e30
        assert ckpt.nonfinite_weight(engine) is None
        model[1].bias[1] = float("inf")
        assert ckpt.nonfinite_weight(engine) == "1.bias"
        model[0].weight[2, 1] = float("nan")
        assert ckpt.nonfinite_weight(engine) == "0.weight"  # the first in the model's order
