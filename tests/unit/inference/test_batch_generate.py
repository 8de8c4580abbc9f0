"""Batched generation: a padded batch through one KV cache gives every prompt what it gives alone.

What is exact and what is not (README, "Generation"): padding keys get softmax weight exactly 0,
so the padding's content cannot change a bit of any real row (checked with torch.equal). The
real rows' logits equal the same rows alone up to float rounding only: a batched matrix product
or an attention over a longer (padded) key range may sum in another order (1e-7 here), so they
are compared with atol=1e-5. The tokens are compared exactly: a difference would need two
logits within that rounding of each other. Each property holds for both caches: KVCache (eager)
and StaticKVCache (fixed shapes, what a compiled model decodes through).
"""

from __future__ import annotations

import json

import pytest
import torch

from lmsys.inference.generation import Sampling, fit_prompt, generate, generate_batch, generate_one
from lmsys.model.kv_cache import KVCache, StaticKVCache
from lmsys.model.transformer import Transformer
from tests.fixtures.exports import SEQ, VOCAB, small_config

PRESETS = [("tiny", []), ("seed_trax", []), ("seed_postln", []), ("seed_gpt", []),
           ("seed_compact", ["attention.d_qk=8", "attention.d_vo=12"])]  # fmt: skip
PRESET_IDS = ["tiny", "seed_trax", "seed_postln", "seed_gpt", "seed_compact"]
LENGTHS = [1, 30, 5, 17, 2, 11]  # very different prompt lengths: up to 29 padding slots


def _model(preset: str = "tiny", extra: list[str] | None = None, seed: int = 0):
    torch.manual_seed(seed)
    return Transformer(small_config(preset, extra)).eval()


def _prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])  # (B, T)
    mask = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])  # (B, T)
    return ids, mask


CACHES = {"growing": KVCache, "static": StaticKVCache}


