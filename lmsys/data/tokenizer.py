"""Tokenizers: one interface, two backends, and the training of lmsys's own SentencePiece model.

`Tokenizer(path)` opens either kind; everything else in lmsys (prepare, the loader, generate,
eval, export) sees only its interface: `encode`, `encode_batch`, `decode`, `encode_documents`,
`vocab_size`, `sha256`, the special ids `pad_id`/`bos_id`/`eos_id`/`unk_id` (None when the
tokenizer has no such token) and `copy_to`. `path` is a file or a directory holding one:
- `tokenizer.model` (kind "sentencepiece", preferred in a directory): a SentencePiece model with
  lmsys's reserved ids pad=0, bos=1, eos=2, unk=3, as lmsys-prepare trains it;
- `tokenizer.json` (kind "hf"): a Hugging Face `tokenizers` file, e.g. GPT-2's byte-level BPE. Its
  special tokens come from the `tokenizer_config.json` (or `special_tokens_map.json`) beside it,
  as transformers reads them; without one, `<|endoftext|>` is eos, bos and unk (GPT-2's
  convention, what transformers' GPT2Tokenizer assumes). An eos is required: lmsys ends every
  document with it. Text is encoded exactly as `AutoTokenizer.from_pretrained(dir)` does with
  `add_special_tokens=False` (its `split_special_tokens` setting included); padding and
  truncation set in the file are turned off (lmsys packs documents itself).
Neither kind adds bos/eos in `encode`; the packer appends `eos_id` after every document.

SPEC section 1: byte-pair encoding learned from the corpus, SentencePiece in BPE mode with
`byte_fallback=True`, and reserved ids pad=0, bos=1, eos=2, unk=3 (eos separates documents).

Training options are chosen so that `decode(encode(s)) == s` for every string `s`:
- `normalization_rule_name="identity"`: no NFKC, so compatibility characters, combining marks
  and full-width forms stay as they are;
- `add_dummy_prefix=False`, `remove_extra_whitespaces=False`: leading, trailing and repeated
  spaces are text like any other (`allow_whitespace_only_pieces` lets indentation merge);
- `byte_fallback=True`: a character outside the vocabulary (an unseen script, an emoji, a
  control character) becomes its UTF-8 bytes, never `unk`;
- `split_digits=True`: numbers are spelled digit by digit, a common choice for small vocabularies;
- `character_coverage=0.9995`; when the sample has more distinct characters than the vocabulary
  can hold, only the most frequent ones (about half the free ids) are trained on and the rest
  are spelled in bytes, so a small vocabulary trains on any text.
Training runs on one thread: SentencePiece's multi-threaded BPE counting gives a different
model for a different thread count, and the same seed and corpus must give the same file.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import json
import os
import random
import re
import shutil
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import tokenizers

from lmsys.core.errors import DataError
from lmsys.core.files import atomic_write_text
from lmsys.data.corpus import Corpus, FileCorpus, SourceFile, split_for_training
from lmsys.data.shards import token_dtype

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3  # lmsys's SentencePiece models
RESERVED = 4 + 256  # the special pieces plus the 256 byte-fallback pieces
# SentencePiece training "sentence" cap; longer text is cut (corpus.split_for_training)
MAX_SENTENCE_BYTES = 8192

SENTENCEPIECE_FILE = "tokenizer.model"
HF_TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = (SENTENCEPIECE_FILE, HF_TOKENIZER_FILE)  # in the order a directory is searched
HF_TOKENIZER_CONFIG = "tokenizer_config.json"  # transformers' settings beside a tokenizer.json
HF_SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # older transformers' file of special tokens
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # a chat template beside the tokenizer (transformers' name)
SPECIAL_NAMES = ("pad", "bos", "eos", "unk")
GPT2_EOS = "<|endoftext|>"


def tokenizer_file(path: str | os.PathLike) -> Path:
    """The tokenizer file `path` names: itself, or in a directory its tokenizer.model, else its
    tokenizer.json. DataError when there is none."""
    p = Path(path).expanduser()
    if p.is_dir():
        for name in TOKENIZER_FILES:
            if (p / name).is_file():
                return p / name
        hint = ""
        if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            hint = (
                "; it has GPT-2's vocab.json and merges.txt: write a tokenizer.json with transformers, "
                f"AutoTokenizer.from_pretrained('{p}').save_pretrained('{p}')"
            )
        raise DataError(f"tokenizer directory {p} holds no {' or '.join(TOKENIZER_FILES)}{hint}")
    if not p.is_file():
        raise DataError(f"tokenizer {p} does not exist")
    return p


class Tokenizer:
    """A tokenizer of either kind (module docstring): `Tokenizer(path)` opens it and checks it.

    `encode` never adds bos/eos; the packer appends `eos_id` after every document itself.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = tokenizer_file(path)
        data = self.path.read_bytes()
        self.sha256 = hashlib.sha256(data).hexdigest()
        is_json = self.path.suffix == ".json"
        self._backend = _TokenizerJson(self.path, data) if is_json else _SentencePiece(self.path, data)
        self.kind: str = self._backend.kind
        self.file_name = HF_TOKENIZER_FILE if is_json else SENTENCEPIECE_FILE  # its name in lmsys's dirs
        self.vocab_size: int = self._backend.vocab_size
        self.special_tokens: dict[str, str] = self._backend.special_tokens  # e.g. {"eos": "</s>"}
        ids = {name: self._backend.token_id(token) for name, token in self.special_tokens.items()}
        self.pad_id: int | None = ids.get("pad")
        self.bos_id: int | None = ids.get("bos")
        self.eos_id: int = ids["eos"]
        self.unk_id: int | None = ids.get("unk")
        # Whether text spelling a special token ("</s>") is encoded as text (transformers' name):
        # always for SentencePiece, as the tokenizer.json's transformers settings say otherwise.
        self.split_special_tokens: bool = self._backend.split_special_tokens
        self.dtype = token_dtype(self.vocab_size)
        self.training_info: dict[str, Any] | None = None  # set by train_tokenizer
        # The Jinja chat template transformers would use (chat_template.jinja beside the file, else
        # tokenizer_config.json's chat_template), None without one; lmsys.data.chat renders it.
        self.chat_template: str | None = _chat_template(self.path.parent, self.kind)
        # Special tokens a rendered chat writes as text and the encoding reads as one id each:
        # a tokenizer.json's special added tokens; SentencePiece's bos and eos.
        self.control_tokens: dict[str, int] = self._backend.control_tokens(self.special_tokens)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({str(self.path)!r}, kind={self.kind}, vocab_size={self.vocab_size}, "
            f"sha256={self.sha256[:12]})"
        )

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return self._backend.encode_batch(list(texts), num_threads)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`; pad/bos/eos (the control tokens) decode to nothing, or with
        skip_special=False to their text; an invalid byte sequence to U+FFFD."""
        if hasattr(ids, "tolist"):  # a tensor or an array
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        if skip_special or not ids:
            return self._backend.decode(ids)
        control = {i: token for token, i in self.control_tokens.items()}
        parts, run = [], []  # decoded runs between control tokens, and the tokens' text
        for i in ids:
            if i in control:
                parts += [self._backend.decode(run), control[i]]
                run = []
            else:
                run.append(i)
        return "".join(parts) + self._backend.decode(run)

    def encode_chat(self, text: str) -> tuple[list[int], list[int]]:
        """(ids, the character offset in `text` where each id starts) of a rendered chat, whose
        control tokens (`<|im_end|>`, `</s>`, ...) are read as their ids: a tokenizer.json
        encodes it as transformers' apply_chat_template does (added tokens matched, no special
        tokens added); SentencePiece encodes the text between its bos and eos strings."""
        return self._backend.encode_offsets(text, self.control_tokens)

    def id_to_piece(self, i: int) -> str:
        return self._backend.id_to_piece(int(i))

    def special_ids(self) -> dict[str, int | None]:
        return {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id, "unk_id": self.unk_id}

    def encode_documents(
        self, texts: list[str], ends: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Pack documents: `(tokens, lengths)` where tokens is every text's ids followed by
        `eos_id`, concatenated, and lengths[i] counts text i's ids plus its eos. With `ends`
        (bool, one per text), a text is a piece of a document and gets an eos only where
        `ends[i]` (the document's last piece)."""
        # A batch call: both backends encode with the GIL released (EncoderPool relies on it).
        encoded = self._backend.encode_batch(texts, 1)
        flags = [True] * len(texts) if ends is None else np.asarray(ends, dtype=bool).tolist()
        for ids, end in zip(encoded, flags, strict=True):
            if end:
                ids.append(self.eos_id)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))  # (texts,)
        tokens = np.fromiter(chain.from_iterable(encoded), dtype=self.dtype, count=int(lengths.sum()))
        return tokens, lengths

    def copy_to(self, directory: Path, model_max_length: int | None = None) -> Path:
        """Put this tokenizer into `directory` under its kind's name and return that file: a copy
        of tokenizer.model, or of tokenizer.json with a tokenizer_config.json naming its special
        tokens (so it reopens with the same ids, in lmsys and in transformers)."""
        target = directory / self.file_name
        shutil.copyfile(self.path, target)
        if self.kind == "hf":
            write_tokenizer_config(directory, self, model_max_length)
        elif self.chat_template is not None:
            atomic_write_text(directory / CHAT_TEMPLATE_FILE, self.chat_template)
        return target


def write_tokenizer_config(directory: Path, tok: Tokenizer, model_max_length: int | None = None) -> None:
    """transformers' tokenizer_config.json for `tok`'s ids: the generic fast tokenizer class (it
    runs tokenizer.json as it is, where a model-specific class may rebuild it), the special
    tokens, no bos/eos added, no clean-up of spaces in decoding."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{name}_token": token for name, token in tok.special_tokens.items()},
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": tok.split_special_tokens,
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    atomic_write_text(
        directory / HF_TOKENIZER_CONFIG, json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    )


class _SentencePiece:
    """A SentencePiece model with lmsys's reserved ids (DataError otherwise)."""

    kind = "sentencepiece"
    split_special_tokens = True  # SentencePiece never reads a control token from text

    def __init__(self, path: Path, data: bytes):
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except Exception as e:  # a truncated file or not a SentencePiece model at all
            raise DataError(
                f"tokenizer {path} is not a SentencePiece model ({str(e).splitlines()[0]})"
            ) from e
        ids = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id())
        if ids != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            beside = path.with_name(HF_TOKENIZER_FILE)
            hint = (
                f"; pass data.tokenizer={beside} to use the tokenizer.json beside it"
                if beside.is_file()
                else ""
            )
            raise DataError(
                f"tokenizer {path} has pad/bos/eos/unk ids {ids}; lmsys needs "
                f"{(PAD_ID, BOS_ID, EOS_ID, UNK_ID)} (train it with lmsys-prepare){hint}"
            )
        self.vocab_size = int(self._sp.get_piece_size())
        self.special_tokens = {name: self._sp.id_to_piece(i) for name, i in zip(SPECIAL_NAMES, ids)}

    def token_id(self, token: str) -> int:
        return int(self._sp.piece_to_id(token))

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], num_threads: int) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(i)

    def control_tokens(self, special_tokens: dict[str, str]) -> dict[str, int]:
        return {special_tokens[name]: self.token_id(special_tokens[name]) for name in ("bos", "eos")}

    def encode_offsets(self, text: str, control: dict[str, int]) -> tuple[list[int], list[int]]:
        """The pieces between control tokens, each with its first character's offset (the proto's
        byte offsets turned into characters)."""
        ids: list[int] = []
        starts: list[int] = []
        pattern = "|".join(re.escape(token) for token in sorted(control, key=len, reverse=True))
        at = 0
        for match in [*re.finditer(pattern, text), None]:
            end = match.start() if match else len(text)
            if end > at:
                piece = text[at:end]
                char_of_byte = np.cumsum([0] + [len(c.encode("utf-8")) for c in piece])  # (chars + 1,)
                for p in self._sp.encode(piece, return_type="proto").pieces:
                    ids.append(int(p.id))
                    starts.append(at + int(np.searchsorted(char_of_byte, p.begin, side="right")) - 1)
            if match:
                ids.append(control[match.group()])
                starts.append(match.start())
                at = match.end()
        return ids, starts


class _TokenizerJson:
    """A Hugging Face tokenizer.json, run by the `tokenizers` library, with the special tokens
    and `split_special_tokens` of the transformers settings beside it."""

    kind = "hf"

    def __init__(self, path: Path, data: bytes):
        try:
            self._tk = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # not UTF-8, not JSON, or not a tokenizer the library knows
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise DataError(f"tokenizer {path} is not a Hugging Face tokenizer.json ({first})") from e
        self._tk.no_padding()
        self._tk.no_truncation()
        settings = _transformers_settings(path.parent)
        self.split_special_tokens = bool(settings.get("split_special_tokens", False))
        self._tk.encode_special_tokens = self.split_special_tokens
        vocab = self._tk.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.special_tokens = self._special_tokens(path, settings)

    def _special_tokens(self, path: Path, settings: dict[str, Any]) -> dict[str, str]:
        named = {name: _token_text(settings.get(f"{name}_token")) for name in SPECIAL_NAMES}
        found = {name: token for name, token in named.items() if token is not None}
        if "eos" not in found and self._tk.token_to_id(GPT2_EOS) is not None:
            # GPT-2's files name no special token: transformers' GPT2Tokenizer assumes these.
            found = {"bos": GPT2_EOS, "eos": GPT2_EOS, "unk": GPT2_EOS, **found}
        if "eos" not in found:
            raise DataError(
                f"tokenizer {path} names no end-of-document token (lmsys ends every document with one): "
                f'give it an "eos_token" in {path.parent / HF_TOKENIZER_CONFIG}'
            )
        for name, token in found.items():
            if self._tk.token_to_id(token) is None:
                raise DataError(f"tokenizer {path}: its {name}_token {token!r} is not in its vocabulary")
        return {name: found[name] for name in SPECIAL_NAMES if name in found}

    def token_id(self, token: str) -> int:
        return int(self._tk.token_to_id(token))

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int) -> list[list[int]]:
        # the library releases the GIL and spreads a batch over its own threads (num_threads unused)
        return [e.ids for e in self._tk.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tk.decode(ids, skip_special_tokens=True)

    def id_to_piece(self, i: int) -> str:
        return self._tk.id_to_token(i) or ""

    def control_tokens(self, special_tokens: dict[str, str]) -> dict[str, int]:
        return {t.content: int(i) for i, t in self._tk.get_added_tokens_decoder().items() if t.special}

    def encode_offsets(self, text: str, control: dict[str, int]) -> tuple[list[int], list[int]]:
        encoding = self._tk.encode(text, add_special_tokens=False)
        return list(encoding.ids), [start for start, _ in encoding.offsets]


def _transformers_settings(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json over special_tokens_map.json, as transformers merges them ({} if neither)."""
    settings: dict[str, Any] = {}
    for name in (HF_SPECIAL_TOKENS_MAP, HF_TOKENIZER_CONFIG):
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DataError(f"{path} is not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise DataError(f"{path} is not a JSON object")
        settings.update(data)
    return settings


def _chat_template(directory: Path, kind: str) -> str | None:
    """The chat template saved beside a tokenizer: chat_template.jinja (transformers' own file,
    which it prefers), else a tokenizer.json's tokenizer_config.json `chat_template` (a string, or
    a list of named templates: the one named "default")."""
    path = directory / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = _transformers_settings(directory).get("chat_template") if kind == "hf" else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _token_text(value: Any) -> str | None:
    """A special token as transformers saves it: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and SLURM restrict)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class EncoderPool:
    """Threads that run `Tokenizer.encode_documents` on batches of text.

    Threads, not processes: SentencePiece (and `tokenizers`, for a tokenizer.json) encodes a
    batch with the GIL released, so the threads
    encode in parallel while the calling thread reads the corpus and writes shards, and nothing
    is pickled or copied between processes (tools.bench prepare on 2 cores: 1.76x single-process
    SentencePiece, where the process pool this replaced reached 1.66x). `encode` keeps at most
    `in_flight` batches (default 3 per thread) queued or being encoded, so memory stays bounded
    whatever the number of batches, and yields results in input order. With one worker it
    encodes in the calling thread.
    """

    def __init__(self, num_workers: int = 0):
        self.workers = num_workers or available_cores()
        self._executor: ThreadPoolExecutor | None = None
        if self.workers > 1:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="lmsys-encode")

    def __enter__(self) -> EncoderPool:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def encode(
        self,
        tok: Tokenizer,
        batches: Iterable[tuple[list[str], np.ndarray | None]],
        in_flight: int | None = None,
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """`tok.encode_documents(texts, ends)` for each `(texts, ends)` batch, in order."""
        if self._executor is None:
            for texts, ends in batches:
                yield tok.encode_documents(texts, ends)
            return
        in_flight = in_flight or 3 * self.workers
        pending: deque[Future] = deque()
        for texts, ends in batches:
            pending.append(self._executor.submit(tok.encode_documents, texts, ends))
            if len(pending) >= in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


# ----------------------------------------------------------------------------- training


def _documents(texts_or_files: Corpus | Iterable[str | os.PathLike]) -> Iterator[str]:
    """Texts to sample from: a corpus's pieces (bounded size), or the strings and files given."""
    if isinstance(texts_or_files, Corpus):
        for text, _ in texts_or_files.pieces():
            yield text
        return
    for item in texts_or_files:
        if isinstance(item, os.PathLike):
            path = Path(item).resolve()
            st = path.stat() if path.exists() else None
            if st is None:
                raise DataError(f"tokenizer training file {path} does not exist")
            for text, _ in FileCorpus([SourceFile(path, st.st_size, st.st_mtime_ns)]).pieces():
                yield text
        else:
            yield item


def sample_sentences(
    texts_or_files: Corpus | Iterable[str | os.PathLike],
    sample_bytes: int,
    seed: int,
    max_sentence_bytes: int = MAX_SENTENCE_BYTES,
) -> tuple[list[str], dict[str, int]]:
    """A uniform random sample of training sentences (paragraph pieces) of at most
    `sample_bytes` UTF-8 bytes in all, in corpus order, in one streaming pass.

    Priority sampling: every piece draws a key from `random.Random(seed)`; the pieces with the
    smallest keys are kept while they fit in the budget (a max-heap evicts the largest key).
    Memory is bounded by the budget, and the sample is the same for the same corpus and seed.
    """
    rng = random.Random(seed)
    heap: list[tuple[float, int, str]] = []  # (-key, index, piece)
    kept = 0
    seen_bytes = 0
    index = 0
    for doc in _documents(texts_or_files):
        for piece in split_for_training(doc, max_sentence_bytes):
            size = len(piece.encode("utf-8"))
            seen_bytes += size
            key = rng.random()
            index += 1
            if size > sample_bytes:
                continue
            if kept + size > sample_bytes and heap and -heap[0][0] < key:
                continue  # larger key than everything kept, and no room: never enters
            heapq.heappush(heap, (-key, index, piece))
            kept += size
            while kept > sample_bytes:
                _, _, evicted = heapq.heappop(heap)
                kept -= len(evicted.encode("utf-8"))
    chosen = [piece for _, _, piece in sorted(heap, key=lambda item: item[1])]
    info = {
        "corpus_bytes": seen_bytes,
        "corpus_sentences": index,
        "sample_bytes": kept,
        "sample_sentences": len(chosen),
    }
    return chosen, info


_TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_TOO_SMALL = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def _training_error(exc: Exception, vocab_size: int, info: dict[str, int]) -> DataError:
    message = str(exc)
    where = f"the tokenizer sample ({info['sample_bytes']:,} bytes)"
    if m := _TOO_HIGH.search(message):
        return DataError(
            f"vocab_size={vocab_size} is too large for {where}: it supports at most {m.group(2)}; "
            "lower model.vocab_size or give more text"
        )
    if m := _TOO_SMALL.search(message):
        need = int(m.group(2))
        return DataError(
            f"vocab_size={vocab_size} is too small for {where}: its {need - RESERVED} distinct characters "
            f"plus {RESERVED} reserved pieces (4 special, 256 bytes) need at least {need}; "
            "raise model.vocab_size"
        )
    if "sentences_.empty()" in message:
        return DataError("no text to train the tokenizer on")
    first = message.strip().splitlines()[0] if message.strip() else type(exc).__name__
    return DataError(f"SentencePiece training failed: {first}")


def train_tokenizer(
    texts_or_files: Corpus | Iterable[str | os.PathLike],
    vocab_size: int,
    out_path: str | Path,
    sample_bytes: int = 20_000_000,
    seed: int = 1234,
    character_coverage: float = 0.9995,
) -> Tokenizer:
    """Train a BPE tokenizer of exactly `vocab_size` pieces and write it to `out_path`.

    `texts_or_files`: a Corpus, or an iterable of document strings and/or paths
    (`pathlib.Path`, read like a `data.sources` file). Training uses a random sample of at
    most `sample_bytes` of text (`sample_sentences`), so a corpus of any size trains in
    bounded time and memory. Deterministic: the same corpus and seed give the same file.
    The model file is written to a temporary name next to `out_path`, then renamed.
    Raises DataError (one line) when the corpus cannot support `vocab_size`.
    """
    if vocab_size <= RESERVED:
        raise DataError(
            f"vocab_size={vocab_size} is too small: {RESERVED} ids are reserved (4 special, 256 bytes); "
            "raise model.vocab_size"
        )
    if sample_bytes < 1:
        raise DataError(f"tokenizer sample_bytes={sample_bytes} must be >= 1")
    sentences, info = sample_sentences(texts_or_files, sample_bytes, seed)
    if not sentences:
        raise DataError("no text to train the tokenizer on")
    rare = 0
    try:
        model = _train_bpe(sentences, vocab_size, character_coverage, seed)
    except RuntimeError as e:
        if not _TOO_SMALL.search(str(e)):
            raise _training_error(e, vocab_size, info) from e
        # More distinct characters than the vocabulary holds (a small vocabulary, a multilingual
        # corpus): the most frequent ones may fill about half the free ids, the others are taken
        # out of the training sample, so they get no piece and byte_fallback spells them.
        # Lossless: every string still round-trips.
        sentences, rare = _drop_rare_characters(sentences, (vocab_size - RESERVED) // 2)
        try:
            model = _train_bpe(sentences, vocab_size, character_coverage, seed)
        except RuntimeError as e2:
            raise _training_error(e2, vocab_size, info) from e2
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(model.getvalue())
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    tok = Tokenizer(out_path)
    tok.training_info = {
        **info,
        "seed": seed,
        "character_coverage": character_coverage,
        "rare_characters_left_to_bytes": rare,
    }
    return tok


def _drop_rare_characters(sentences: list[str], keep: int) -> tuple[list[str], int]:
    """The sentences without the characters outside the `keep` most frequent ones (ties by code
    point, for determinism); and how many distinct characters were dropped."""
    counts: Counter[str] = Counter()
    for text in sentences:
        counts.update(text)
    ranked = sorted(counts, key=lambda c: (-counts[c], c))
    table = dict.fromkeys(map(ord, ranked[keep:]))  # ord -> None: delete
    kept = [t for t in (text.translate(table) for text in sentences) if t]
    return kept, len(ranked) - min(keep, len(ranked))


def _train_bpe(sentences: list[str], vocab_size: int, character_coverage: float, seed: int) -> io.BytesIO:
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        byte_fallback=True,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        max_sentence_length=MAX_SENTENCE_BYTES,
        input_sentence_size=0,  # the sample is already bounded; take all of it
        shuffle_input_sentence=False,
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        hard_vocab_limit=True,
        num_threads=1,
        minloglevel=2,
    )
    return model
