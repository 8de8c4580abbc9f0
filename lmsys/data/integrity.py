"""Shard integrity: what lmsys-prepare records about each shard, and the check, when shards are
opened, that they still hold what was written.

Sizes alone (lmsys.data.shards.read_manifest) miss a shard of the right size with other bytes: a
bad copy, or a shard encoded by another tokenizer. Its ids past the vocabulary would surface as an
IndexError (a device-side assert on a GPU) in the middle of a run. So each shard's manifest entry
also records its `sha256` and its largest token id `max_id`, and opening a directory checks:
- always: the recorded `max_id` is below the tokenizer's vocab_size;
- when all shards together hold at most `full_check_bytes` (FULL_CHECK_BYTES, 64 MiB): every shard
  in full, its sha256 against the manifest and every id below vocab_size (a fraction of a second);
- up to `id_check_bytes` (ID_CHECK_BYTES, 1 GiB): every id below vocab_size, a vectorised max over
  each memory-mapped shard, streamed in blocks (about 25 GB/s from the page cache on one core,
  the disk's read rate from a cold one); checksums are not computed (1-2 GB/s);
- above that: a sample, SAMPLE_BYTES in all, in blocks of BLOCK_TOKENS ids at evenly spaced
  offsets of every shard (its first and last block included), each id below vocab_size. The
  training loader then checks the ids of every batch before it reaches the model
  (lmsys.data.loader), so an id between the samples still ends a run in one line naming the shard
  and position, never in an IndexError.
Manifests written before these fields existed get the same id checks; only the checksum
comparison is missing for them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from lmsys.core.errors import DataError

FULL_CHECK_BYTES = 64 << 20  # up to this many shard bytes in all, every byte is checked
ID_CHECK_BYTES = 1 << 30  # up to this many, every id (no checksums)
SAMPLE_BYTES = 16 << 20  # above it, about this many bytes are read, spread over the shards
BLOCK_TOKENS = 4096  # ids per sampled block
_READ_TOKENS = 1 << 20  # ids per read of a full check
_MAX_TOKENS = 1 << 24  # ids per block of an id check (a vectorised max over the memory map)


class ShardDigest:
    """The sha256 and the largest id of one shard, updated as tokens are appended to it."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.max_id = -1  # -1: no token yet

    def update(self, tokens: np.ndarray) -> None:
        """`tokens`: (n,) little-endian ids, exactly the bytes appended to the file."""
        self._sha.update(memoryview(tokens).cast("B"))
        if len(tokens):
            self.max_id = max(self.max_id, int(tokens.max()))

    def record(self) -> dict[str, Any]:
        """The manifest fields of the shard."""
        return {"sha256": self._sha.hexdigest(), "max_id": self.max_id}


def digest_file(path: Path, dtype: np.dtype) -> ShardDigest:
    """The digest of a shard file as it is on disk."""
    digest = ShardDigest()
    with open(path, "rb") as fh:
        while block := fh.read(_READ_TOKENS * dtype.itemsize):
            digest.update(np.frombuffer(block, dtype=dtype))
    return digest


