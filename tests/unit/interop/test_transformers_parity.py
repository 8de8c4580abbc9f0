"""lmsys computes what transformers computes, for each of Llama (llama3 rope scaling), Qwen2, Qwen3
and Mistral (tests/fixtures/family.py): the lmsys-import of a transformers checkpoint gives its fp32
logits to 1e-5 relative, alone and in a batch padded on the left; and greedy generation of 32
tokens gives transformers' tokens for one prompt (cached, uncached, and through the static cache of
the compiled decode step) and for a batch of prompts of different lengths padded on the left."""

from __future__ import annotations

import pytest
import torch

from lmsys.inference.generation import generate
from lmsys.interop.export_dir import load_export
from tests.fixtures.family import CONTEXT, FAMILIES, PIECES

EOS = PIECES - 1
NEW_TOKENS = 32
RTOL = 1e-5  # of the largest logit; measured 0 on CPU (the same operations in the same order)


@pytest.fixture(scope="module")
def models(hf_family, family_imports, transformers) -> dict:
    """model_type -> (transformers' model from its directory, lmsys's model from the import)."""
    auto = transformers.AutoModelForCausalLM
    return {
        t: (auto.from_pretrained(hf_family[t]).eval(), load_export(family_imports[t])[0]) for t in FAMILIES
    }


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_logits_equal_transformers(models, family):
    theirs, ours = models[family]
    ids = torch.randint(0, PIECES, (3, CONTEXT), generator=torch.Generator().manual_seed(1))
    want, got = theirs(ids).logits, ours(ids)
    assert got.shape == want.shape == (3, CONTEXT, theirs.config.vocab_size)  # padded rows included
    error = _relative_error(got, want)
    print(f"{family}: largest logit error {error:.3g} of the largest logit")
    assert error <= RTOL
    # a batch padded on the left: each row numbered from its first token (transformers is given
    # those positions; its generate derives them so), padding never attended to
    lengths = torch.tensor([CONTEXT, CONTEXT - 9, 5])
    mask = torch.arange(CONTEXT)[None, :] >= (CONTEXT - lengths)[:, None]  # (3, T), False at padding
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    want = theirs(ids, attention_mask=mask.long(), position_ids=positions).logits
    got = ours(ids, mask=mask)
    assert _relative_error(got[mask], want[mask]) <= RTOL


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of prompts padded on the left, each cut at its eos."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), EOS, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )[:, width:]
    new = []
    for row in out.tolist():
        new.append(row[: row.index(EOS)] if EOS in row else row)
    return new


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers(models, family):
    theirs, ours = models[family]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, EOS, (n,), generator=g).tolist() for n in (12, 5, 9)]
    alone = [_hf_greedy(theirs, [p])[0] for p in prompts]
    assert alone[0] and all(len(row) <= NEW_TOKENS for row in alone)
    for options in ({"use_cache": True}, {"use_cache": False}, {"static_cache": True}):
        got = generate(ours, prompts[:1], NEW_TOKENS, greedy=True, eos_id=EOS, **options)
        assert got == alone[:1], options
    # the three prompts as one batch padded on the left, here and in transformers
    batched = _hf_greedy(theirs, prompts)
    assert batched == alone
    for options in ({"use_cache": True}, {"static_cache": True}):
        got = generate(ours, prompts, NEW_TOKENS, greedy=True, eos_id=EOS, batch_size=3, **options)
        assert got == alone, options
