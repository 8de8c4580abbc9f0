"""lmsys-prepare's output: manifest integrity, an exact round trip of the whole corpus through the
shards, reuse, and detection of shards that do not match their manifest or tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lmsys.core.config import compose
from lmsys.core.errors import DataError
from lmsys.core.files import sha256_file
from lmsys.data import corpus
from lmsys.data.corpus import FileCorpus
from lmsys.data.loader import TokenLoader
from lmsys.data.preparation import prepare, validation_mask
from lmsys.data.shards import MANIFEST, PreparedData, TokenizerMismatch, read_manifest
from lmsys.data.tokenizer import EOS_ID, Tokenizer
from tests.fixtures.data import SHARD_TOKENS, VOCAB


def split_documents(data: PreparedData, split: str) -> list[np.ndarray]:
    tokens = data.split(split)
    ids = tokens.read(0, len(tokens)).astype(np.int64)
    assert ids[-1] == EOS_ID  # every document ends with eos
    ends = np.flatnonzero(ids == EOS_ID)
    return np.split(ids, ends[:-1] + 1)


def test_manifest_describes_the_files(prepared, corpus_dir):
    m = read_manifest(prepared)
    tok = m["tokenizer"]
    assert tok["vocab_size"] == VOCAB and tok["sha256"] == sha256_file(prepared / "tokenizer.model")
    assert (tok["pad_id"], tok["bos_id"], tok["eos_id"], tok["unk_id"]) == (0, 1, 2, 3)
    assert m["dtype"] == "uint16" and m["byteorder"] == "little"
    # shard files: exactly the listed ones, sizes match token counts, totals add up
    listed = {s["file"] for s in m["shards"]}
    assert listed == {p.name for p in prepared.glob("*.bin")}
    for s in m["shards"]:
        assert (prepared / s["file"]).stat().st_size == 2 * s["tokens"] and 0 < s["tokens"] <= SHARD_TOKENS
    for split in ("train", "val"):
        assert m["splits"][split]["tokens"] == sum(s["tokens"] for s in m["shards"] if s["split"] == split)
        assert m["splits"][split]["documents"] > 0
    assert m["splits"]["train"]["shards"] >= 2  # small shard_tokens: the split spans several files
    # sources: every file read, with its size
    files = {Path(f["path"]).name: f["bytes"] for f in m["sources"]["files"]}
    assert files["book.txt.gz"] == (corpus_dir / "book.txt.gz").stat().st_size
    assert ".hidden.txt" not in files and len(files) == 16
    assert m["documents"]["documents"] == m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"]
    assert m["config"]["data"]["val_fraction"] == 0.2
    assert not list(prepared.parent.glob(".prepared.*"))  # no temporary or old directory left


def test_shards_round_trip_the_corpus(prepared, corpus_dir):
    """Decoding the shards gives back every document, split by the documented rule."""
    data = PreparedData(prepared)
    tok = Tokenizer(data.tokenizer_path)
    m = data.manifest
    docs = list(FileCorpus.from_sources([str(corpus_dir)]).documents())
    is_val = validation_mask(np.arange(len(docs)), m["config"]["data"]["seed"], 0.2)
    for split, flags in (("train", ~is_val), ("val", is_val)):
        decoded = [tok.decode(d[:-1]) for d in split_documents(data, split)]
        assert decoded == [d for d, f in zip(docs, flags) if f], split


@pytest.fixture
def copy(prepared, tmp_path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(prepared, out)
    return out


def test_truncated_shard_is_detected(copy):
    shard = copy / read_manifest(copy)["shards"][0]["file"]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 2)
    with pytest.raises(DataError, match=r"corrupt shard .*train_0000.bin: \d+ bytes, but manifest.json says"):
        PreparedData(copy)


def test_missing_shard_and_manifest_are_detected(copy):
    (copy / "val_0000.bin").unlink()
    with pytest.raises(DataError, match="val_0000.bin listed in manifest.json is missing"):
        PreparedData(copy)
    (copy / MANIFEST).unlink()
    with pytest.raises(DataError, match="has no manifest.json"):
        PreparedData(copy)


def test_edited_manifest_is_detected(copy):
    m = json.loads((copy / MANIFEST).read_text())
    m["splits"]["train"]["tokens"] += 1
    (copy / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(DataError, match="train shards hold .* tokens but the total says"):
        PreparedData(copy)


def test_shards_from_another_tokenizer_are_detected(copy, other_tokenizer):
    shutil.copyfile(other_tokenizer, copy / "tokenizer.model")
    with pytest.raises(TokenizerMismatch, match="were made by another tokenizer"):
        PreparedData(copy)


def test_model_vocabulary_must_match(prepared):
    data = PreparedData(prepared)
    data.check_model(compose([f"model.vocab_size={VOCAB}"]).model)
    with pytest.raises(DataError, match=rf"model.vocab_size=512 but .* {VOCAB}-piece tokenizer"):
        data.check_model(compose(["model.vocab_size=512"]).model)


def test_long_document_is_encoded_in_pieces(tmp_path, monkeypatch, other_tokenizer):
    """A text file longer than a piece is read and encoded in pieces: still one document, one
    eos, and the text comes back exactly (here on 2 encoding threads)."""
    monkeypatch.setattr(corpus, "PIECE_BYTES", 3000)
    src = tmp_path / "src"
    src.mkdir()
    long_text = "".join(f"Line {i} of a long book, ü∑ with some words.\n" for i in range(2000))
    (src / "book.txt").write_text(long_text, encoding="utf-8")
    for i in range(6):
        (src / f"short_{i}.txt").write_text(f"short document {i}\n", encoding="utf-8")
    cfg = compose(
        [f"data.sources=[{src}]", f"data.dir={tmp_path / 'out'}", f"model.vocab_size={VOCAB}",
         f"data.tokenizer={other_tokenizer}", "data.val_fraction=0.3", "data.num_workers=2", "data.seed=3"]
    )  # fmt: skip
    out = prepare(cfg)
    data = PreparedData(out)
    tok = Tokenizer(data.tokenizer_path)
    docs = [tok.decode(d[:-1]) for split in ("train", "val") for d in split_documents(data, split)]
    assert sorted(docs) == sorted([long_text] + [f"short document {i}\n" for i in range(6)])
    m = data.manifest
    assert m["documents"]["documents"] == 7
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 7
    assert m["tokenizer"]["origin"] == str(other_tokenizer.resolve())
    assert m["encoding"]["workers"] == 2 and m["encoding"]["cpu_seconds"]["total"] > 0


def test_uint32_shards_for_a_vocabulary_above_65536(tmp_path, other_tokenizer):
    """A tokenizer of more than 65,536 pieces: the shards are uint32, ids above 65535 survive the
    trip through prepare, the manifest, the loader and decoding."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(other_tokenizer.read_bytes())
    user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    while len(proto.pieces) < 70_000:  # whole words SentencePiece matches before any merge
        proto.pieces.add(piece=f"Qz{len(proto.pieces)}", score=0.0, type=user_defined)
    big = tmp_path / "big.model"
    big.write_bytes(proto.SerializeToString())
    src = tmp_path / "src"
    src.mkdir()
    texts = [f"first Qz69999 and Qz65536 then Qz{400 + i} plain words {i}\n" for i in range(12)]
    for i, text in enumerate(texts):
        (src / f"doc_{i}.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    cfg = compose(
        [f"data.sources=[{src}]", f"data.dir={out}", "model.vocab_size=70000", f"data.tokenizer={big}",
         "data.val_fraction=0.25", "data.num_workers=2"]
    )  # fmt: skip
    prepare(cfg)
    data = PreparedData(out)
    assert data.manifest["dtype"] == "uint32" and data.vocab_size == 70_000
    for shard in data.manifest["shards"]:
        assert (out / shard["file"]).stat().st_size == 4 * shard["tokens"]
    tok = Tokenizer(data.tokenizer_path)
    high = {69999, 65536}
    assert [tok.id_to_piece(i) for i in sorted(high)] == ["Qz65536", "Qz69999"]
    docs = [d for split in ("train", "val") for d in split_documents(data, split)]
    assert sorted(tok.decode(d[:-1]) for d in docs) == sorted(texts)
    assert all(high <= set(d.tolist()) for d in docs)  # ids above 65535, not truncated to 16 bits
    loader = TokenLoader(data, "train", tokens_per_sample=8, global_batch_size=2, micro_batch_size=2)
    batch = loader.next_batch()
    assert batch.tokens.dtype == torch.int64 and int(batch.tokens.max()) < 70_000
    seen = {int(t) for _ in range(loader.num_samples) for t in loader.next_batch().tokens.flatten()}
    assert high <= seen