def check_shard_ids(
    directory: Path,
    manifest: dict[str, Any],
    vocab_size: int,
    redo: str,
    full_check_bytes: int | None = None,
    id_check_bytes: int | None = None,
) -> None:
    """Raise DataError naming the first shard whose ids or bytes are not what was written (see the
    module docstring for what is read; the limits default to FULL_CHECK_BYTES and ID_CHECK_BYTES);
    `redo` is the command that prepares the data again."""
    full_check_bytes = FULL_CHECK_BYTES if full_check_bytes is None else full_check_bytes
    id_check_bytes = ID_CHECK_BYTES if id_check_bytes is None else id_check_bytes
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    shards = [s for s in manifest["shards"] if int(s["tokens"]) > 0]
    for s in shards:
        if "max_id" in s and int(s["max_id"]) >= vocab_size:
            raise DataError(
                f"corrupt shard {directory / s['file']}: manifest.json records token id {s['max_id']}, "
                f"past the tokenizer's vocabulary (vocab_size is {vocab_size}); {redo}"
            )
    total = sum(int(s["tokens"]) for s in shards) * dtype.itemsize
    if total <= full_check_bytes:
        for s in shards:
            _check_full(directory / s["file"], s, dtype, vocab_size, redo)
        return
    if total <= id_check_bytes:
        for s in shards:
            ids = np.memmap(directory / s["file"], dtype=dtype, mode="r", shape=(int(s["tokens"]),))
            if error := first_past_vocabulary(ids, 0, vocab_size, directory / s["file"], redo):
                raise error
        return
    blocks = max(2, SAMPLE_BYTES // (BLOCK_TOKENS * dtype.itemsize * len(shards)))
    for s in shards:
        _check_sample(directory / s["file"], int(s["tokens"]), blocks, dtype, vocab_size, redo)


def first_past_vocabulary(
    ids: np.ndarray, start: int, vocab_size: int, path: Path, redo: str
) -> DataError | None:
    """The error for the first id of `ids` (a shard's ids from position `start`, a memory map or
    an array) past the vocabulary, or None: a vectorised max per block of _MAX_TOKENS ids, and
    only a block that fails is searched."""
    for lo in range(0, len(ids), _MAX_TOKENS):
        block = np.asarray(ids[lo : lo + _MAX_TOKENS])  # (n,)
        if len(block) and int(block.max()) >= vocab_size:
            return _bad_id(path, block, start + lo, vocab_size, redo)
    return None


def _bad_id(path: Path, ids: np.ndarray, start: int, vocab_size: int, redo: str) -> DataError | None:
    """The error for the first id of `ids` (read at shard position `start`) past the vocabulary."""
    past = np.flatnonzero(ids >= vocab_size)
    if len(past) == 0:
        return None
    return past_vocabulary(path, int(ids[past[0]]), start + int(past[0]), vocab_size, redo)


def past_vocabulary(path: Path, token: int, position: int, vocab_size: int, redo: str) -> DataError:
    """The one line for id `token` at `position` of shard `path`, past the vocabulary."""
    return DataError(
        f"corrupt shard {path}: token id {token} at position {position} is past the tokenizer's "
        f"vocabulary (vocab_size is {vocab_size}; a bad copy, or a shard of another tokenizer); {redo}"
    )


def _check_full(path: Path, shard: dict[str, Any], dtype: np.dtype, vocab_size: int, redo: str) -> None:
    digest, start = ShardDigest(), 0
    with open(path, "rb") as fh:
        while block := fh.read(_READ_TOKENS * dtype.itemsize):
            ids = np.frombuffer(block, dtype=dtype)  # (n,)
            if error := _bad_id(path, ids, start, vocab_size, redo):
                raise error
            digest.update(ids)
            start += len(ids)
    recorded = shard.get("sha256")
    actual = digest.record()["sha256"]
    if recorded is not None and actual != recorded:
        raise DataError(
            f"corrupt shard {path}: its sha256 {actual[:12]} differs from {str(recorded)[:12]} in "
            f"manifest.json (its bytes changed after lmsys-prepare wrote it); {redo}"
        )


def _check_sample(path: Path, tokens: int, blocks: int, dtype: np.dtype, vocab_size: int, redo: str) -> None:
    if blocks * BLOCK_TOKENS >= tokens:
        starts = [0]
        length = tokens
    else:
        starts = np.linspace(0, tokens - BLOCK_TOKENS, blocks).astype(np.int64).tolist()
        length = BLOCK_TOKENS
    with open(path, "rb") as fh:
        for start in starts:
            fh.seek(start * dtype.itemsize)
            ids = np.frombuffer(fh.read(length * dtype.itemsize), dtype=dtype)  # (length,)
            if error := _bad_id(path, ids, start, vocab_size, redo):
                raise error


def check_side_files(
    directory: Path, manifest: dict[str, Any], redo: str, full_check_bytes: int | None = None
) -> None:
    """FORMAT_VERSION 2's loss weights and document starts (lmsys.data.shards): always each file
    present with its recorded size; when they hold at most `full_check_bytes` in all, also their
    sha256, every weight 0 or 1, and the starts increasing from 0 within their split."""
    full_check_bytes = FULL_CHECK_BYTES if full_check_bytes is None else full_check_bytes
    files = []  # (path, size in bytes, recorded sha256, check of the values)
    for shard in manifest["shards"]:
        n = int(shard["tokens"])
        files.append((directory / shard["weights_file"], n, shard.get("weights_sha256"), _weights_ok))
    for split in manifest["splits"].values():
        count, tokens = int(split["document_starts"]), int(split["tokens"])
        files.append((directory / split["documents_file"], 8 * count, split.get("documents_sha256"),
                      lambda data, tokens=tokens: _starts_ok(data, tokens)))  # fmt: skip
    for path, size, _, _ in files:
        if not path.is_file():
            raise DataError(f"{path}, listed in manifest.json, is missing; {redo}")
        if path.stat().st_size != size:
            raise DataError(
                f"corrupt {path}: {path.stat().st_size} bytes, but manifest.json says {size}; {redo}"
            )
    if sum(size for _, size, _, _ in files) > full_check_bytes:
        return
    for path, _, recorded, values_ok in files:
        data = path.read_bytes()
        if recorded is not None and hashlib.sha256(data).hexdigest() != recorded:
            raise DataError(
                f"corrupt {path}: its sha256 differs from the one in manifest.json (its bytes changed "
                f"after lmsys-prepare wrote it); {redo}"
            )
        if not values_ok(data):
            raise DataError(f"corrupt {path}: values outside the format (lmsys.data.shards); {redo}")


def _weights_ok(data: bytes) -> bool:
    weights = np.frombuffer(data, dtype=np.uint8)
    return not len(weights) or int(weights.max()) <= 1


def _starts_ok(data: bytes, tokens: int) -> bool:
    starts = np.frombuffer(data, dtype="<u8")
    if not len(starts):
        return tokens == 0
    return (
        int(starts[0]) == 0
        and bool((np.diff(starts.astype(np.int64)) > 0).all())
        and int(starts[-1]) < tokens
    )
