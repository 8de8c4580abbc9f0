"""Preparing conversations (lmsys-prepare data.format=chat): JSON Lines of conversations ->
rendered, weighted rows (the loader's samples) in the prepared-data format's version 2
(lmsys.data.shards), and the preview of what is trained (preview=N, preview_json=FILE).

Every line of every source file is a conversation (lmsys.data.chat): rendered with the chat
template (data.chat_template, else the tokenizer's own, else lmsys's default, ChatML), encoded,
its assistant's tokens weighted 1 and every other token 0. A line that is not a conversation is
counted and named (file and line number) on the console and in the manifest; nothing is skipped
silently. A row holds what the loader reads as one sample: data.seq_len + 1 tokens (the model
reads data.seq_len of them and predicts the last; data.seq_len under bos_shift). A conversation
longer than a row is cut to its first row of tokens (data.overlong=truncate; one left with no
trained token is dropped and counted) or dropped (data.overlong=drop), and counted either way.

Conversation i (0-based, among the good ones, in file order) goes to the validation split by the
rule text documents follow (lmsys.data.preparation.validation_mask). Each split's conversations
are packed in order into rows: a conversation goes into the open row while
it fits, else the row is closed, padded (the pad token, else eos; weight 0, a document of its
own) and a new one opened; with data.packing=false every conversation has a row of its own. No
conversation crosses a row, so the loader's samples are these rows, and with
data.document_masking=true each conversation is its own sequence. If one split ends up without a
row while the other has two or more, the other's last row moves over.

The template used is kept with the prepared tokenizer (tokenizer_config.json's chat_template, or
chat_template.jinja beside a tokenizer.model), so runs, exports and `lmsys-generate chat=true`
render with the template the data was rendered with.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from lmsys.core.config import DataConfig
from lmsys.core.errors import DataError
from lmsys.data.chat import BadConversation, ChatTemplate, Message, parse_conversation
from lmsys.data.corpus import FileCorpus
from lmsys.data.shards import SPLITS, WeightedShardWriter, token_dtype
from lmsys.data.sources import open_binary
from lmsys.data.tokenizer import Tokenizer

NAMED_BAD_LINES = 1000  # bad lines the manifest names (all are counted)
SHOWN_BAD_LINES = 10  # ... and the console
TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"  # the trained text in a preview written to a file or pipe
GREEN, RESET = "\x1b[32m", "\x1b[0m"  # ... and on a terminal


def chat_template(tok: Tokenizer, template_file: str | None) -> ChatTemplate:
    """The template conversations are rendered with: data.chat_template's file, else the
    tokenizer's own, else lmsys's default (ChatML)."""
    if not template_file:
        return ChatTemplate(tok)
    path = Path(template_file).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"data.chat_template={template_file} cannot be read ({e})") from e
    return ChatTemplate(tok, text, name=f"data.chat_template={template_file}")


def template_sha256(template: ChatTemplate) -> str:
    return hashlib.sha256(template.text.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- reading


@dataclass
class ChatStats:
    """What a pass over the conversations found."""

    conversations: dict[str, int] = field(default_factory=lambda: {s: 0 for s in SPLITS})
    bad_count: int = 0
    bad: list[dict[str, Any]] = field(default_factory=list)  # the first NAMED_BAD_LINES
    truncated: int = 0
    dropped_overlong: int = 0
    trained_tokens: int = 0
    padding_tokens: int = 0

    def bad_line(self, path: Path, line: int, reason: str) -> None:
        self.bad_count += 1
        if len(self.bad) < NAMED_BAD_LINES:
            self.bad.append({"file": str(path), "line": line, "reason": reason})

    def bad_summary(self) -> str:
        """`3 bad lines skipped: a.jsonl:4: invalid JSON (...); ...`."""
        named = "; ".join(f"{b['file']}:{b['line']}: {b['reason']}" for b in self.bad[:SHOWN_BAD_LINES])
        more = self.bad_count - min(SHOWN_BAD_LINES, len(self.bad))
        rest = f"; and {more} more (manifest.json names the first {NAMED_BAD_LINES})" if more > 0 else ""
        return f"{self.bad_count} bad line(s) skipped: {named}{rest}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "conversations": self.conversations,
            "bad_lines": self.bad_count,
            "bad": self.bad,
            "truncated": self.truncated,
            "dropped_overlong": self.dropped_overlong,
            "trained_tokens": self.trained_tokens,
            "padding_tokens": self.padding_tokens,
        }


def conversations(corpus: FileCorpus, stats: ChatStats) -> Iterator[tuple[Path, int, list[Message]]]:
    """(file, line number, messages) of every good line of the source files, in order; a bad line
    is recorded in `stats` instead (a blank line is nothing)."""
    for source in corpus.files:
        with open_binary(source.path) as fh:
            for lineno, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    stats.bad_line(source.path, lineno, f"not UTF-8 ({e.reason} at byte {e.start})")
                    continue
                if not line.strip():
                    continue
                try:
                    yield source.path, lineno, parse_conversation(line)
                except BadConversation as e:
                    stats.bad_line(source.path, lineno, str(e))


def encoded(
    corpus: FileCorpus, template: ChatTemplate, stats: ChatStats
) -> Iterator[tuple[Path, int, np.ndarray, np.ndarray]]:
    """(file, line, ids, weights) of every conversation the template renders; bad ones recorded."""
    for path, lineno, messages in conversations(corpus, stats):
        try:
            ids, weights = template.encode(messages)
        except BadConversation as e:
            stats.bad_line(path, lineno, str(e))
            continue
        yield path, lineno, ids, weights


# ----------------------------------------------------------------------------- packing


Row = tuple[np.ndarray, np.ndarray, list[int], int]  # ids, weights, document starts, conversations


class RowPacker:
    """One split's conversations into rows of `length` tokens (the module docstring). The last
    complete row is held back until `finish`, so that an empty split can take it."""

    def __init__(self, length: int, pad_id: int, packing: bool, dtype: np.dtype, stats: ChatStats):
        self.length, self.pad_id, self.packing, self.dtype, self.stats = length, pad_id, packing, dtype, stats
        self.open: list[tuple[np.ndarray, np.ndarray]] = []
        self.used = 0  # tokens in the open row
        self.rows: list[Row] = []  # complete rows not written yet (at most one after `add`)

    def add(self, ids: np.ndarray, weights: np.ndarray) -> list[Row]:
        """Put a conversation (at most `length` tokens) in; returns the rows ready to be written."""
        if self.open and (not self.packing or self.used + len(ids) > self.length):
            self._close()
        self.open.append((ids, weights))
        self.used += len(ids)
        ready, self.rows = self.rows[:-1], self.rows[-1:]
        return ready

    def finish(self) -> list[Row]:
        """Every remaining row, the last one last."""
        if self.open:
            self._close()
        rows, self.rows = self.rows, []
        return rows

    def _close(self) -> None:
        pad = self.length - self.used
        starts = list(np.cumsum([0] + [len(ids) for ids, _ in self.open])[:-1]) + ([self.used] if pad else [])
        ids = np.concatenate([i for i, _ in self.open] + [np.full(pad, self.pad_id)]).astype(self.dtype)
        weights = np.concatenate([w for _, w in self.open] + [np.zeros(pad, dtype=np.uint8)])
        self.rows.append((ids, weights, [int(s) for s in starts], len(self.open)))
        self.stats.padding_tokens += pad
        self.open, self.used = [], 0


def fit(ids: np.ndarray, weights: np.ndarray, length: int, overlong: str, stats: ChatStats):
    """The conversation cut to `length` tokens (overlong=truncate) or None (dropped), counted."""
    if len(ids) <= length:
        return ids, weights
    if overlong == "drop" or not weights[:length].any():
        stats.dropped_overlong += 1
        return None
    stats.truncated += 1
    return ids[:length], weights[:length]


def write_conversations(
    tok: Tokenizer,
    template: ChatTemplate,
    corpus: FileCorpus,
    d: DataConfig,
    row_tokens: int,
    tmp: Path,
    held_out: Callable[[int], bool],
) -> tuple[dict[str, WeightedShardWriter], ChatStats]:
    """Render, weigh, split (`held_out(i)`: whether good conversation i goes to validation) and
    pack every conversation of `corpus` into rows of `row_tokens` in `tmp`'s splits (module
    docstring); DataError when no conversation is left to train on."""
    stats = ChatStats()
    dtype = token_dtype(tok.vocab_size)
    writers = {s: WeightedShardWriter(tmp, s, dtype, d.shard_tokens) for s in SPLITS}
    pad_id = tok.pad_id if tok.pad_id is not None else tok.eos_id
    packers = {s: RowPacker(row_tokens, pad_id, d.packing, dtype, stats) for s in SPLITS}
    index = 0
    for _, _, ids, weights in encoded(corpus, template, stats):
        kept = fit(ids, weights, row_tokens, d.overlong, stats)
        if kept is None:
            continue
        split = "val" if held_out(index) else "train"
        index += 1
        stats.conversations[split] += 1
        stats.trained_tokens += int(kept[1].sum())
        for row in packers[split].add(*kept):
            writers[split].write_row(*row)
    rows = {s: packers[s].finish() for s in SPLITS}
    for src, dst in (("train", "val"), ("val", "train")):
        if not rows[dst] and writers[dst].rows == 0 and writers[src].rows + len(rows[src]) >= 2:
            rows[dst].append(rows[src].pop())
    for split in SPLITS:
        for row in rows[split]:
            writers[split].write_row(*row)
    if not sum(stats.conversations.values()):
        bad = f" ({stats.bad_summary()})" if stats.bad_count else ""
        raise DataError(f"no conversation to train on in {corpus.name()}{bad}")
    return writers, stats


# ----------------------------------------------------------------------------- preview


def marked_text(tok: Tokenizer, ids: np.ndarray, weights: np.ndarray, terminal: bool) -> str:
    """The decoded conversation, control tokens written out, its trained text in green on a
    terminal, else between [[ and ]]."""
    ids, weights = ids.tolist(), weights.tolist()
    cuts = [0] + [i for i in range(1, len(ids)) if weights[i] != weights[i - 1]] + [len(ids)]
    texts = [tok.decode(ids[:cut], skip_special=False) for cut in cuts]  # each prefix, decoded
    out = []
    for k in range(len(cuts) - 1):
        piece = texts[k + 1][len(texts[k]) :]
        if weights[cuts[k]]:
            piece = f"{GREEN}{piece}{RESET}" if terminal else f"{TRAINED_OPEN}{piece}{TRAINED_CLOSE}"
        out.append(piece)
    return "".join(out)


def preview(
    corpus: FileCorpus,
    template: ChatTemplate,
    count: int,
    json_path: str | None,
    out: TextIO | None = None,
) -> ChatStats:
    """Show the first `count` conversations as they are trained (marked_text), with the bad lines
    met on the way, and write them to `json_path` as a JSON list of {"ids", "weights"}, before
    packing and cutting. Nothing else is written."""
    out = out or sys.stdout
    terminal = out.isatty()
    stats, shown = ChatStats(), []
    mark = "in green" if terminal else f"between {TRAINED_OPEN} and {TRAINED_CLOSE}"
    print(f"{template.name}; trained text {mark}", file=out)
    for path, lineno, ids, weights in encoded(corpus, template, stats):
        if len(shown) == count:
            break
        shown.append({"ids": ids.tolist(), "weights": weights.tolist()})
        print(f"\n--- {path}:{lineno}: {len(ids)} tokens, {int(weights.sum())} trained", file=out)
        print(marked_text(template.tok, ids, weights, terminal), file=out)
    if stats.bad_count:
        print(f"\n{stats.bad_summary()}", file=out)
    if json_path:
        Path(json_path).write_text(json.dumps(shown) + "\n", encoding="utf-8")
    return stats
