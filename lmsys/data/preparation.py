"""Preparing data: raw text -> a tokenizer, token shards and manifest.json in `data.dir`, for
lmsys-prepare (lmsys/prepare.py).

Steps: resolve `data.sources` (empty: the default corpus, Python stdlib docstrings), train a
SentencePiece BPE tokenizer of `model.vocab_size` pieces on a bounded random sample (or use
`data.tokenizer`: lmsys's tokenizer.model, or a Hugging Face tokenizer.json such as GPT-2's;
see lmsys/data/tokenizer.py), encode every document on `data.num_workers` threads, append `eos`
after each, send each document to the train or validation split, and write the splits as
shards of at most `data.shard_tokens` tokens. Everything streams: documents go to the workers in
batches of about 256 KB with a bounded number in flight, a long text file is read and encoded
in pieces of about 4 MB (lmsys.data.corpus), and tokens go straight to the shard files, so memory
does not grow with the corpus. The threads encode with the GIL released (SentencePiece and
`tokenizers` batch calls) while this thread reads the next documents and writes the shards.

data.format=chat reads JSON Lines of conversations instead, renders them with the tokenizer's chat
template and packs them into weighted rows (lmsys/data/chat_preparation.py); the rest (the
tokenizer's copy, the temporary directory, reuse and refusal) is shared.

Output: the prepared-data format of lmsys/data/shards.py (the tokenizer, uint16/uint32 shards,
manifest.json). lmsys-prepare's manifest also records the sources read (files with sizes, or the
default corpus and the Python version), the data config, the creation time, the encoding
timings, and the `fingerprint` used to decide reuse.

Split rule: document i (0-based, in corpus order) goes to validation when
`splitmix64(i + seed * 0x9E3779B97F4A7C15) / 2**64 < val_fraction`; if that leaves a split
without documents and there are at least two, the last document of the other split moves over.

Safety: everything is written to a temporary directory next to `data.dir`, renamed into place
only when complete; on any error the temporary directory is removed. A `data.dir` whose manifest
fingerprint matches this run (same sources with the same sizes and mtimes, vocabulary, tokenizer,
seed, split and shard settings) and whose shards check out is reused as is. Prepared data is
replaced only with `data.overwrite=true`: a `data.dir` prepared from other sources or settings,
or whose shards do not check out, is refused in one line saying what differs (sources,
tokenizer, settings) and how to proceed; a non-empty `data.dir` without a manifest.json is never
replaced.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from lmsys.core.config import Config, DataConfig, config_to_dict, tokens_per_sample
from lmsys.core.console import warn
from lmsys.core.errors import DataError
from lmsys.core.files import install_dir, sibling
from lmsys.data.chat import ChatTemplate
from lmsys.data.chat_preparation import chat_template, template_sha256, write_conversations
from lmsys.data.corpus import Corpus, FileCorpus, open_corpus
from lmsys.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    WEIGHTED_FORMAT_VERSION,
    ShardWriter,
    read_manifest,
    token_dtype,
    write_manifest,
)
from lmsys.data.tokenizer import SENTENCEPIECE_FILE, EncoderPool, Tokenizer, train_tokenizer

PROG = "lmsys-prepare"
BATCH_BYTES = 1 << 18  # documents are sent to workers in batches of about this much text
BATCH_DOCS = 1024


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


# ----------------------------------------------------------------------------- the split


_MASK64 = (1 << 64) - 1


def validation_mask(indices: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """True for the documents (by 0-based corpus index) that go to the validation split:
    splitmix64 of the index offset by the seed, as a uniform number in [0, 1), below `fraction`."""
    with np.errstate(over="ignore"):
        x = indices.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) & _MASK64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < fraction


# ----------------------------------------------------------------------------- prepare


def _say(message: str) -> None:
    print(f"{PROG}: {message}", flush=True)


def _fingerprint(
    cfg: Config, corpus: Corpus, given: Tokenizer | None, template: ChatTemplate | None = None
) -> dict[str, Any]:
    d = cfg.data
    chat = {}
    if template is not None:  # absent for text, as in the data prepared before chat existed
        chat = {"format": "chat", "seq_len": d.seq_len, "packing": d.packing, "overlong": d.overlong,
                "chat_template_sha256": template_sha256(template)}  # fmt: skip
    return {
        **chat,
        "version": WEIGHTED_FORMAT_VERSION if template is not None else FORMAT_VERSION,
        "sources": corpus.fingerprint(),
        "vocab_size": d.vocab_size,
        "tokenizer": {"sha256": given.sha256}
        if given
        else {"trained_on_sample_bytes": d.tokenizer_sample_bytes},
        "seed": d.seed,
        "val_fraction": d.val_fraction,
        "shard_tokens": d.shard_tokens,
    }


def _batches(corpus: Corpus, sent: deque) -> Iterator[tuple[list[str], np.ndarray]]:
    """`(texts, ends)`: the corpus's pieces in batches of about BATCH_BYTES, with `ends[i]` true
    where piece i ends its document; `(characters, ends)` of each batch also goes to `sent`, for
    the consumer of the (in-order) encoded results."""
    batch: list[str] = []
    ends: list[bool] = []
    nchars = 0
    for text, end in corpus.pieces():
        batch.append(text)
        ends.append(end)
        nchars += len(text)
        if nchars >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
            yield _sent(sent, batch, ends, nchars)
            batch, ends, nchars = [], [], 0
    if batch:
        yield _sent(sent, batch, ends, nchars)


def _sent(sent: deque, batch: list[str], ends: list[bool], nchars: int) -> tuple[list[str], np.ndarray]:
    flags = np.array(ends, dtype=bool)  # (pieces,)
    sent.append((nchars, flags))
    return batch, flags


def _progress(unit: str, desc: str) -> tqdm:
    # disable=None: a live bar on a terminal; nothing in logs (a summary line is printed instead)
    return tqdm(desc=desc, unit=unit, unit_scale=True, file=sys.stderr, disable=None, leave=False)


def _encode_into(
    tok: Tokenizer, corpus: Corpus, cfg: Config, tmp: Path
) -> tuple[dict[str, ShardWriter], dict[str, Any]]:
    d = cfg.data
    writers = {s: ShardWriter(tmp, s, token_dtype(tok.vocab_size), d.shard_tokens) for s in SPLITS}
    sent: deque = deque()  # (characters, ends) of the batches given to the pool, in order
    next_doc = 0  # corpus index of the document the next piece belongs to
    start, cpu_start, main_start = time.perf_counter(), time.process_time(), time.thread_time()
    with EncoderPool(d.num_workers) as pool, _progress("B", "encoding") as bar:
        for tokens, lengths in pool.encode(tok, _batches(corpus, sent)):
            nchars, ends = sent.popleft()
            doc = next_doc + np.cumsum(ends) - ends  # (pieces,) document index of each piece
            next_doc += int(ends.sum())
            is_val = validation_mask(doc, d.seed, d.val_fraction)  # (pieces,)
            for split, flags in (("val", is_val), ("train", ~is_val)):
                if flags.any():
                    picked = tokens if flags.all() else tokens[np.repeat(flags, lengths)]
                    writers[split].add(picked, lengths[flags], ends[flags])
            bar.update(nchars)
    seconds = time.perf_counter() - start
    # At least one document in each split when there are two or more.
    train, val = writers["train"], writers["val"]
    for src, dst in ((train, val), (val, train)):
        if dst.documents == 0 and src.documents >= 2:
            moved = src.pop_tail(src.last_doc_tokens)
            dst.add(moved, np.array([len(moved)]), np.array([True]))
            src.documents -= 1
    info = {
        "seconds": round(seconds, 3),
        "workers": pool.workers,
        # CPU time during encoding, of this thread (reading, splitting, writing) and of the whole
        # process (encoding threads included), for the benchmark's parallel-efficiency figure
        # (on a shared machine wall time alone says little).
        "cpu_seconds": {
            "main": round(time.thread_time() - main_start, 3),
            "total": round(time.process_time() - cpu_start, 3),
        },
    }
    return writers, info


def chat_sources(d: DataConfig) -> FileCorpus:
    """The files of data.sources, read as JSON Lines of conversations (data.format=chat): each file
    named, and in a directory its .jsonl(.gz) files (data.suffixes' when given)."""
    if not d.sources:
        raise DataError("data.format=chat needs data.sources: JSON Lines files of conversations")
    return FileCorpus.from_sources(d.sources, suffixes=d.suffixes or [".jsonl"])


def _chat_into(
    tok: Tokenizer, template: ChatTemplate, corpus: FileCorpus, cfg: Config, tmp: Path
) -> tuple[dict[str, ShardWriter], dict[str, Any], dict[str, Any]]:
    """The conversations into rows (lmsys.data.chat_preparation): (writers, the manifest's
    `encoding` record, the layout of format version 2)."""
    d = cfg.data
    rows = tokens_per_sample(cfg.model, d.seq_len)  # the loader's samples: the model reads seq_len

    def held_out(i: int) -> bool:
        return bool(validation_mask(np.array([i]), d.seed, d.val_fraction)[0])

    _say(
        f"rendering conversations with {template.name} into rows of {rows} tokens (data.seq_len={d.seq_len})"
    )
    start = time.perf_counter()
    writers, stats = write_conversations(tok, template, corpus, d, rows, tmp, held_out)
    if stats.bad_count:
        warn(PROG, f"chat: {stats.bad_summary()}")
    layout = {"content": "chat", "row_tokens": rows, "seq_len": d.seq_len, "packing": d.packing}
    info = {"seconds": round(time.perf_counter() - start, 3), "chat": stats.as_dict()}
    return dict(writers), info, layout


def _chat_summary(manifest: dict[str, Any], out: Path, seconds: float) -> None:
    """The lines that say what lmsys-prepare made of the conversations."""
    chat, s, rows = manifest["encoding"]["chat"], manifest["splits"], manifest["row_tokens"]
    kept = chat["conversations"]
    if chat["truncated"] or chat["dropped_overlong"]:
        _say(
            f"chat: longer than a row ({rows} tokens): {chat['truncated']} conversation(s) truncated, "
            f"{chat['dropped_overlong']} dropped (data.overlong={manifest['config']['data']['overlong']}; "
            "a truncated one left with no assistant token is dropped)"
        )
    for split in SPLITS:
        if s[split]["rows"] == 0:
            warn(PROG, f"the {split} split is empty ({sum(kept.values())} conversation(s) in all); "
                       "lmsys-train needs rows in both: add conversations")  # fmt: skip
    total = s["train"]["tokens"] + s["val"]["tokens"]
    _say(
        f"wrote {out}: {kept['train']:,} train and {kept['val']:,} val conversations in "
        f"{s['train']['rows']:,} + {s['val']['rows']:,} rows of {rows} tokens "
        f"({'packed' if manifest['packing'] else 'one per row'}, "
        f"{100 * chat['padding_tokens'] / max(total, 1):.1f}% padding), {chat['trained_tokens']:,} trained "
        f"tokens (the assistant's), {chat['bad_lines']} bad line(s), total {seconds:.1f} s"
    )


def _tokenizer_section(tok: Tokenizer, given: Tokenizer | None) -> dict[str, Any]:
    return {
        "kind": tok.kind,
        "file": tok.path.name,
        "sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        **tok.special_ids(),
        "origin": str(given.path.resolve()) if given else "trained by lmsys-prepare",
        "training": tok.training_info,
    }


def _provenance(
    cfg: Config,
    corpus: Corpus,
    given: Tokenizer | None,
    encoding: dict[str, Any],
    template: ChatTemplate | None = None,
) -> dict[str, Any]:
    """What lmsys-prepare records beside the format's own fields: where the tokens came from."""
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "split_rule": "splitmix64(i + seed * 0x9E3779B97F4A7C15) / 2**64 < val_fraction, "
        "then at least one document per split",
        "documents": corpus.stats.as_dict(),
        "sources": corpus.describe(),
        "config": {
            "data": config_to_dict(cfg)["data"],
            "model": {"name": cfg.model.name, "vocab_size": cfg.model.vocab_size},
        },
        "fingerprint": _fingerprint(cfg, corpus, given, template),
        "encoding": encoding,
    }


