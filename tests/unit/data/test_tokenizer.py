"""The tokenizer: exact round trips on any unicode, reserved ids, packing, deterministic training."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lmsys.core.errors import DataError
from lmsys.data.shards import token_dtype
from lmsys.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    EncoderPool,
    Tokenizer,
    sample_sentences,
    train_tokenizer,
)
from tests.fixtures.data import UNICODE_SAMPLES, VOCAB, synthetic_text


@pytest.fixture(scope="module")
def tok(prepared) -> Tokenizer:
    return Tokenizer(prepared / "tokenizer.model")


def test_reserved_ids_and_size(tok):
    assert tok.vocab_size == VOCAB
    assert (
        (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    )
    assert tok.dtype == np.uint16
    # byte_fallback: the 256 byte pieces follow the 4 special ones
    assert tok.id_to_piece(4) == "<0x00>" and tok.id_to_piece(259) == "<0xFF>"


@pytest.mark.parametrize(
    "text", UNICODE_SAMPLES + ["".join(UNICODE_SAMPLES)], ids=range(len(UNICODE_SAMPLES) + 1)
)
def test_round_trip_unicode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert UNK_ID not in ids  # unseen characters become bytes, never unk
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_round_trip_every_code_point_class(tok):
    rng = random.Random(3)
    # random characters from the whole code space (surrogates excluded: not text)
    chars = [chr(c) for c in rng.sample(range(0x110000), 3000) if not 0xD800 <= c < 0xE000]
    text = "".join(chars)
    assert tok.decode(tok.encode(text)) == text


def test_unseen_script_falls_back_to_bytes(tok):
    ids = tok.encode("鑫")  # 3 UTF-8 bytes, not in a 400-piece vocabulary of English text
    assert [tok.id_to_piece(i) for i in ids] == ["<0xE9>", "<0x91>", "<0xAB>"]


def test_encode_documents_packs_with_eos(tok):
    texts = ["first document", "second, ☃", "third"]
    tokens, lengths = tok.encode_documents(texts)
    assert tokens.dtype == tok.dtype and lengths.sum() == len(tokens)
    assert (tokens == EOS_ID).sum() == 3
    docs = np.split(tokens, np.cumsum(lengths)[:-1])
    assert [tok.decode(d[:-1]) for d in docs] == texts and all(d[-1] == EOS_ID for d in docs)
    # pieces of one document: eos only after the last
    tokens, lengths = tok.encode_documents(["a long doc", "ument in pieces"], np.array([False, True]))
    assert (tokens == EOS_ID).sum() == 1 and tokens[-1] == EOS_ID
    assert tok.decode(tokens) == "a long document in pieces"


def test_pool_encodes_like_one_process(tok):
    rng = random.Random(1)
    batches = [([synthetic_text(rng, 2) for _ in range(5)], None) for _ in range(7)]
    with EncoderPool(2) as pool:
        parallel = list(pool.encode(tok, iter(batches), in_flight=2))
    for (texts, _), (tokens, lengths) in zip(batches, parallel, strict=True):
        expected_tokens, expected_lengths = tok.encode_documents(texts)
        np.testing.assert_array_equal(tokens, expected_tokens)
        np.testing.assert_array_equal(lengths, expected_lengths)


def test_training_is_deterministic_and_exact_size(tmp_path):
    rng = random.Random(5)
    texts = [synthetic_text(rng, 5) for _ in range(30)]
    a = train_tokenizer(texts, 330, tmp_path / "a.model", seed=11)
    b = train_tokenizer(texts, 330, tmp_path / "b.model", seed=11)
    assert a.sha256 == b.sha256 and a.vocab_size == 330
    assert not list(tmp_path.glob(".*tmp*"))  # written to a temporary name, then renamed


def test_training_sample_is_bounded(tmp_path):
    rng = random.Random(6)
    texts = [synthetic_text(rng, 4) for _ in range(200)]
    total = sum(len(t.encode()) for t in texts)
    chosen, info = sample_sentences(texts, total // 10, seed=1)
    assert info["corpus_bytes"] == total
    assert 0 < info["sample_bytes"] <= total // 10
    assert sum(len(s.encode()) for s in chosen) == info["sample_bytes"]
    again, _ = sample_sentences(texts, total // 10, seed=1)
    assert again == chosen  # deterministic for a seed
    tok = train_tokenizer(texts, 330, tmp_path / "t.model", sample_bytes=total // 10, seed=1)
    assert tok.training_info["sample_bytes"] <= total // 10 < tok.training_info["corpus_bytes"]


def test_small_vocabulary_on_many_characters(tmp_path):
    """More distinct characters than free ids: the rare ones are left to byte fallback."""
    rng = random.Random(8)
    texts = [synthetic_text(rng, 3) + " " + "".join(UNICODE_SAMPLES) for _ in range(10)]
    tok = train_tokenizer(texts, 300, tmp_path / "t.model")
    assert tok.vocab_size == 300 and tok.training_info["rare_characters_left_to_bytes"] > 0
    for text in texts[:2] + UNICODE_SAMPLES:
        assert tok.decode(tok.encode(text)) == text


def test_training_errors_are_one_line(tmp_path):
    with pytest.raises(DataError, match="too small: 260 ids are reserved"):
        train_tokenizer(["some text"], 200, tmp_path / "x.model")
    with pytest.raises(DataError, match="too large") as err:
        train_tokenizer(["tiny corpus"], 5000, tmp_path / "x.model")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "x.model").exists()


def test_token_dtype():
    assert token_dtype(512) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(200_000) == np.uint32


def test_not_a_tokenizer(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"\x00not a sentencepiece model")
    with pytest.raises(DataError, match="not a SentencePiece model"):
        Tokenizer(bad)
