"""lmsys-generate in process: KV cache == no cache, seeded sampling, top-k / top-p, eos, batches,
the context window, streaming."""

from __future__ import annotations

import io

import pytest
import torch

from lmsys.generate import TextStream
from lmsys.inference.generation import (
    GenerationError,
    Sampling,
    filter_logits,
    fit_prompt,
    generate,
    generate_one,
    next_token,
    prompt_ids,
)
from lmsys.model.transformer import Transformer
from tests.fixtures.exports import SEQ, VOCAB, small_config


def _model(preset: str = "tiny", extra: list[str] | None = None, seed: int = 0):
    """A random-weight small model."""
    torch.manual_seed(seed)
    return Transformer(small_config(preset, extra)).eval()


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------- the KV cache


@pytest.mark.parametrize(
    "preset,extra",
    [("tiny", []), ("seed_trax", []), ("seed_postln", []), ("seed_gpt", []),
     ("seed_compact", ["attention.d_qk=8", "attention.d_vo=12"])],
    ids=["tiny", "seed_trax", "seed_postln", "seed_gpt", "seed_compact"],
)  # fmt: skip
def test_cached_and_uncached_generation_give_the_same_tokens(preset, extra):
    model = _model(preset, extra)
    prompt, n_new = fit_prompt(_prompt(5), model.cfg, SEQ, warn=lambda m: None)  # fills the context window
    greedy = Sampling(greedy=True)
    sampled = Sampling(temperature=0.9, top_k=50, top_p=0.95)
    for sampling in (greedy, sampled):
        cached = generate_one(model, prompt, n_new, sampling, None, 7, use_cache=True)
        uncached = generate_one(model, prompt, n_new, sampling, None, 7, use_cache=False)
        assert cached == uncached
        assert len(cached) == n_new
    assert len(set(cached)) > n_new // 2  # sampled: many different tokens, each position compared


def test_the_cache_is_what_is_used(monkeypatch):
    """With the cache each new token is a one-position forward; without it the whole prefix."""
    model = _model()
    lengths = []
    real_forward = model.forward

    def spy(ids, cache=None, mask=None):
        lengths.append(ids.shape[1])
        return real_forward(ids, cache, mask)

    monkeypatch.setattr(model, "forward", spy)
    prompt = _prompt(6)
    generate_one(model, prompt, 5, Sampling(greedy=True), use_cache=True)
    assert lengths == [6, 1, 1, 1, 1]
    lengths.clear()
    generate_one(model, prompt, 5, Sampling(greedy=True), use_cache=False)
    assert lengths == [6, 7, 8, 9, 10]


def test_models_that_cannot_cache_fall_back_to_full_forwards():
    model = _model("seed_compact", ["attention.causal=false"])
    prompt = _prompt(4)
    a = generate_one(model, prompt, 6, Sampling(greedy=True), use_cache=True)
    b = generate_one(model, prompt, 6, Sampling(greedy=True), use_cache=False)
    assert a == b and len(a) == 6


# ----------------------------------------------------------------------------- sampling


def test_sampling_is_reproducible_with_a_seed():
    model = _model()
    prompt = _prompt(4)
    sampling = Sampling(temperature=1.0)
    first = generate_one(model, prompt, 20, sampling, seed=3)
    assert generate_one(model, prompt, 20, sampling, seed=3) == first
    others = [generate_one(model, prompt, 20, sampling, seed=s) for s in (4, 5, 6)]
    assert any(o != first for o in others)
    greedy = generate_one(model, prompt, 20, Sampling(greedy=True))
    assert generate_one(model, prompt, 20, Sampling(temperature=0.0), seed=99) == greedy  # temperature 0


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, **kw)).nonzero().flatten().tolist()  # noqa: E731
    assert kept() == [0, 1, 2, 3]
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.45) == [0]  # the most likely token always stays
    assert kept(top_p=0.7) == [0, 1]  # the smallest set whose mass reaches top_p
    assert kept(top_p=0.85) == [0, 1, 2]
    assert kept(top_k=3, top_p=0.9) == [0, 1, 2]  # top-p on the renormalised top-3: 0.53, 0.84, 1
    assert kept(top_k=3, top_p=0.8) == [0, 1]
    shuffled = logits[[2, 0, 3, 1]]  # order does not matter
    assert torch.isfinite(filter_logits(shuffled, top_k=2)).nonzero().flatten().tolist() == [1, 3]


def test_sampled_frequencies_follow_the_filtered_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs)
    g = torch.Generator().manual_seed(0)
    n = 2000  # a fixed seed: the counts are the same every run
    counts = torch.bincount(torch.tensor([next_token(logits, Sampling(), g) for _ in range(n)]), minlength=4)
    assert torch.allclose(counts / n, probs, atol=0.035), counts
    top2 = torch.bincount(
        torch.tensor([next_token(logits, Sampling(top_k=2), g) for _ in range(n)]), minlength=4
    )
    assert top2[2:].sum() == 0 and abs(top2[0] / n - 0.5 / 0.8) < 0.035, top2
    hot = torch.bincount(
        torch.tensor([next_token(logits, Sampling(temperature=0.5), g) for _ in range(n)]), minlength=4
    )
    want = torch.softmax(logits / 0.5, dim=-1)
    assert torch.allclose(hot / n, want, atol=0.035), (hot, want)


