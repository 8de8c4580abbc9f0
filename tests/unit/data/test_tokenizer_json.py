"""A Hugging Face tokenizer.json (GPT-2's byte-level BPE, trained here with `tokenizers`) behind
lmsys's Tokenizer: the library's own ids, the special ids taken from the tokenizer itself, and
lmsys-prepare encoding a corpus with it (data.tokenizer=DIR)."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import tokenizers

from lmsys.core.errors import DataError
from lmsys.data.tokenizer import EncoderPool, Tokenizer
from tests.fixtures.data import BPE_VOCAB, UNICODE_SAMPLES, synthetic_text

TEXTS = [*UNICODE_SAMPLES, "".join(UNICODE_SAMPLES), "def f(x):\n    return x  # 1234567890\n\n\n", "   "]


def test_ids_are_the_librarys_and_gpt2s_special_tokens(bpe_dir, library):
    tok = Tokenizer(bpe_dir)  # the directory: its tokenizer.json
    assert tok.kind == "hf" and tok.path == bpe_dir / "tokenizer.json"
    assert tok.vocab_size == BPE_VOCAB and tok.dtype == np.uint16
    eos = library.token_to_id("<|endoftext|>")
    assert eos == BPE_VOCAB - 1  # last, like GPT-2's 50256: nothing assumes eos == 2
    # GPT-2's files name no special token; transformers' GPT2Tokenizer makes <|endoftext|> all three
    assert (tok.eos_id, tok.bos_id, tok.unk_id, tok.pad_id) == (eos, eos, eos, None)
    rng = random.Random(0)
    for text in TEXTS + [synthetic_text(rng, 3) for _ in range(20)]:
        ids = tok.encode(text)
        assert ids == library.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text  # byte-level BPE: every string round-trips
    assert tok.encode("a<|endoftext|>b") == [*tok.encode("a"), eos, *tok.encode("b")]  # as transformers
    assert tok.decode([*tok.encode("end"), eos]) == "end"  # eos decodes to nothing, as in SentencePiece


def test_special_tokens_come_from_tokenizer_config(bpe_dir, tmp_path):
    d = tmp_path / "configured"
    shutil.copytree(bpe_dir, d)
    config = {"eos_token": {"content": "<|endoftext|>", "special": True}, "bos_token": None,
              "pad_token": "<|endoftext|>", "split_special_tokens": True}  # fmt: skip
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(d / "tokenizer.json")
    eos = BPE_VOCAB - 1
    assert (tok.eos_id, tok.bos_id, tok.unk_id, tok.pad_id) == (eos, None, None, eos)
    # split_special_tokens=true (transformers' setting): text spelling a special token is text
    assert eos not in tok.encode("a<|endoftext|>b")
    splitting = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    splitting.encode_special_tokens = True
    assert tok.encode("a<|endoftext|>b") == splitting.encode("a<|endoftext|>b", add_special_tokens=False).ids


def test_mistakes_are_one_line(bpe_dir, tmp_path):
    no_eos = tmp_path / "no_eos"
    no_eos.mkdir()
    plain = tokenizers.Tokenizer(tokenizers.models.BPE())
    plain.add_tokens(["a", "b"])
    plain.save(str(no_eos / "tokenizer.json"))
    with pytest.raises(DataError, match="names no end-of-document token") as err:
        Tokenizer(no_eos)
    assert '"eos_token"' in str(err.value) and "\n" not in str(err.value)
    (no_eos / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(DataError, match="its eos_token '</s>' is not in its vocabulary"):
        Tokenizer(no_eos)
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match="is not a Hugging Face tokenizer.json"):
        Tokenizer(bad)
    vocab_only = tmp_path / "vocab_only"
    vocab_only.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (vocab_only / name).write_text("{}")
    with pytest.raises(DataError, match=r"holds no tokenizer.model or tokenizer.json.*save_pretrained"):
        Tokenizer(vocab_only)


def test_a_directory_prefers_lmsys_tokenizer_model(bpe_dir, prepared, tmp_path):
    both = tmp_path / "both"
    shutil.copytree(bpe_dir, both)
    shutil.copyfile(prepared / "tokenizer.model", both / "tokenizer.model")
    assert Tokenizer(both).kind == "sentencepiece"
    assert Tokenizer(both / "tokenizer.json").kind == "hf"


def test_pool_encodes_like_one_thread(bpe_dir):
    tok = Tokenizer(bpe_dir)
    rng = random.Random(2)
    batches = [([synthetic_text(rng, 2) for _ in range(5)], None) for _ in range(9)]
    with EncoderPool(2) as pool:
        parallel = list(pool.encode(tok, iter(batches), in_flight=3))
    for (texts, _), (tokens, lengths) in zip(batches, parallel, strict=True):
        want_tokens, want_lengths = tok.encode_documents(texts)
        np.testing.assert_array_equal(tokens, want_tokens)
        np.testing.assert_array_equal(lengths, want_lengths)
        assert (tokens == tok.eos_id).sum() == len(texts)
