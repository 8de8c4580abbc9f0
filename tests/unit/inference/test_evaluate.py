"""lmsys-eval in process: perplexity and bits per byte against a direct loss computation."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

from lmsys.inference.evaluation import EvalError, evaluate_text, evaluate_tokens, split_tokens, token_nll
from lmsys.model.transformer import Transformer
from tests.fixtures.exports import small_config


def held_out_text() -> str:
    """Text the test tokenizer was not trained on (other stdlib modules' docstrings)."""
    parts = []
    for name in ("enum", "fractions", "statistics"):
        module = importlib.import_module(name)
        parts += [d for d in (getattr(module, a).__doc__ for a in sorted(dir(module))) if isinstance(d, str)]
    return "\n\n".join(parts)[:6000] + " caf\u00e9 \U0001f642"  # multi-byte characters count as bytes


def _direct_nll(model, tokens: list[int], seq_len: int, context: int) -> float:
    """Sum over consecutive windows of `model.loss` (the training loss) times the window length:
    window k is predicted from the token before it (`context` for the first window). The rest
    after the last full window is scored like the training loader's last sequence: the last
    seq_len tokens, with loss weight 0 on those already scored."""
    total, previous, n = 0.0, context, len(tokens)
    full = n - n % seq_len
    for start in range(0, full, seq_len):
        window = tokens[start : start + seq_len]
        seq = torch.tensor([[previous, *window]])  # (1, 1 + S): loss predicts window from its prefix
        if model.cfg.bos_shift:  # the model predicts position 0 from bos_shift_id itself
            seq = torch.tensor([window])
        total += float(model.loss(seq)) * len(window)
        previous = window[-1]
    if full < n:
        start = max(0, n - seq_len)
        seq = [tokens[start - 1] if start > 0 else context, *tokens[start:]]
        weights = torch.zeros(len(seq))
        weights[len(seq) - (n - full) :] = 1.0  # only the tokens not scored yet
        if model.cfg.bos_shift:
            seq, weights = seq[1:], weights[1:]
        total += float(model.loss(torch.tensor([seq]), weights[None])) * (n - full)
    return total


@pytest.mark.parametrize("preset", ["tiny", "seed_trax"])  # seed_trax: bos_shift
@torch.no_grad()
def test_text_eval_equals_the_training_loss_computed_directly(tokenizer_path, preset):
    from lmsys.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_path)
    torch.manual_seed(3)
    model = Transformer(small_config(preset)).eval()
    text = held_out_text()
    ids = tok.encode(text)
    seq_len = 24  # several windows and a shorter last one
    assert len(ids) % seq_len != 0
    result = evaluate_text(model, tok, text, seq_len=seq_len, batch_size=3)
    nll = _direct_nll(model, ids, seq_len, tok.eos_id)
    assert result.tokens == len(ids)
    assert result.bytes == len(text.encode("utf-8")) > len(text)
    assert math.isclose(result.nll, nll, rel_tol=1e-6)
    assert math.isclose(result.perplexity, math.exp(nll / len(ids)), rel_tol=1e-6)
    assert math.isclose(result.bits_per_byte, nll / math.log(2) / result.bytes, rel_tol=1e-6)
    assert math.isclose(result.bits_per_token, nll / len(ids) / math.log(2), rel_tol=1e-6)
    # Batching and window placement are internal: any batch size gives the same numbers.
    assert math.isclose(evaluate_text(model, tok, text, seq_len=seq_len, batch_size=1).nll, nll, rel_tol=1e-6)


@torch.no_grad()
def test_each_token_is_predicted_once_in_order(tokenizer_path):
    """token_nll[i] is -log p(token i | its window's prefix): check four positions by hand."""
    torch.manual_seed(4)
    model = Transformer(small_config()).eval()
    tokens = torch.randint(4, 512, (50,), generator=torch.Generator().manual_seed(0))
    nll = token_nll(model, tokens, seq_len=20, first_context=2)
    assert nll.shape == (50,)
    logp = lambda ctx, i: -torch.log_softmax(model(torch.tensor([ctx]))[0, -1], -1)[tokens[i]]  # noqa: E731
    assert math.isclose(nll[0], logp([2], 0), rel_tol=1e-5)  # the first token, from eos
    assert math.isclose(nll[20], logp([int(tokens[19])], 20), rel_tol=1e-5)  # a window's first
    assert math.isclose(nll[25], logp([int(tokens[19]), *tokens[20:25].tolist()], 25), rel_tol=1e-5)
    # tokens 40..49 come last: the window of tokens 30..49, with its full 20 tokens of context
    assert math.isclose(nll[45], logp(tokens[29:45].tolist(), 45), rel_tol=1e-5)


@torch.no_grad()
def test_validation_split_eval(data_dir):
    from lmsys.data.shards import PreparedData
    from lmsys.data.tokenizer import Tokenizer
    from lmsys.model.weights import build_model

    tok = Tokenizer(data_dir / "tokenizer.model")
    torch.manual_seed(5)
    cfg = small_config()
    model = build_model(cfg, Transformer(cfg).state_dict())
    tokens = split_tokens(data_dir, tok, "val")
    val = PreparedData(data_dir).split("val")
    assert len(tokens) == len(val) and np.array_equal(tokens[:100], val.read(0, 100))
    result = evaluate_tokens(model, tok, tokens[:2000])
    assert result.tokens == 2000
    assert result.bytes == len(tok.decode(tokens[:2000].tolist()).encode("utf-8"))
    # An untrained model is near-uniform over 512 pieces: perplexity close to 512.
    assert 300 < result.perplexity < 800


def test_data_with_another_tokenizer_is_refused(data_dir, tmp_path):
    from lmsys.data.tokenizer import Tokenizer, train_tokenizer

    other = tmp_path / "other.model"
    train_tokenizer([held_out_text()] * 3, 400, other)
    with pytest.raises(EvalError, match="tokenizer does not match the model"):
        split_tokens(data_dir, Tokenizer(other), "val")
    with pytest.raises(EvalError, match="does not exist"):
        split_tokens(tmp_path / "nope", Tokenizer(other), "val")