def _check_destination(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"data.dir={out} is a file, not a directory; choose another data.dir")
    if out.is_dir() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise DataError(
            f"data.dir={out} exists, is not empty and has no {MANIFEST}; refusing to replace it "
            "(choose another data.dir or remove it)"
        )


def _given_tokenizer(cfg: Config) -> Tokenizer | None:
    """data.tokenizer, checked against the model's tokenizer size (model.tokenizer_vocab_size, else
    model.vocab_size); None when lmsys-prepare trains one."""
    d = cfg.data
    if not d.tokenizer:
        if d.format == "chat":
            raise DataError(
                "data.format=chat needs data.tokenizer=<the tokenizer of the model to fine-tune> (a "
                "directory holding its tokenizer.json or tokenizer.model, e.g. an lmsys-import export)"
            )
        return None
    given = Tokenizer(Path(d.tokenizer).expanduser())
    if cfg.model.tokenizer_vocab_size is not None:
        if given.vocab_size != cfg.model.tokenizer_vocab_size:
            raise DataError(
                f"data.tokenizer={d.tokenizer} has vocab_size {given.vocab_size} but the model reads a "
                f"tokenizer of model.tokenizer_vocab_size={cfg.model.tokenizer_vocab_size} pieces"
            )
        return given
    if given.vocab_size != cfg.model.vocab_size:
        raise DataError(
            f"data.tokenizer={d.tokenizer} has vocab_size {given.vocab_size} but model.vocab_size="
            f"{cfg.model.vocab_size}; set model.vocab_size={given.vocab_size} or unset data.tokenizer "
            "to train one"
        )
    return given


