"""The KV caches of generation and scoring: keys and values of every layer for the positions
already processed, so a new token costs one position's forward instead of the whole prefix.

Two caches with one protocol, which is all the model (lmsys/model/transformer.py) knows of them:
`begin(mask, t)` reserves the slots of the next t tokens and says what they attend to and where
they stand (a CacheSpan), `store(layer, k, v)` writes a layer's keys and values there and returns
every key and value to attend over, `advance(t)` closes the step, and `query_slots` places the new
tokens among those keys. KVCache grows a view of its slots as tokens arrive (eager: attention
reads only the filled slots); StaticKVCache keeps every shape fixed and its next slot in a tensor,
so that torch.compile compiles one decode step for every token (lmsys/model/compiling.py).

Shapes: B batch, H key/value heads (model.attention.n_kv_heads under grouped-query attention), t new
tokens; keys (B, H, slots, d_qk), values (B, H, slots, d_vo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmsys.core.config import ModelConfig, model_dims


@dataclass
class CacheSpan:
    """What the next t tokens of a forward attend to and where they stand."""

    start: int  # the first token's slot (a contiguous, unpadded batch reads P[start : start + t])
    key_mask: torch.Tensor | None  # (B, Tk) bool over the keys store() returns, False where hidden
    row_positions: torch.Tensor | None  # (B, t) each token's position in its row; None: start + i
    clamped: bool = False  # positions past the table are clamped, not refused (StaticKVCache)
    documents: torch.Tensor | None = None  # (B, t) document ids of packed rows (document_span)


def uncached_span(mask: torch.Tensor | None, t: int) -> CacheSpan:
    """A forward without a cache: the keys are the t tokens themselves."""
    return CacheSpan(0, mask, _row_positions(mask, t))


def document_span(documents: torch.Tensor) -> CacheSpan:
    """A forward without a cache over rows packed with documents (B, t): each token attends to
    its own document only, and its position counts from its document's first token. Those
    positions are below t, so once the caller has checked t against the table they need no
    check of their own (`clamped`: none that reads them back, which would break a compiled graph)."""
    return CacheSpan(0, None, document_positions(documents), clamped=True, documents=documents)


def row_part_span(start: int, t: int, documents: torch.Tensor | None = None) -> CacheSpan:
    """t tokens that stand at positions start .. start + t - 1 of longer rows (sequence parallelism:
    each rank holds a part of every row). With the whole rows' `documents` (B, T) their positions
    count from their document's first token, and the documents reach attention whole: an attention
    that reads the whole rows' keys (lmsys.engine.sequence_parallel gathers them) masks by them."""
    if documents is None:
        return CacheSpan(start, None, None)
    positions = document_positions(documents)[:, start : start + t]  # (B, t)
    return CacheSpan(start, None, positions, clamped=True, documents=documents)


def document_positions(documents: torch.Tensor) -> torch.Tensor:  # (B, t) -> (B, t)
    """Each token's position in its document: its index minus the index of its document's first
    token (a row's first token starts a document; documents are contiguous runs of one id)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)  # (B, t)
    first = torch.where(document_starts(documents), index, 0).cummax(dim=1).values  # (B, t)
    return index - first  # first: the index of each token's document's first token


def document_starts(documents: torch.Tensor) -> torch.Tensor:  # (B, t) -> (B, t) bool
    """True at each document's first token (a row's first token included)."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return starts


def _row_positions(key_mask: torch.Tensor | None, t: int) -> torch.Tensor | None:  # (B, t) or None
    """Each of the last t slots' position in its row: the real tokens before it (padding before a
    row's first token counts as position 0; it is never attended to)."""
    if key_mask is None:
        return None
    return (key_mask.cumsum(1)[:, -t:] - 1).clamp_min(0)


