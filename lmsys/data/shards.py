"""The prepared-data format: token shards, their manifest, and the reader the loader builds on.

A prepared directory (`data.dir`, written by lmsys-prepare) holds, in FORMAT_VERSION 1:
- the tokenizer the shards were encoded with (lmsys.data.tokenizer): `tokenizer.model`, or a Hugging
  Face `tokenizer.json` with the `tokenizer_config.json` naming its special tokens;
- `train_0000.bin`, `train_0001.bin`, ..., `val_0000.bin`, ...: raw little-endian token ids,
  uint16 for vocabularies up to 65,536 pieces and uint32 above (`token_dtype`), no header,
  memmap-able; a split is the concatenation of its shards in order, every document ends with
  eos, and a document may continue into the next shard;
- `manifest.json`: the format and version, the tokenizer (kind, file, sha256, vocab_size,
  special ids; kind "sentencepiece" when absent), the dtype, every shard (file, split, tokens,
  and since lmsys-prepare records them its sha256 and largest id `max_id`) and the totals per
  split, plus whatever provenance the writer adds (lmsys-prepare: sources,
  config, fingerprint, timings).

FORMAT_VERSION 2 (lmsys-prepare data.format=chat) adds what conversations need beside the ids:
- `train_0000.weights.bin`, ...: one uint8 per token of the shard of the same name, its loss
  weight, 0 or 1 (the tokens of the assistant's turns are 1);
- `train.documents.bin`, `val.documents.bin`: little-endian uint64, the split offset of every
  document's first token, increasing from 0 (a document is a conversation, or the padding after
  the conversations of a row); documents do not end with eos (the chat template ends each turn);
- in the manifest: `content: "chat"`, `row_tokens` (the rows every split is cut into, the
  loader's samples: data.seq_len + 1 tokens, or data.seq_len under bos_shift; no conversation
  crosses a row) and the `seq_len` they were made for, `packing`, each shard's `weights_file` and
  `weights_sha256`, each split's `documents_file`, `document_starts`, `documents_sha256` and `rows`.
A version 1 directory reads as before (weights 1, documents from its eos); lmsys-prepare writes
text data in version 1, so text prepared before version 2 existed is reused as it is.

`read_manifest` checks a directory against its manifest (every shard present with exactly its
recorded size, the totals adding up, the tokenizer file's sha256, the token ids below the
vocabulary and the shards' checksums: lmsys.data.integrity) before anything reads it;
`PreparedData` opens a checked directory and serves each split as one memory-mapped array.
Writing goes through `ShardWriter` (one split, appending) and `write_manifest`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lmsys.core.errors import DataError
from lmsys.core.files import sha256_file
from lmsys.data.integrity import ShardDigest, check_shard_ids, check_side_files, digest_file

if TYPE_CHECKING:
    from lmsys.core.config import ModelConfig

FORMAT = "lmsys-token-shards"
FORMAT_VERSION = 1  # token ids, documents separated by eos
WEIGHTED_FORMAT_VERSION = 2  # also each token's loss weight and explicit document starts (chat)
READABLE_VERSIONS = (FORMAT_VERSION, WEIGHTED_FORMAT_VERSION)
WEIGHT_DTYPE = np.dtype(np.uint8)
START_DTYPE = np.dtype("<u8")
MANIFEST = "manifest.json"
SPLITS = ("train", "val")


class TokenizerMismatch(DataError):
    """The shards of a prepared directory were made by another tokenizer than the one beside them."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids `0..vocab_size-1` (uint16 up to 65536 pieces)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


# ----------------------------------------------------------------------------- the manifest


def prepare_again(directory: str | Path) -> str:
    """What fixes a prepared directory that does not check out."""
    return f"run `lmsys-prepare data.dir={directory} data.overwrite=true`"


