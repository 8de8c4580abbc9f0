"""Log-likelihoods of continuations, batched, with a context shared through the KV cache.

    scores = loglikelihoods(model, [(context_ids, continuation_ids), ...], batch_size=8)
    # -> [(log p(continuation | context) in nats, whether greedy decoding gives it), ...]

The model's own objective decides what it reads: context + continuation is a token sequence in
the sense of lmsys.model.transformer.next_token_pairs, so a bos_shift model reads bos_shift_id first and
every other model predicts each token from the ones before it. The caller fits a pair to the
model's window (at most model.max_seq_len inputs: tokens_per_sample).

How it runs (lm-evaluation-harness asks for thousands of these, often several continuations of
one context, as in a multiple-choice question): the distinct contexts run in batches, padded on
the left, through a KV cache; each context's cache rows are then repeated for its continuations,
which run in one more forward, padded on the right. A context is computed once however many
continuations it has. Models whose earlier outputs depend on later tokens (lmsys.model.transformer
.autoregressive false) cannot share a context: each pair is then one plain forward. Batched
numbers equal each pair alone up to float rounding (README, "Generation").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmsys.core.config import autoregressive
from lmsys.model.kv_cache import KVCache
from lmsys.model.transformer import next_token_pairs

Pair = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)


def _model_inputs(cfg, context: Sequence[int], continuation: Sequence[int]) -> tuple[list[int], list[int]]:
    """(head, tail): the model's inputs for the pair, split where the continuation's predictions
    start. The head's last position predicts continuation[0]; the tail is continuation[:-1]."""
    if len(continuation) == 0:
        raise ValueError("a continuation to score needs at least one token")
    inputs, _, _ = next_token_pairs(cfg, torch.tensor([[*context, *continuation]]))
    inputs = inputs[0].tolist()
    if len(inputs) < len(continuation):
        raise ValueError(f"a context of {len(context)} tokens cannot predict the continuation's first token")
    window = None if cfg.positions.kind == "none" else cfg.max_seq_len
    if window is not None and len(inputs) > window:
        raise ValueError(
            f"context + continuation need {len(inputs)} inputs, more than model.max_seq_len={window}"
        )
    split = len(inputs) - len(continuation) + 1
    return inputs[:split], inputs[split:]


def _padded(rows: Sequence[Sequence[int]], left: bool, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ids (B, T), mask (B, T) False at padding, or None when every row is full); a row may be
    empty (all padding)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, cols] = torch.tensor(list(row), dtype=torch.long)
        mask[i, cols] = True
    return ids.to(device), (None if bool(mask.all()) else mask.to(device))


def _score(logits: torch.Tensor, targets: Sequence[int]) -> tuple[torch.Tensor, bool]:
    """(log-probabilities (n,) float64 of targets under logits (n, V), all of them the argmax)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    index = torch.tensor(list(targets), device=logits.device)
    picked = logp.gather(-1, index[:, None])[:, 0]  # (n,)
    greedy = bool((logp.argmax(dim=-1) == index).all())
    return picked.double().cpu(), greedy


@torch.inference_mode()
def loglikelihoods(model, pairs: Sequence[Pair], batch_size: int = 8) -> list[tuple[float, bool]]:
    """(log p(continuation | context) in nats, whether every continuation token is the argmax)
    for each (context, continuation) pair (module docstring)."""
    cfg = model.cfg
    device = next(model.parameters()).device
    split = [_model_inputs(cfg, context, continuation) for context, continuation in pairs]
    results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    if not autoregressive(cfg):  # no shared context: each pair on its own
        for i, (head, tail) in enumerate(split):
            logits = model(torch.tensor([head + tail], device=device))[0, len(head) - 1 :]  # (n, V)
            logp, greedy = _score(logits, pairs[i][1])
            results[i] = (float(logp.sum()), greedy)
        return results
    by_head: dict[tuple[int, ...], list[int]] = {}  # a context computed once for all its pairs
    for i, (head, _) in enumerate(split):
        by_head.setdefault(tuple(head), []).append(i)
    heads = sorted(by_head, key=len, reverse=True)  # similar lengths together: little padding
    for start in range(0, len(heads), batch_size):
        batch = heads[start : start + batch_size]
        members = [(b, i) for b, head in enumerate(batch) for i in by_head[head]]  # (head row, pair)
        first, rest = _forward_batch(model, batch, [split[i][1] for _, i in members], [b for b, _ in members])
        for row, (b, i) in enumerate(members):
            continuation = list(pairs[i][1])
            logits = torch.cat([first[b : b + 1], rest[row, : len(continuation) - 1]])  # (n, V)
            logp, greedy = _score(logits, continuation)
            results[i] = (float(logp.sum()), greedy)
    return results


def _forward_batch(
    model, heads: Sequence[Sequence[int]], tails: Sequence[Sequence[int]], head_rows: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B, V) of each head's last position, logits (N, T_tail, V) of each tail) for B
    distinct heads and N tails, tail r continuing head head_rows[r]: the heads left-padded
    through a KV cache, then the tails, right-padded, each from a copy of its head's cache rows."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    ids, mask = _padded(heads, left=True, device=device)  # (B, T)
    longest = max(len(t) for t in tails)
    cache = KVCache.empty(model.cfg, len(heads), ids.shape[1] + longest, device, dtype)
    first = model(ids, cache, mask)[:, -1]  # (B, V): each predicts its continuations' first token
    if longest == 0:  # one-token continuations only
        return first, first.new_empty(len(tails), 0, first.shape[-1])
    tail_ids, tail_mask = _padded(tails, left=False, device=device)  # (N, T_tail)
    rows = torch.tensor(list(head_rows), device=device)
    return first, model(tail_ids, cache.select(rows), tail_mask)  # (N, T_tail, V)