def _reusable(
    out: Path, fingerprint: dict[str, Any], given: Tokenizer | None, given_path: str | None
) -> bool:
    """Whether `out` already holds these sources prepared with these settings (then it is kept).
    A prepared directory that differs, or that does not check out, is never replaced without
    data.overwrite=true: DataError saying what differs and how to proceed."""
    if not (out / MANIFEST).is_file():
        return False
    manifest = read_manifest(out)  # a damaged one: its DataError names the problem and the fix
    if _same(manifest.get("fingerprint"), fingerprint):
        s = manifest["splits"]
        _say(
            f"reusing {out}: same sources, vocab_size {manifest['tokenizer']['vocab_size']}, "
            f"tokenizer sha256 {manifest['tokenizer']['sha256'][:12]}; "
            f"{s['train']['tokens']:,} train and {s['val']['tokens']:,} val tokens "
            "(data.overwrite=true prepares again)"
        )
        return True
    made_by = str(manifest["tokenizer"]["sha256"])
    if given is not None and given.sha256 != made_by:
        raise DataError(
            f"data.dir={out} holds shards made by another tokenizer (sha256 {made_by[:12]}) than "
            f"data.tokenizer={given_path} (sha256 {given.sha256[:12]}); choose another data.dir "
            "or set data.overwrite=true to encode it again"
        )
    differences = "; ".join(fingerprint_differences(manifest.get("fingerprint") or {}, fingerprint))
    raise DataError(
        f"data.dir={out} was prepared from other {differences}; lmsys-prepare never replaces prepared "
        "data unasked: choose another data.dir, or set data.overwrite=true to prepare it again (runs "
        "trained on it keep their own copy of its tokenizer, but cannot resume on other data)"
    )