def read_manifest(
    directory: str | Path, full_check_bytes: int | None = None, id_check_bytes: int | None = None
) -> dict[str, Any]:
    """Load `directory/manifest.json` and check it against the files: every shard exists with
    exactly `tokens * itemsize` bytes, per-split totals add up, the tokenizer file has the
    recorded sha256, and the shards' ids and checksums check out (lmsys.data.integrity, with its
    limits `full_check_bytes` and `id_check_bytes`). Raises DataError naming the problem (and the
    lmsys-prepare command that fixes it)."""
    d = Path(directory)
    hint = f"run `lmsys-prepare data.dir={directory}`"
    redo = prepare_again(directory)
    if d.exists() and not d.is_dir():
        raise DataError(
            f"prepared data directory {directory} is a file, not a directory; name the directory "
            f"lmsys-prepare wrote (the one holding {MANIFEST})"
        )
    if not d.is_dir():
        raise DataError(f"prepared data directory {directory} does not exist; {hint} first")
    path = d / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{directory} has no {MANIFEST} (not prepared, or preparation did not finish); {hint}"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        ok = manifest.get("format") == FORMAT
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not a valid manifest ({e}); {redo}") from e
    if not ok:
        raise DataError(f"{path} is not an {FORMAT} manifest; {redo}")
    if manifest.get("version") not in READABLE_VERSIONS:
        readable = " and ".join(map(str, READABLE_VERSIONS))
        raise DataError(
            f"{path} has format version {manifest.get('version')}, this lmsys reads {readable}; {redo}"
        )
    try:
        _check_shards(d, manifest, redo)
        if manifest["version"] == WEIGHTED_FORMAT_VERSION:
            check_side_files(d, manifest, redo, full_check_bytes)
        tok = manifest["tokenizer"]
        tok_path = d / tok["file"]
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path} is incomplete or malformed ({type(e).__name__}: {e}); {redo}") from e
    if not tok_path.is_file():
        raise DataError(f"{tok_path} is missing; {redo}")
    sha = sha256_file(tok_path)
    if sha != tok["sha256"]:
        raise TokenizerMismatch(
            f"the shards in {directory} were made by another tokenizer: {MANIFEST} says sha256 "
            f"{str(tok['sha256'])[:12]}, {tok_path.name} is {sha[:12]}; restore it or {redo}"
        )
    check_shard_ids(d, manifest, int(tok["vocab_size"]), redo, full_check_bytes, id_check_bytes)
    return manifest


def _check_shards(d: Path, manifest: dict[str, Any], redo: str) -> None:
    itemsize = np.dtype(manifest["dtype"]).itemsize
    totals = {split: 0 for split in SPLITS}
    for shard in manifest["shards"]:
        file = d / shard["file"]
        if not file.is_file():
            raise DataError(f"shard {file} listed in {MANIFEST} is missing; {redo}")
        size, expected = file.stat().st_size, int(shard["tokens"]) * itemsize
        if size != expected:
            raise DataError(
                f"corrupt shard {file}: {size} bytes, but {MANIFEST} says {shard['tokens']} tokens "
                f"({expected} bytes); {redo}"
            )
        totals[shard["split"]] += int(shard["tokens"])
    for split in SPLITS:
        if totals[split] != int(manifest["splits"][split]["tokens"]):
            raise DataError(
                f"{d / MANIFEST}: {split} shards hold {totals[split]} tokens but the total says "
                f"{manifest['splits'][split]['tokens']}; {redo}"
            )