def test_bad_sampling_values_are_refused():
    for kwargs, match in [({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"),
                          ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")]:  # fmt: skip
        with pytest.raises(GenerationError, match=match):
            Sampling(**kwargs).check()


# ----------------------------------------------------------------------------- stopping, batches


def test_generation_stops_at_eos():
    model = _model()
    prompt = _prompt(4)
    free = generate_one(model, prompt, 12, Sampling(), seed=1, eos_id=None)
    stop = free[5]  # pretend the sixth new token is eos
    cut = generate_one(model, prompt, 12, Sampling(), seed=1, eos_id=stop)
    assert cut == free[: free.index(stop)] and stop not in cut and len(cut) > 0


def test_a_batch_gives_each_prompt_what_it_gives_alone():
    model = _model()
    prompts = [_prompt(3, 1), _prompt(9, 2), _prompt(5, 3)]
    kwargs = {"temperature": 0.8, "top_p": 0.9, "seed": 11}
    batch = generate(model, prompts, 10, **kwargs)
    assert batch == [generate(model, [p], 10, **kwargs)[0] for p in prompts]
    assert len({tuple(b) for b in batch}) == 3
    tensor_batch = generate(model, torch.tensor([prompts[0], _prompt(3, 4)]), 10, **kwargs)
    assert tensor_batch[0] == batch[0]


# ----------------------------------------------------------------------------- the context window


def test_a_long_prompt_is_refused_or_truncated_from_the_left():
    cfg = small_config()
    long = _prompt(SEQ + 10)
    with pytest.raises(GenerationError, match=r"42 tokens.*max_seq_len=32.*on_long_prompt=truncate"):
        fit_prompt(long, cfg, 5, "error")
    warnings: list[str] = []
    ids, n_new = fit_prompt(long, cfg, 5, "truncate", warnings.append)
    assert ids == long[-(SEQ + 1 - 5) :] and n_new == 5  # room for the 5 new tokens
    assert len(warnings) == 1 and "kept its last 28" in warnings[0]
    ids, n_new = fit_prompt(long, cfg, 100, "truncate", warnings.append)
    assert ids == long[-(SEQ // 2) :] and n_new == SEQ + 1 - SEQ // 2  # at least half the window kept
    with pytest.raises(GenerationError, match="empty"):
        fit_prompt([], cfg, 5)


def test_new_tokens_are_capped_to_the_window():
    model = _model()
    warnings: list[str] = []
    out = generate(model, [_prompt(30)], 50, greedy=True, warn=warnings.append)[0]
    assert len(out) == SEQ + 1 - 30  # the last new token is never fed back
    assert len(warnings) == 1 and "capped to 3" in warnings[0]


def test_bos_shift_models_get_their_start_token():
    cfg = small_config("seed_trax")
    assert cfg.bos_shift
    ids, n_new = fit_prompt([5, 6, 7], cfg, 100, warn=lambda m: None)
    assert ids == [cfg.bos_shift_id, 5, 6, 7] and n_new == SEQ + 1 - 4
    with pytest.raises(GenerationError, match=r"more than the model's context window allows \(31 of"):
        fit_prompt(_prompt(SEQ), cfg, 1)


def test_prompts_start_a_document(tokenizer_path):
    from lmsys.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_path)
    assert prompt_ids(tok, "Return the") == [tok.eos_id, *tok.encode("Return the")]
    assert prompt_ids(tok, "Return the", start_of_document=False) == tok.encode("Return the")


# ----------------------------------------------------------------------------- streaming


class _Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[str] = []

    def write(self, s: str) -> int:
        self.chunks.append(s)
        return super().write(s)


def test_stream_prints_text_as_tokens_arrive_and_keeps_characters_whole(tokenizer_path):
    from lmsys.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_path)
    text = "Return a new list. \U0001f642 done"  # the emoji is 4 byte-fallback tokens
    ids = tok.encode(text)
    out = _Writes()
    stream = TextStream(tok, out)
    for i in ids:
        stream(i)
    stream.finish()
    assert out.getvalue() == text
    assert len(out.chunks) > 3  # incremental, not one write at the end
    assert not any("\ufffd" in c for c in out.chunks)  # a half character is never printed


def test_generation_from_an_export_matches_the_model(random_export):
    """load_export + generate gives what the in-memory model gives (export is lossless)."""
    from lmsys.interop.export_dir import load_export

    model, tok, _ = load_export(random_export)
    torch.manual_seed(0)
    original = Transformer(small_config()).eval()  # the random_export fixture's weights
    prompt = prompt_ids(tok, "Return the")
    a = generate(model, [prompt], 8, temperature=1.0, seed=2)
    b = generate(original, [prompt], 8, temperature=1.0, seed=2)
    assert a == b and len(a[0]) == 8