_SETTINGS = {"seed": "data.seed", "val_fraction": "data.val_fraction", "shard_tokens": "data.shard_tokens",
             "format": "data.format", "seq_len": "data.seq_len", "packing": "data.packing",
             "overlong": "data.overlong", "chat_template_sha256": "chat template sha256"}  # fmt: skip


def fingerprint_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between a prepared directory's fingerprint and this run's, in words: its
    sources, its tokenizer, its settings (one phrase each)."""
    found = []
    if not _same(old.get("sources"), new.get("sources")):
        found.append(f"sources ({_sources_change(old.get('sources') or {}, new['sources'])})")
    tokenizer = []
    if old.get("vocab_size") != new.get("vocab_size"):
        tokenizer.append(f"vocab_size {old.get('vocab_size')}, now {new.get('vocab_size')}")
    if not _same(old.get("tokenizer"), new.get("tokenizer")):
        tokenizer.append(
            f"{_tokenizer_origin(old.get('tokenizer'))}, now {_tokenizer_origin(new.get('tokenizer'))}"
        )
    if tokenizer:
        found.append(f"tokenizer ({'; '.join(tokenizer)})")
    settings = [
        f"{name} {old.get(key)}, now {new.get(key)}"
        for key, name in {**_SETTINGS, "version": "format version"}.items()
        if old.get(key) != new.get(key)
    ]
    if settings:
        found.append(f"settings ({', '.join(settings)})")
    return found or ["settings"]


def _tokenizer_origin(section: Any) -> str:
    if isinstance(section, dict) and "sha256" in section:
        return f"data.tokenizer with sha256 {str(section['sha256'])[:12]}"
    return "trained by lmsys-prepare"


def _sources_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    """How two corpus fingerprints differ: another kind, files added, removed or changed, or
    another reading setting."""
    if old.get("kind") != new.get("kind") or old.get("kind") != "files":
        if old.get("kind") == new.get("kind"):  # the default corpus of another Python
            return f"the default corpus of Python {old.get('python')}, now {new.get('python')}"
        kinds = {"files": "files", "default": "the default corpus"}
        return f"{kinds.get(str(old.get('kind')), old.get('kind'))}, now {kinds.get(str(new.get('kind')))}"
    before = {f[0]: f[1:] for f in old.get("files", [])}
    after = {f[0]: f[1:] for f in new.get("files", [])}
    parts = []
    for label, names in (
        ("added", [p for p in after if p not in before]),
        ("removed", [p for p in before if p not in after]),
        ("changed", [p for p in after if p in before and before[p] != after[p]]),
    ):
        if names:
            parts.append(f"{len(names)} file(s) {label}, e.g. {names[0]}")
    for key in ("text_field", "on_decode_error", "encoding"):
        if old.get(key) != new.get(key):
            parts.append(f"data.{key} {old.get(key)}, now {new.get(key)}")
    return ", ".join(parts) or "the same files in another order"


def _tokenizer_into(tmp: Path, corpus: Corpus, cfg: Config, given: Tokenizer | None) -> Tokenizer:
    """The tokenizer of the new directory: a copy of the given one (tokenizer.model, or
    tokenizer.json with its special tokens), or a tokenizer.model trained on a bounded sample of
    the corpus."""
    d = cfg.data
    t0 = time.perf_counter()
    if given is not None:
        tok = Tokenizer(given.copy_to(tmp))
        _say(
            f"using tokenizer {given.path} ({tok.kind}, vocab_size {tok.vocab_size}, eos id {tok.eos_id}, "
            f"sha256 {tok.sha256[:12]})"
        )
        return tok
    _say(
        f"training a {d.vocab_size}-piece BPE tokenizer on a sample of at most "
        f"{d.tokenizer_sample_bytes:,} bytes"
    )
    tok = train_tokenizer(corpus, d.vocab_size, tmp / SENTENCEPIECE_FILE, d.tokenizer_sample_bytes, d.seed)
    info = tok.training_info or {}
    _say(
        f"tokenizer trained on {info.get('sample_bytes', 0):,} of {info.get('corpus_bytes', 0):,} "
        f"bytes in {time.perf_counter() - t0:.1f} s (sha256 {tok.sha256[:12]})"
    )
    return tok


def prepare(cfg: Config) -> Path:
    """Prepare (or reuse) `cfg.data.dir`; returns its path. Raises DataError on bad input."""
    d = cfg.data
    out = Path(d.dir).expanduser().resolve()
    corpus = (
        chat_sources(d)
        if d.format == "chat"
        else open_corpus(d.sources, d.text_field, d.on_decode_error, d.encoding, d.suffixes)
    )
    if isinstance(corpus, FileCorpus):
        _say(f"sources: {corpus.scan.summary()}")
    given = _given_tokenizer(cfg)
    template = None
    if d.format == "chat":
        assert given is not None and isinstance(corpus, FileCorpus)
        template = chat_template(given, d.chat_template)
        given.chat_template = template.text  # kept with the prepared tokenizer (Tokenizer.copy_to)
    fingerprint = _fingerprint(cfg, corpus, given, template)
    if not d.overwrite and _reusable(out, fingerprint, given, d.tokenizer):
        return out
    _check_destination(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(out, "tmp")
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        tok = _tokenizer_into(tmp, corpus, cfg, given)
        if template is not None:
            writers, enc, layout = _chat_into(tok, template, corpus, cfg, tmp)
        else:
            (writers, enc), layout = _encode_into(tok, corpus, cfg, tmp), None
        manifest = write_manifest(
            tmp,
            writers,
            _tokenizer_section(tok, given),
            _provenance(cfg, corpus, given, enc, template),
            layout,
        )
        read_manifest(tmp)  # what the loader will check, before it replaces anything
        install_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if template is not None:
        _chat_summary(manifest, out, time.perf_counter() - t0)
        return out
    st, s = corpus.stats, manifest["splits"]
    mb = st.text_bytes / 1e6
    skipped = ""
    if st.skipped_decode_error:
        skipped = f", skipped {st.skipped_decode_error} with undecodable bytes (e.g. {st.skipped[0]})"
    empty = f", dropped {st.empty} empty" if st.empty else ""
    _say(
        f"encoded {st.documents:,} documents ({mb:.1f} MB){empty}{skipped} in {enc['seconds']:.1f} s "
        f"({mb / max(enc['seconds'], 1e-9):.1f} MB/s, {enc['workers']} workers)"
    )
    for split in SPLITS:
        if s[split]["tokens"] == 0:
            warn(
                PROG,
                f"the {split} split is empty ({st.documents} document(s) in all, and a document goes "
                "to one split whole); lmsys-train needs text in both: add documents, or split a "
                "long one into several files",
            )
    _say(
        f"wrote {out}: {s['train']['tokens']:,} train tokens ({s['train']['documents']:,} documents, "
        f"{s['train']['shards']} shards), {s['val']['tokens']:,} val tokens "
        f"({s['val']['documents']:,} documents), "
        f"{manifest['dtype']}, total {time.perf_counter() - t0:.1f} s"
    )
    return out