def write_manifest(
    directory: Path,
    writers: dict[str, ShardWriter],
    tokenizer: dict[str, Any],
    provenance: dict[str, Any],
    layout: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Close the split writers and write manifest.json: the format's own fields from the shards
    written and the tokenizer section (`kind`, `file`, `sha256`, `vocab_size`, special ids, origin),
    the `layout` of weighted writers (FORMAT_VERSION 2: content, row_tokens, seq_len, packing), then
    the writer's `provenance` fields. Returns the manifest."""
    dtype = next(iter(writers.values())).dtype
    weighted = all(isinstance(w, WeightedShardWriter) for w in writers.values())
    shards = [s for split in SPLITS for s in writers[split].close()]
    manifest = {
        "format": FORMAT,
        "version": WEIGHTED_FORMAT_VERSION if weighted else FORMAT_VERSION,
        "tokenizer": tokenizer,
        "dtype": dtype.name,
        "byteorder": "little",
        "eos_after_every_document": not weighted,
        **(layout or {}),
        "shards": shards,
        "splits": {s: writers[s].split_record() for s in SPLITS},
        **provenance,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


# ----------------------------------------------------------------------------- writing shards


class ShardWriter:
    """Appends one split's tokens to `<split>_NNNN.bin` files of at most `shard_tokens` each."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[list[Any]] = []  # [file name, tokens]
        self.digests: list[ShardDigest] = []  # one per shard: its sha256 and largest id
        self.documents = 0  # complete documents written
        self.last_doc_tokens = 0  # tokens of the last complete document (for the split fix-up)
        self._doc_tokens = 0  # tokens of the document being written so far
        self._fh = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.shards)

    def _open_next(self) -> None:
        self._close_file()
        name = f"{self.split}_{len(self.shards):04d}.bin"
        self._fh = open(self.directory / name, "wb")
        self.shards.append([name, 0])
        self.digests.append(ShardDigest())

    def _close_file(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def write(self, tokens: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Append `tokens` (and, to a weighted split, their loss `weights`), across shard files."""
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype.newbyteorder("<"))
        pos = 0
        while pos < len(tokens):
            if self._fh is None or self.shards[-1][1] >= self.shard_tokens:
                self._open_next()
            take = min(len(tokens) - pos, self.shard_tokens - self.shards[-1][1])
            self._append(tokens[pos : pos + take], None if weights is None else weights[pos : pos + take])
            pos += take

    def _append(self, tokens: np.ndarray, weights: np.ndarray | None) -> None:
        """Append to the open shard file (room for `tokens` checked by `write`)."""
        assert self._fh is not None
        self._fh.write(tokens.tobytes())
        self.digests[-1].update(tokens)
        self.shards[-1][1] += len(tokens)

    def add(self, tokens: np.ndarray, lengths: np.ndarray, ends: np.ndarray) -> None:
        """Write pieces of documents: `tokens` is their concatenation, `lengths[i]` and `ends[i]`
        the token count of piece i and whether it ends its document (then its last token is eos)."""
        self.write(tokens)
        for n, end in zip(lengths.tolist(), ends.tolist()):
            self._doc_tokens += n
            if end:
                self.documents += 1
                self.last_doc_tokens, self._doc_tokens = self._doc_tokens, 0

    def pop_tail(self, count: int) -> np.ndarray:
        """Remove and return the last `count` tokens written (files are truncated, emptied
        ones deleted); used to move one document to the other split."""
        self._close_file()
        parts: list[np.ndarray] = []
        while count > 0:
            name, n = self.shards[-1]
            take = min(n, count)
            path = self.directory / name
            parts.append(
                np.fromfile(path, dtype=self.dtype.newbyteorder("<"), offset=(n - take) * self.dtype.itemsize)
            )
            if take == n:
                path.unlink()
                self.shards.pop()
                self.digests.pop()
            else:
                os.truncate(path, (n - take) * self.dtype.itemsize)
                self.shards[-1][1] = n - take
                self.digests[-1] = digest_file(path, self.dtype.newbyteorder("<"))
            count -= take
        return np.concatenate(parts[::-1]) if parts else np.empty(0, self.dtype)

    def close(self) -> list[dict[str, Any]]:
        self._close_file()
        return [
            {"file": name, "split": self.split, "tokens": n, **digest.record()}
            for (name, n), digest in zip(self.shards, self.digests)
        ]

    def split_record(self) -> dict[str, Any]:
        """The split's entry in manifest.json (after `close`)."""
        return {"tokens": self.tokens, "documents": self.documents, "shards": len(self.shards)}


class WeightedShardWriter(ShardWriter):
    """A split of rows for FORMAT_VERSION 2: the ids, each token's loss weight in a
    `<shard>.weights.bin` beside its shard, and the split offset of every document's first token
    in `<split>.documents.bin` (the module docstring)."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        super().__init__(directory, split, dtype, shard_tokens)
        self.weight_digests: list[Any] = []  # one sha256 per shard's weights file
        self._weights_fh: Any = None
        self.documents_file = f"{split}.documents.bin"
        self._starts_fh: Any = open(directory / self.documents_file, "wb")
        self._starts_sha = hashlib.sha256()
        self.starts = 0  # documents recorded (conversations and padding)
        self.rows = 0

    def _open_next(self) -> None:
        super()._open_next()
        self._weights_fh = open(self.directory / weights_file(self.shards[-1][0]), "wb")
        self.weight_digests.append(hashlib.sha256())

    def _close_file(self) -> None:
        super()._close_file()
        if self._weights_fh is not None:
            self._weights_fh.close()
            self._weights_fh = None

    def _append(self, tokens: np.ndarray, weights: np.ndarray | None) -> None:
        assert weights is not None and len(weights) == len(tokens), "a weighted split needs every weight"
        data = np.ascontiguousarray(weights, dtype=WEIGHT_DTYPE).tobytes()
        self._weights_fh.write(data)
        self.weight_digests[-1].update(data)
        super()._append(tokens, weights)

    def write_row(
        self, tokens: np.ndarray, weights: np.ndarray, starts: list[int], conversations: int
    ) -> None:
        """Append one row: its ids, their weights (0 or 1), the row offsets of its documents'
        first tokens (0 first) and how many of its documents are conversations."""
        offsets = np.asarray(starts, dtype=START_DTYPE) + np.uint64(self.tokens)  # (documents,)
        data = offsets.tobytes()
        self._starts_fh.write(data)
        self._starts_sha.update(data)
        self.starts += len(offsets)
        self.documents += conversations
        self.rows += 1
        self.write(tokens, weights)

    def close(self) -> list[dict[str, Any]]:
        records = super().close()
        if self._starts_fh is not None:
            self._starts_fh.close()
            self._starts_fh = None
        for record, digest in zip(records, self.weight_digests):
            record.update(weights_file=weights_file(record["file"]), weights_sha256=digest.hexdigest())
        return records

    def split_record(self) -> dict[str, Any]:
        return {
            **super().split_record(),
            "rows": self.rows,
            "documents_file": self.documents_file,
            "document_starts": self.starts,
            "documents_sha256": self._starts_sha.hexdigest(),
        }


def weights_file(shard_file: str) -> str:
    """The name of the loss weights beside a shard: train_0000.bin -> train_0000.weights.bin."""
    return shard_file.removesuffix(".bin") + ".weights.bin"


# ----------------------------------------------------------------------------- reading


class SplitTokens:
    """One split's shards as a single read-only token array (memory-mapped, never loaded); in
    FORMAT_VERSION 2 also its loss weights and document starts."""

    def __init__(
        self,
        directory: Path,
        shards: list[dict[str, Any]],
        dtype: np.dtype,
        split: dict[str, Any] | None = None,  # the manifest's record of the split
    ):
        shards = [s for s in shards if int(s["tokens"]) > 0]
        self.files = [str(s["file"]) for s in shards]
        # plain arrays over the maps: slicing one costs a quarter of slicing a np.memmap
        self.shards = [_mapped(directory / s["file"], dtype, int(s["tokens"])) for s in shards]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])  # (n_shards + 1,)
        self.weights: list[np.ndarray] | None = None  # per shard, each token's loss weight
        self.document_starts: np.ndarray | None = None  # (documents,) the split offsets
        if split is not None and "documents_file" in split:
            self.weights = [
                _mapped(directory / s["weights_file"], WEIGHT_DTYPE, int(s["tokens"])) for s in shards
            ]
            count = int(split["document_starts"])
            self.document_starts = _mapped(directory / split["documents_file"], START_DTYPE, count)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length), across shard boundaries when needed."""
        return self._read(self.shards, start, length)

    def read_weights(self, start: int, length: int) -> np.ndarray | None:  # (length,) uint8
        """The stored loss weights of tokens [start, start + length); None when the split has none."""
        return None if self.weights is None else self._read(self.weights, start, length)

    def read_documents(self, start: int, length: int) -> np.ndarray | None:  # (length,) int64
        """The stored document index of tokens [start, start + length) (non-decreasing); None when
        the split stores no document starts (its documents end with eos)."""
        if self.document_starts is None:
            return None
        positions = np.arange(start, start + length, dtype=np.uint64)  # (length,)
        return np.searchsorted(self.document_starts, positions, side="right").astype(np.int64) - 1

    def _read(self, arrays: list[np.ndarray], start: int, length: int) -> np.ndarray:
        parts = []
        end = start + length
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < end:
            shard = arrays[i]
            lo = start - int(self.starts[i])
            take = min(end - start, len(shard) - lo)
            parts.append(shard[lo : lo + take])
            start += take
            i += 1
        return np.concatenate(parts) if len(parts) > 1 else np.asarray(parts[0])

    def locate(self, start: int) -> tuple[str, int]:
        """(shard file name, offset in it) of token `start` of the split: where a sequence comes from."""
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        return self.files[i], start - int(self.starts[i])


class PreparedData:
    """A prepared directory, checked against its manifest on opening."""

    def __init__(
        self, directory: str | Path, full_check_bytes: int | None = None, id_check_bytes: int | None = None
    ):
        self.dir = Path(directory)
        self.manifest = read_manifest(self.dir, full_check_bytes, id_check_bytes)
        tok = self.manifest["tokenizer"]
        self.vocab_size = int(tok["vocab_size"])
        self.eos_id = int(tok["eos_id"])
        self.tokenizer_path = self.dir / tok["file"]
        self.tokenizer_sha256 = str(tok["sha256"])
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        # chat: the tokens of the rows every split is cut into (no conversation crosses a row)
        self.row_tokens: int | None = self.manifest.get("row_tokens")
        self._splits: dict[str, SplitTokens] = {}

    def split(self, name: str) -> SplitTokens:
        if name not in self.manifest["splits"]:
            raise DataError(f"{self.dir} has no split {name!r} (it has {sorted(self.manifest['splits'])})")
        if name not in self._splits:
            shards = [s for s in self.manifest["shards"] if s["split"] == name]
            record = self.manifest["splits"][name]
            self._splits[name] = SplitTokens(self.dir, shards, self.dtype, record)
        return self._splits[name]

    def split_sha256(self, name: str) -> str:
        """A digest of split `name` as its manifest records it (each shard's name, size and sha256):
        what a resumed loader checks it continues on the same tokens."""
        shards = [
            [s["file"], s["tokens"], s.get("sha256")] for s in self.manifest["shards"] if s["split"] == name
        ]
        return hashlib.sha256(json.dumps(shards).encode("utf-8")).hexdigest()

    def check_sequences(self, tokens_per_sample: int) -> None:
        """Refuse data whose train or val split cannot fill one sequence, or conversations packed
        into rows of another length (before a run starts)."""
        check_row_length(self, tokens_per_sample)
        for split in SPLITS:
            n_tokens = len(self.split(split))
            if n_tokens < tokens_per_sample:
                raise too_short(self.dir, split, n_tokens, tokens_per_sample)

    def check_model(self, model: ModelConfig) -> None:
        """Refuse a model whose vocabulary differs from the tokenizer the shards were made with (its
        model.tokenizer_vocab_size when set: the embedding's rows past it are padding)."""
        if model.tokenizer_vocab_size is not None:
            if model.tokenizer_vocab_size != self.vocab_size:
                raise DataError(
                    f"model.tokenizer_vocab_size={model.tokenizer_vocab_size} but {self.dir} was tokenized "
                    f"with a {self.vocab_size}-piece tokenizer; prepare the data with the model's tokenizer"
                )
            return
        if model.vocab_size != self.vocab_size:
            padding = (
                f" (or model.tokenizer_vocab_size={self.vocab_size}, the rest of the rows padding)"
                if model.vocab_size > self.vocab_size
                else ""
            )
            raise DataError(
                f"model.vocab_size={model.vocab_size} but {self.dir} was tokenized with a "
                f"{self.vocab_size}-piece tokenizer; set model.vocab_size={self.vocab_size}{padding} or "
                f"re-run lmsys-prepare data.dir={self.dir} model.vocab_size={model.vocab_size}"
            )


def check_row_length(data: PreparedData, tokens_per_sample: int) -> None:
    """DataError when `data` holds rows of another length than the loader's samples of
    `tokens_per_sample` tokens (conversations packed for another data.seq_len or objective)."""
    if data.row_tokens is not None and data.row_tokens != tokens_per_sample:
        made_for = data.manifest.get("seq_len")
        raise DataError(
            f"{data.dir} holds conversations packed for data.seq_len={made_for} (rows of {data.row_tokens} "
            f"tokens), but this run reads samples of {tokens_per_sample}; set data.seq_len={made_for} as "
            "it was prepared, or prepare the conversations again with this run's data.seq_len and model"
        )


def _mapped(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """`count` values of `dtype` memory-mapped from `path`, read-only (an empty array for 0)."""
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.asarray(np.memmap(path, dtype=dtype, mode="r", shape=(count,)))


def too_short(data_dir: Path, split: str, n_tokens: int, tokens_per_sample: int) -> DataError:
    return DataError(
        f"the {split} split of {data_dir} holds {n_tokens} tokens, fewer than one sequence of "
        f"{tokens_per_sample}; use more text (or raise data.val_fraction) and prepare again, "
        "or shorten data.seq_len"
    )