def _first_train_shard(directory: Path) -> Path:
    return directory / read_manifest(directory)["shards"][0]["file"]


def test_manifest_records_each_shards_checksum_and_largest_id(prepared):
    for s in read_manifest(prepared)["shards"]:
        ids = np.fromfile(prepared / s["file"], dtype="<u2")
        assert s["max_id"] == int(ids.max()) < VOCAB
        assert s["sha256"] == sha256_file(prepared / s["file"])


@pytest.mark.parametrize("old_manifest", [False, True], ids=["manifest", "old-manifest"])
def test_ids_past_the_vocabulary_are_detected(copy, old_manifest):
    """A shard of the right size holding ids >= vocab_size (a shard from another tokenizer) is
    refused when opened, naming the shard and the command that prepares it again; a manifest
    written before checksums existed is checked by a scan of the ids."""
    if old_manifest:
        m = json.loads((copy / MANIFEST).read_text())
        for s in m["shards"]:
            del s["max_id"], s["sha256"]
        (copy / MANIFEST).write_text(json.dumps(m))
        PreparedData(copy)  # prepared data from before the change still loads
    shard = _first_train_shard(copy)
    ids = np.fromfile(shard, dtype="<u2")
    ids[len(ids) // 2] = VOCAB + 7
    ids.tofile(shard)
    with pytest.raises(DataError) as e:
        PreparedData(copy)
    assert "\n" not in str(e.value)
    assert f"corrupt shard {shard}: token id {VOCAB + 7} at position {len(ids) // 2}" in str(e.value)
    assert f"vocab_size is {VOCAB}" in str(e.value)
    assert f"lmsys-prepare data.dir={copy} data.overwrite=true" in str(e.value)


def test_changed_bytes_are_detected(copy):
    shard = _first_train_shard(copy)
    ids = np.fromfile(shard, dtype="<u2")
    ids[[3, 4]] = ids[[4, 3]] if ids[3] != ids[4] else (5, 6)  # still valid ids, other bytes
    ids.tofile(shard)
    wanted = rf"corrupt shard {shard}: its sha256 .* differs from .*data.overwrite=true"
    with pytest.raises(DataError, match=wanted):
        PreparedData(copy)


def test_large_data_is_checked_on_a_sample(copy, monkeypatch):
    """Above the full-check size, ids are read at evenly spaced blocks of every shard (the first
    block included) and checksums are not computed; bad ids in a sampled block are still found."""
    from lmsys.data import integrity

    monkeypatch.setattr(integrity, "FULL_CHECK_BYTES", 0)
    shard = _first_train_shard(copy)
    ids = np.fromfile(shard, dtype="<u2")
    ids[[3, 4]] = ids[[4, 3]] if ids[3] != ids[4] else (5, 6)
    ids.tofile(shard)
    PreparedData(copy)  # a changed checksum is not seen on a sample
    ids[1] = 65535
    ids.tofile(shard)
    with pytest.raises(DataError, match=rf"corrupt shard {shard}: token id 65535 at position 1"):
        PreparedData(copy)


def _corrupt_mid_shard(directory: Path, shard_index: int = 0, value: int = VOCAB + 3) -> tuple[Path, int]:
    """An id past the vocabulary in the middle of a shard, away from its first and last blocks."""
    shard = directory / read_manifest(directory)["shards"][shard_index]["file"]
    ids = np.fromfile(shard, dtype="<u2")
    where = len(ids) // 2 + 17
    ids[where] = value
    ids.tofile(shard)
    return shard, where


def test_ids_between_the_samples_are_found_by_the_id_check(copy, monkeypatch):
    """Above the checksum limit (lowered here), every id is still checked when the data is opened,
    by a vectorised max over the memory-mapped shards: an id between the sampled blocks is named."""
    from lmsys.data import integrity

    monkeypatch.setattr(integrity, "BLOCK_TOKENS", 64)
    monkeypatch.setattr(integrity, "SAMPLE_BYTES", 0)  # two blocks per shard: its first and last
    shard, where = _corrupt_mid_shard(copy)
    PreparedData(copy, full_check_bytes=0, id_check_bytes=0)  # the sample misses it
    with pytest.raises(DataError, match=rf"corrupt shard {shard}: token id {VOCAB + 3} at position {where} "):
        PreparedData(copy, full_check_bytes=0)  # ids checked in full, no checksum
