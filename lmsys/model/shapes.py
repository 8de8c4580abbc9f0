"""The shapes of a config's model that the plan needs (lmsys.training.planning): parameter counts,
each parameter's size and the FLOPs per token, from a Transformer built on the meta device."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from lmsys.core.config import Config, model_dims
from lmsys.model.transformer import Transformer


@dataclass(frozen=True)
class ModelShapes:
    """What the plan needs of the model, from a Transformer built on the meta device (no memory)."""

    n_params: int  # distinct parameters (a tied matrix once): the model's num_parameters()
    param_numels: tuple[int, ...]  # each distinct parameter's elements
    block_params: int  # parameters of one block
    input_params: int  # the token embedding's and the positions' (the forward's first module)
    flops_per_token: int  # 6N + 6 L H (d_qk + d_vo) T at the run's T
    recompute_flops_per_token: int  # the blocks' forward again, with activation checkpointing


def model_shapes(cfg: Config) -> ModelShapes:
    """The shapes of cfg's model at its data.seq_len (cached: the suggestions re-plan one model)."""
    key = (repr(cfg.model), cfg.data.seq_len)
    if key not in _SHAPES:
        _SHAPES[key] = _model_shapes(cfg)
    return _SHAPES[key]


_SHAPES: dict[tuple[str, int], ModelShapes] = {}


class _NoInit(TorchFunctionMode):
    """Skips the in-place random initialisations of a model built on the meta device: there they
    run torch's Python references, whose first call imports torch._dynamo (about 2 s of CPU at
    every launch) to fill tensors that have no data."""

    SKIPPED = frozenset(
        {
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
            nn.init.normal_,
            nn.init.uniform_,
            nn.init.trunc_normal_,
            nn.init.kaiming_uniform_,
            nn.init.kaiming_normal_,
            nn.init.xavier_uniform_,
            nn.init.xavier_normal_,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in self.SKIPPED:  # the tensor, unchanged (nn.init passes it by keyword)
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _model_shapes(cfg: Config) -> ModelShapes:
    with torch.device("meta"), _NoInit():
        model = Transformer(cfg.model)
    numels = tuple(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters()) if len(model.blocks) else 0
    inputs = ("tok_emb.", "positions.")
    first = sum(p.numel() for name, p in model.named_parameters() if name.startswith(inputs))
    m, dims = cfg.model, model_dims(cfg.model)
    attention_fwd = 2 * m.n_layers * m.n_heads * (dims.d_qk + dims.d_vo) * cfg.data.seq_len
    return ModelShapes(
        n_params=model.num_parameters(),
        param_numels=numels,
        block_params=block,
        input_params=first,
        flops_per_token=model.flops_per_token(cfg.data.seq_len),
        recompute_flops_per_token=2 * block * m.n_layers + attention_fwd,
    )
