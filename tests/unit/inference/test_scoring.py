"""lmsys.inference.scoring: continuation log-likelihoods, batched, a shared context run once through the KV
cache, against a plain forward of each sequence alone."""

from __future__ import annotations

import math

import pytest
import torch

from lmsys.inference.scoring import loglikelihoods
from lmsys.model.transformer import Transformer, next_token_pairs
from tests.fixtures.exports import SEQ, VOCAB, small_config


def _model(preset: str, extra: list[str] | None = None):
    torch.manual_seed(0)
    return Transformer(small_config(preset, extra)).eval()


def _ids(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=g).tolist()


@torch.inference_mode()
def _alone(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log p(continuation | context) from one forward of the whole sequence, under the model's
    objective (next_token_pairs), and whether each continuation token is the argmax."""
    inputs, targets, _ = next_token_pairs(model.cfg, torch.tensor([context + continuation]))
    logp = torch.log_softmax(model(inputs)[0].double(), dim=-1)[-len(continuation) :]  # (n, V)
    wanted = targets[0, -len(continuation) :]
    return float(logp.gather(-1, wanted[:, None]).sum()), bool((logp.argmax(-1) == wanted).all())


def _pairs(model, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """Shared and distinct contexts of 1 to 20 tokens, continuations of 1 to 11 tokens, two
    continuations that are greedy decoding's, and (bos_shift) an empty context."""
    g = torch.Generator().manual_seed(seed)
    contexts = [_ids(n, g) for n in (3, 20, 1, 9)]
    pairs = [(contexts[0], _ids(1, g)), (contexts[0], _ids(4, g)), (contexts[1], _ids(2, g)),
             (contexts[2], _ids(7, g)), (contexts[3], _ids(1, g)), (contexts[1], _ids(11, g))]  # fmt: skip
    for context in contexts[:2]:
        greedy = list(context)
        for _ in range(3):
            inputs, _, _ = next_token_pairs(model.cfg, torch.tensor([greedy + [0]]))
            greedy.append(int(model(inputs)[0, -1].argmax()))
        pairs.append((context, greedy[len(context) :]))
    if model.cfg.bos_shift:
        pairs.append(([], _ids(5, g)))
    return pairs


@pytest.mark.parametrize(
    "preset,extra",
    [("tiny", []), ("seed_trax", []), ("seed_compact", ["attention.causal=false"])],
    ids=["tiny", "seed_trax_bos_shift", "non_causal"],
)
@torch.inference_mode()
def test_loglikelihoods_equal_each_sequence_alone(preset, extra):
    model = _model(preset, extra)
    pairs = _pairs(model)
    for batch_size in (1, 3, 64):
        got = loglikelihoods(model, pairs, batch_size)
        for (context, continuation), (logprob, greedy) in zip(pairs, got, strict=True):
            want, want_greedy = _alone(model, context, continuation)
            assert math.isclose(logprob, want, rel_tol=1e-5, abs_tol=1e-5), (context, continuation)
            assert greedy == want_greedy
    assert got[6][1] and got[7][1]  # the greedy continuations
    assert not all(greedy for _, greedy in got)


@torch.inference_mode()
def test_a_context_runs_once_for_all_its_continuations(monkeypatch):
    """Four choices of one question: one forward of the context (its tokens once), one forward of
    the four continuations from copies of its cache rows."""
    model = _model("tiny")
    g = torch.Generator().manual_seed(2)
    question = _ids(20, g)
    pairs = [(question, _ids(n, g)) for n in (2, 5, 1, 3)]
    shapes = []
    real_forward = model.forward

    def spy(ids, cache=None, mask=None):
        shapes.append(tuple(ids.shape))
        return real_forward(ids, cache, mask)

    monkeypatch.setattr(model, "forward", spy)
    loglikelihoods(model, pairs, batch_size=8)
    assert shapes == [(1, 20), (4, 4)]  # the context once; continuations minus their last token


def test_sequences_longer_than_the_window_are_refused():
    model = _model("tiny")
    with pytest.raises(ValueError, match=r"more than model.max_seq_len=32"):
        loglikelihoods(model, [(list(range(4, 4 + SEQ)), [5, 6])])
    with pytest.raises(ValueError, match="at least one token"):
        loglikelihoods(model, [([4, 5], [])])