@pytest.mark.parametrize("cache_kind", list(CACHES))
@pytest.mark.parametrize("preset,extra", PRESETS, ids=PRESET_IDS)
@torch.inference_mode()
def test_a_padded_batch_computes_each_row_as_alone(preset, extra, cache_kind):
    """Prompt forward and 4 decoding steps through a KV cache: every real position's logits equal
    the row's own (unpadded, uncached) forward, with positions counted per row. The static cache
    has 3 slots to spare, never filled: its key mask must hide them."""
    model = _model(preset, extra)
    rows = _prompts([3, 17, 1, 9])
    ids, mask = _left_pad(rows)
    cache = CACHES[cache_kind].empty(model.cfg, len(rows), ids.shape[1] + 4 + 3, ids.device, torch.float32)
    prompt_logits = model(ids, cache, mask)  # (B, T, V)
    steps = _prompts([4, 4, 4, 4], seed=2)
    step_logits = [model(torch.tensor([[s[k]] for s in steps]), cache)[:, 0] for k in range(4)]  # 4 x (B, V)
    for b, row in enumerate(rows):
        alone = model(torch.tensor([row + steps[b]]))[0]  # (T_b + 4, V)
        torch.testing.assert_close(prompt_logits[b, mask[b]], alone[: len(row)], atol=1e-5, rtol=0)
        for k in range(4):
            torch.testing.assert_close(step_logits[k][b], alone[len(row) + k], atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset,extra", PRESETS[:2], ids=PRESET_IDS[:2])
@torch.inference_mode()
def test_padding_contributes_exactly_nothing(preset, extra):
    """Other padding tokens (other keys and values in the padded slots) leave every bit of the
    real positions' logits unchanged: a padding key's softmax weight is exactly 0."""
    model = _model(preset, extra)
    rows = _prompts([2, 12, 7])
    ids, mask = _left_pad(rows, pad_id=0)
    other = ids.masked_fill(~mask, 321)
    a, b = model(ids, mask=mask), model(other, mask=mask)
    assert torch.equal(a[mask], b[mask])
    assert not torch.equal(model(ids)[mask], model(other)[mask])  # without the mask they would leak


@pytest.mark.parametrize("static_cache", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("preset,extra", PRESETS, ids=PRESET_IDS)
def test_batched_generation_gives_each_prompt_its_tokens_alone(preset, extra, static_cache):
    """Greedy and sampled, each prompt filling the context window: 6 prompts of 1 to 30 tokens
    (seed_trax: plus its bos_shift_id) as one batch, then each alone (without the static cache).
    With it, rows that finish early stay in the batch past their window: their positions clamp."""
    model = _model(preset, extra)
    prompts = _prompts(LENGTHS)
    quiet = {"warn": lambda message: None}
    for sampling in ({"greedy": True}, {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 7}):
        batch = generate(
            model, prompts, SEQ, batch_size=len(prompts), **sampling, **quiet, static_cache=static_cache
        )
        alone = [generate(model, [p], SEQ, **sampling, **quiet)[0] for p in prompts]
        assert batch == alone
        room = [fit_prompt(p, model.cfg, SEQ, warn=lambda m: None)[1] for p in prompts]
        assert [len(b) for b in batch] == room  # every row ran to the end of its window
    assert len({tuple(b) for b in batch}) == len(prompts)


def test_models_without_a_cache_generate_batches_one_prompt_at_a_time():
    model = _model("seed_compact", ["attention.causal=false"])
    prompts = _prompts([1, 9, 4])
    batch = generate(model, prompts, 6, greedy=True)
    assert batch == [
        generate_one(model, fit_prompt(p, model.cfg, 6)[0], 6, Sampling(greedy=True)) for p in prompts
    ]
    assert all(len(b) == 6 for b in batch)


@pytest.mark.parametrize("static_cache", [False, True], ids=["growing", "static"])
def test_finished_rows_leave_the_batch_without_changing_the_others(monkeypatch, static_cache):
    """A row that meets eos (or its own max_new_tokens, or stop()) leaves: later steps run on
    fewer rows, and every row still gives its tokens alone. With the static cache the batch
    keeps its width (a compiled step's shapes never change) and the finished rows are not read."""
    model = _model()
    prompts = _prompts([3, 20, 8, 1], seed=4)
    sampling = Sampling(temperature=1.0)
    free = generate_batch(model, prompts, [12] * 4, sampling, seed=5)
    eos = free[1][3]  # row 1's fourth token becomes eos
    widths = []
    real_forward = model.forward

    def spy(ids, cache=None, mask=None):
        widths.append(ids.shape[0])
        return real_forward(ids, cache, mask)

    monkeypatch.setattr(model, "forward", spy)
    limits = [12, 12, 5, 12]
    stop = lambda row, tokens: row == 3 and len(tokens) == 7  # noqa: E731
    batch = generate_batch(
        model, prompts, limits, sampling, eos_id=eos, seed=5, stop=stop, static_cache=static_cache
    )
    monkeypatch.undo()
    for row, prompt in enumerate(prompts):
        cut = free[row][: free[row].index(eos)] if eos in free[row] else free[row]
        assert batch[row] == cut[: 7 if row == 3 else limits[row]]
        assert (
            batch[row] == generate_one(model, prompt, limits[row], sampling, eos, seed=5)[: len(batch[row])]
        )
    if static_cache:
        assert widths == [4] * 12  # the prompts, then a step for each token of the longest row
    else:
        assert widths[0] == 4 and widths[-1] < 4 and widths == sorted(widths, reverse=True)


def test_rows_with_nothing_to_generate():
    model = _model()
    assert generate_batch(model, _prompts([2, 5]), [0, 0]) == [[], []]
    out = generate_batch(model, _prompts([2, 5]), [0, 3], Sampling(greedy=True))
    assert out[0] == [] and len(out[1]) == 3


def test_lmsys_generate_batches_prompts_and_prints_them_in_order(random_export, tmp_path, capsys):
    """The CLI in process: 5 prompts in batches of 2 and of 8 print the same JSON lines as one by one."""
    from lmsys.generate import main

    texts = ["Return", "The default value of the argument is used", "A", "If the file", "x = [1, 2]"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(texts) + "\n", encoding="utf-8")
    outputs = {}
    for batch_size in (1, 2, 8):
        args = [str(random_export), f"prompts={prompts}", "output=jsonl", "max_new_tokens=12", "top_k=40"]
        assert main([*args, f"batch_size={batch_size}"]) == 0
        outputs[batch_size] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert outputs[2] == outputs[1] == outputs[8]
    assert [o["prompt"] for o in outputs[8]] == texts
    assert all(o["new_tokens"] > 0 for o in outputs[8])
    assert main([str(random_export), "prompt=x", "batch_size=0"]) == 2
    assert "batch_size=0 must be >= 1" in capsys.readouterr().err
