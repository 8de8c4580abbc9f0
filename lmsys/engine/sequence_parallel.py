"""Ulysses sequence parallelism (`trainer.sequence_parallel=P`), applied to the single-device model
from outside, like ZeRO (lmsys.engine.zero calls it before torch.compile and DeepSpeed).

The ranks form groups of P consecutive ranks (DeepSpeed's layout: its ALST module
`parallel_state_sp`, which `deepspeed.initialize` takes as its `mpu`). The ranks of a group read
the same sequences; rank i of a group holds positions [i T/P, (i+1) T/P) of each of them
(`SequenceShard`): its embeddings, norms, feed-forward layers and its part of the loss. Around
each layer's attention DeepSpeed's `DistributedAttention` exchanges the queries, keys and values
with one all-to-all each (scatter the heads, gather the sequence), so each rank attends over the
whole sequence with H/P query heads, through lmsys's own attention (the Triton kernel or the torch
reference, documents included), and a fourth all-to-all gives each rank its positions of every
head back. Positions are global (`row_part_span`): a rank's tokens stand where they stand in the
whole sequence, and their documents reach the attention whole.

Grouped-query attention: Hkv key/value heads are split among the P ranks when P divides Hkv (rank
i's query heads read exactly its key/value heads), and when Hkv divides P each is copied to the
P / Hkv ranks whose query heads read it, before the exchange (as ALST does); other counts are
refused by the configuration (lmsys.core.model_config.validate_sequence_parallel).

ZeRO: the sequence-data-parallel group (every rank) is what ZeRO partitions over and reduces the
gradients in; each rank holds the gradient of its part of the loss, and the sum over the ranks is
the whole gradient. DeepSpeed divides that sum by the W/P groups at ZeRO 0-2 and in ZeRO-3's
contiguous all-reduce, but by all W ranks in ZeRO-3's coalesced reduce-scatter (its default
path): `averaged_ranks` says which, ZeRO-3 is kept on the reduce-scatter (lmsys.engine.zero), and
the trainer weighs each rank's micro-batch loss by its share of the step's loss weights times that
count, so the gradient is that of the step's global weighted mean loss either way.

`deepspeed` is imported inside the functions that use it (lmsys.engine.zero's docstring says why).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from lmsys.core.config import ModelConfig, model_dims
from lmsys.core.runtime import BatchSplit, SequenceShard
from lmsys.model.kv_cache import row_part_span
from lmsys.model.transformer import Transformer, next_token_documents, next_token_pairs


def averaged_ranks(stage: int, batch: BatchSplit) -> int:
    """How many ranks' micro-batch gradients DeepSpeed averages the summed gradient over: every
    rank without sequence parallelism and at ZeRO-3 (its coalesced reduce-scatter divides by the
    whole sequence-data-parallel group), the W/P groups at ZeRO 0-2 (it divides by the data-parallel
    size, each group's ranks summed)."""
    return batch.world_size if stage == 3 else batch.data_parallel


def exchanged_elements(cfg: ModelConfig, tokens: int, size: int) -> int:
    """Elements one rank's all-to-alls move for one layer's forward, `tokens` its positions (the
    backward moves as much again, a recomputed forward once more): the queries, keys, values and
    output of its positions, max(Hkv, P) key/value heads when they are copied; (P - 1) / P of it
    leaves the rank and as much arrives. 0 without sequence parallelism. What a plan adds to the
    step time (at the all-to-all bandwidth, not overlapped with compute)."""
    if size == 1:
        return 0
    dims = model_dims(cfg)
    kv_heads = max(dims.n_kv_heads, size)
    per_token = cfg.n_heads * (dims.d_qk + dims.d_vo) + kv_heads * (dims.d_qk + dims.d_vo)
    return tokens * per_token * (size - 1) // size


def sequence_parallel_groups(size: int) -> Any | None:
    """DeepSpeed's sequence-parallel groups of `size` consecutive ranks, as the `mpu` that
    deepspeed.initialize takes (every rank calls it: it forms process groups). None for size 1,
    and DeepSpeed's process-wide groups then forget those of an earlier job of a sweep."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp  # late: the module docstring
    from deepspeed.utils import groups

    if size == 1:
        groups.mpu = None  # set by the engine of an earlier sequence-parallel job in this process
        return None
    try:
        if parallel_state_sp.get_sequence_parallel_world_size() == size:
            return parallel_state_sp  # a sweep's earlier job formed them
        parallel_state_sp._release_sequence_parallel_groups()
    except AssertionError:  # not formed yet
        pass
    parallel_state_sp.initialize_sequence_parallel(size)
    return parallel_state_sp


class LocalExchange(nn.Module):
    """What DistributedAttention does to one rank's tensors, without the other ranks, for a plan
    traced on fake tensors (lmsys-plan): the same reshapes and copies around each all-to-all
    (batch-first, scatter the heads and gather the sequence, then back), the all-to-all itself a
    copy of its input. The shapes and allocations are a rank's; the values are not."""

    def __init__(self, local_attention: Any, size: int) -> None:
        super().__init__()
        self.local_attention, self.size = local_attention, size

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:  # (B, T/P, heads, d) -> (B, T, heads/P, d)
        b, t, heads, d = x.shape
        p = self.size
        sent = (
            x.reshape(b, t, p, heads // p, d).permute(2, 0, 1, 3, 4).contiguous()
        )  # (P, B, T/P, heads/P, d)
        received = torch.empty_like(sent).copy_(sent)  # the all-to-all
        return received.permute(1, 0, 2, 3, 4).contiguous().reshape(b, p * t, heads // p, d)

    def scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, heads/P, d) -> (B, T/P, heads, d)
        b, t, heads, d = x.shape
        p = self.size
        sent = (
            x.reshape(b, p, t // p, heads, d).permute(1, 0, 2, 3, 4).contiguous()
        )  # (P, B, T/P, heads/P, d)
        received = torch.empty_like(sent).copy_(sent)  # the all-to-all
        return received.permute(1, 2, 0, 3, 4).contiguous().reshape(b, t // p, p * heads, d)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int, **kwargs: Any
    ) -> torch.Tensor:
        q, k, v = (self.gather_sequence(x) for x in (query, key, value))
        return self.scatter_sequence(self.local_attention(q, k, v, **kwargs))


class UlyssesAttention:
    """What one layer's `Attention.attend` becomes: DeepSpeed's DistributedAttention around the
    layer's own attention (or, for a plan, `LocalExchange`). Queries (B, H, T/P, d) in, this rank's
    positions of every head out."""

    def __init__(self, attend: Any, group: Any, n_heads: int, n_kv_heads: int, size: int = 0) -> None:
        self.attend = attend  # the layer's own (ops.attention with its settings)
        self.size = torch.distributed.get_world_size(group) if group is not None else size
        # copies of each key/value head when there are fewer than ranks (validated: Hkv divides P)
        self.kv_copies = self.size // n_kv_heads if n_kv_heads < self.size else 1
        self.n_heads = n_heads
        if group is None:
            self.exchange: nn.Module = LocalExchange(self.whole_sequence, self.size)
            return
        from deepspeed.sequence.layer import DistributedAttention  # late: the module docstring

        # batch-first layout (B, T, heads, d): gather the sequence (dim 1), scatter the heads (dim 2)
        self.exchange = DistributedAttention(self.whole_sequence, group, scatter_idx=2, gather_idx=1)

    def whole_sequence(
        self,
        q: torch.Tensor,  # (B, T, H/P, d_qk)
        k: torch.Tensor,  # (B, T, Hkv/P or 1, d_qk)
        v: torch.Tensor,  # (B, T, Hkv/P or 1, d_vo)
        documents: torch.Tensor | None = None,  # (B, T) the whole rows' documents
    ) -> torch.Tensor:  # (B, T, H/P, d_vo)
        heads = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), documents=documents)
        return heads.transpose(1, 2)

    def __call__(
        self,
        q: torch.Tensor,  # (B, H, T/P, d_qk)
        k: torch.Tensor,  # (B, Hkv, T/P, d_qk)
        v: torch.Tensor,  # (B, Hkv, T/P, d_vo)
        key_mask: torch.Tensor | None = None,
        query_slots: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,  # (B, T) the whole rows' documents
    ) -> torch.Tensor:  # (B, H, T/P, d_vo)
        if key_mask is not None or query_slots is not None:
            raise ValueError("sequence-parallel attention takes whole rows: no padding mask and no KV cache")
        if self.kv_copies > 1:  # head j goes to ranks j*c .. (j+1)*c - 1, whose query heads read it
            k = k.repeat_interleave(self.kv_copies, dim=1)  # (B, P, T/P, d_qk)
            v = v.repeat_interleave(self.kv_copies, dim=1)  # (B, P, T/P, d_vo)
        heads = self.exchange(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, documents=documents
        )  # (B, T/P, H, d_vo)
        return heads.transpose(1, 2)


class SequenceShardedLoss(nn.Module):
    """The engine's module under sequence parallelism (lmsys.engine.zero.LossModule's place, the
    model's parameters under `model.` as there): whole rows in (every rank of a group gets its
    group's), this rank's part of the loss out: the next-token pairs of the whole rows, then this
    rank's positions of them, standing where they stand in the rows."""

    def __init__(self, model: Transformer, shard: SequenceShard) -> None:
        super().__init__()
        self.model, self.shard = model, shard

    def forward(
        self,
        tokens: torch.Tensor,  # (B, S) whole rows
        weights: torch.Tensor | None = None,  # (B, S)
        documents: torch.Tensor | None = None,  # (B, S)
    ) -> torch.Tensor:  # 0-dim: the weighted mean loss of this rank's positions
        model, part = self.model, self.shard.part
        inputs, targets, target_weights = next_token_pairs(model.cfg, tokens, weights, documents)  # (B, T)
        length = inputs.shape[1]
        span = row_part_span(
            self.shard.start(length), length // self.shard.size, next_token_documents(model.cfg, documents)
        )
        hidden = model.span_states(part(inputs), span)  # (B, T/P, D)
        return model.unembed(hidden, part(targets), None if target_weights is None else part(target_weights))


def shard_sequences(
    model: nn.Module, cfg: ModelConfig, shard: SequenceShard, unit: Any | None
) -> SequenceShardedLoss:
    """Wrap every layer's attention in the exchange of `unit`'s sequence-parallel group
    (sequence_parallel_groups'; None: a plan's LocalExchange of shard.size ranks) and return the
    module that computes this rank's part of the loss."""
    if not isinstance(model, Transformer):
        raise TypeError("sequence parallelism needs lmsys's Transformer")
    group = None
    if unit is not None:
        group = unit.get_sequence_parallel_group()
        place = torch.distributed.get_rank(group)
        if place != shard.index:
            raise RuntimeError(
                f"DeepSpeed placed rank {torch.distributed.get_rank()} at {place} of its "
                f"sequence-parallel group, where lmsys expects {shard.index}"
            )
    n_kv_heads = model_dims(cfg).n_kv_heads
    for block in model.blocks:
        attention = block.attn
        attention.attend = UlyssesAttention(attention.attend, group, cfg.n_heads, n_kv_heads, shard.size)
    return SequenceShardedLoss(model, shard)