@dataclass
class KVCache:
    """Keys and values of every layer for the positions already processed (generation).

    Preallocated to `max_len`, so appending a token costs one write per layer and attention over
    the cache is O(T) per new token instead of recomputing the whole prefix. Every row has the
    same number of slots; in a padded batch `real` marks the slots that hold a token.
    """

    keys: list[torch.Tensor]  # n_layers x (B, H, max_len, d_qk)
    values: list[torch.Tensor]  # n_layers x (B, H, max_len, d_vo)
    length: int = 0  # slots filled
    real: torch.Tensor | None = None  # (B, max_len) bool, False at padding; None while no slot was padding

    @classmethod
    def empty(
        cls, cfg: ModelConfig, batch: int, max_len: int, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        return cls(*_empty_layers(cfg, batch, max_len, device, dtype))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def begin(self, mask: torch.Tensor | None, t: int) -> CacheSpan:
        """Reserve the next t slots (mask (B, t), False at padding; None: all real)."""
        if self.length + t > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot take {self.length + t}")
        key_mask = self.track_padding(mask, t)
        return CacheSpan(self.length, key_mask, _row_positions(key_mask, t))

    @property
    def query_slots(self) -> None:
        """The new tokens are the last of the keys store() returns (ops.attention's default)."""
        return None

    def track_padding(self, mask: torch.Tensor | None, t: int) -> torch.Tensor | None:
        """Record which of the next t slots hold a token (mask (B, t), None: all of them) and
        return the mask of every slot up to them (B, length + t), or None while none is padding."""
        if mask is None and self.real is None:
            return None
        if self.real is None:
            batch, device = self.keys[0].shape[0], self.keys[0].device
            self.real = torch.ones(batch, self.capacity, dtype=torch.bool, device=device)
        end = self.length + t
        self.real[:, self.length : end] = True if mask is None else mask
        return self.real[:, :end]

    def store(
        self,
        layer: int,
        k: torch.Tensor,  # (B, H, t, d_qk)
        v: torch.Tensor,  # (B, H, t, d_vo)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (B, H, length + t, d_qk), (B, H, length + t, d_vo)
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, t: int) -> None:
        self.length += t

    def select(self, rows: torch.Tensor) -> KVCache:
        """The cache of batch rows `rows` (B',), in that order, repeats allowed: drops the rows that
        finished generating, or gives one context to each of its continuations."""
        return KVCache(
            keys=[k.index_select(0, rows) for k in self.keys],
            values=[v.index_select(0, rows) for v in self.values],
            length=self.length,
            real=None if self.real is None else self.real.index_select(0, rows),
        )


@dataclass
class StaticKVCache:
    """A KV cache whose tensors never change shape, for a compiled decode step (torch.compile).

    KVCache slices its slots with a Python int that grows by one per token, which a compiled
    graph would specialise on (a recompilation per token). Here the next slot is a 0-dim tensor,
    keys and values are written with index_copy_, attention reads every one of the `capacity`
    slots, and the key mask hides the slots not filled yet and the padding: every decode step
    has the same shapes, so one graph serves them all. Attention costs O(capacity) per token
    instead of O(length): size the cache to the work (lmsys.generate rounds it up to a power of
    two). Positions past the model's table (a finished row that stays in the batch so the shapes
    do not change) read its last row: such a row's outputs are never used.
    """

    keys: list[torch.Tensor]  # n_layers x (B, H, capacity, d_qk)
    values: list[torch.Tensor]  # n_layers x (B, H, capacity, d_vo)
    real: torch.Tensor  # (B, capacity) bool: False at padding (slots not written yet are True)
    slot: torch.Tensor  # () long: the next free slot
    pending: torch.Tensor | None = None  # (t,) the slots begin() reserved for this forward

    @classmethod
    def empty(
        cls, cfg: ModelConfig, batch: int, capacity: int, device: torch.device, dtype: torch.dtype
    ) -> StaticKVCache:
        keys, values = _empty_layers(cfg, batch, capacity, device, dtype)
        real = torch.ones(batch, capacity, dtype=torch.bool, device=device)
        return cls(keys, values, real, torch.zeros((), dtype=torch.long, device=device))

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def begin(self, mask: torch.Tensor | None, t: int) -> CacheSpan:
        """Reserve the next t slots (mask (B, t), False at padding; None: all real). No check
        that they fit: that would read the slot back from the device (lmsys.generate sizes it)."""
        slots = self.slot + torch.arange(t, device=self.slot.device)  # (t,)
        self.pending = slots
        if mask is not None:
            self.real.index_copy_(1, slots, mask)
        every = torch.arange(self.capacity, device=self.slot.device)  # (capacity,)
        key_mask = self.real & (every < self.slot + t)  # (B, capacity): filled and real
        row_positions = (key_mask.cumsum(1).index_select(1, slots) - 1).clamp_min(0)  # (B, t)
        return CacheSpan(0, key_mask, row_positions, clamped=True)

    @property
    def query_slots(self) -> torch.Tensor | None:  # (t,)
        """The new tokens' slots among the `capacity` keys store() returns."""
        return self.pending

    def store(
        self,
        layer: int,
        k: torch.Tensor,  # (B, H, t, d_qk)
        v: torch.Tensor,  # (B, H, t, d_vo)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (B, H, capacity, d_qk), (B, H, capacity, d_vo)
        assert self.pending is not None, "StaticKVCache.store before begin"
        self.keys[layer].index_copy_(2, self.pending, k)
        self.values[layer].index_copy_(2, self.pending, v)
        return self.keys[layer], self.values[layer]

    def advance(self, t: int) -> None:
        self.slot.add_(t)
        self.pending = None


def _empty_layers(
    cfg: ModelConfig, batch: int, slots: int, device: torch.device, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed keys and values of every layer: n_layers x (B, H, slots, d_qk) and (B, H, slots, d_vo),
    H the key/value heads."""
    dims = model_dims(cfg)
    h = dims.n_kv_heads

    def zeros(width: int) -> list[torch.Tensor]:
        return [torch.zeros(batch, h, slots, width, device=device, dtype=dtype) for _ in range(cfg.n_layers)]

    return zeros(dims.d_qk), zeros(dims.d_vo)
