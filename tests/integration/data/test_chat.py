"""lmsys-prepare data.format=chat end to end (lmsys/data/chat_preparation.py): bad lines counted
and named by line number, preview and preview_json showing what is trained, and the prepared rows:
every conversation whole in one row of data.seq_len, its document stored, padding weight 0,
packing=false one per row, overlong ones truncated or dropped and counted; the loader reads them
back as the conversations' own ids and weights, and the template used is kept with the prepared
tokenizer. The templates themselves: tests/unit/data/test_chat.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmsys.core.errors import DataError
from lmsys.data.chat import BadConversation, ChatTemplate, parse_conversation
from lmsys.data.loader import TokenLoader
from lmsys.data.shards import PreparedData
from lmsys.data.tokenizer import Tokenizer
from tests.fixtures.data import CHAT_VOCAB, run_prepare
from tests.hf_files import CHAT_SPECIALS

PIECES = CHAT_VOCAB + len(CHAT_SPECIALS) - 1
SEQ = 160  # data.seq_len: rows of two conversations or so
ROW = SEQ + 1  # a row: the model reads data.seq_len tokens and predicts the last


def write_chat_file(path: Path, n: int, bad: dict[int, str] | None = None, long_every: int = 0) -> Path:
    """n conversations (one line each, line numbers from 1), lines `bad` replaced; every
    long_every-th conversation longer than a row."""
    lines = []
    for i in range(n):
        answer = f"Item {i} is number {i * 7 % 13}." + (
            " and more" * 40 if long_every and i % long_every == 0 else ""
        )
        turns = [{"role": "user", "content": f"What is item {i}?"}, {"role": "assistant", "content": answer}]
        if i % 3 == 0:
            turns = [{"role": "system", "content": "Be exact."}, *turns]
        pair = {"prompt": turns[-2]["content"], "completion": answer}
        lines.append(json.dumps({"messages": turns} if i % 2 else pair))
    for lineno, text in (bad or {}).items():
        lines[lineno - 1] = text
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def chat_overrides(source: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return [
        *(f"data.sources=[{source}]", f"data.tokenizer={tokenizer}", "data.format=chat", f"data.dir={out}"),
        *(f"model.vocab_size={PIECES}", "model.max_seq_len=192", f"data.seq_len={SEQ}"),
        *("data.val_fraction=0.2", "data.shard_tokens=1500", *extra),
    ]


BAD = {
    3: "{not json",
    5: '{"messages": [{"content": "hi"}]}',
    8: '{"messages": []}',
    11: '{"messages": [{"role": "user", "content": "hi"}]}',
}


@pytest.fixture(scope="module")
def prepared_chat(tmp_path_factory, template_dirs) -> dict:
    """The same conversations prepared packed and one per row, with bad lines and long ones."""
    root = tmp_path_factory.mktemp("chat_prepared")
    source = write_chat_file(root / "chat.jsonl", 60, BAD, long_every=17)
    tokenizer = template_dirs["chatml"][0]
    out = {"root": root, "source": source, "tokenizer": tokenizer}
    for name, extra in (("packed", []), ("rows", ["data.packing=false", "data.overlong=drop"])):
        proc = run_prepare(*chat_overrides(source, tokenizer, root / name, *extra), cwd=root)
        assert proc.returncode == 0, proc.stderr
        out[name] = proc
    return out


def test_bad_lines_are_counted_and_named(prepared_chat):
    proc, source = prepared_chat["packed"], prepared_chat["source"]
    warning = next(line for line in proc.stderr.splitlines() if "bad line" in line)
    assert warning.startswith("lmsys-prepare: warning: chat: 4 bad line(s) skipped: ")
    for lineno, reason in ((3, "invalid JSON"), (5, "message 1 has no role"), (8, "empty conversation"),
                           (11, "no assistant message")):  # fmt: skip
        assert f"{source}:{lineno}: {reason}" in warning
    manifest = json.loads((prepared_chat["root"] / "packed" / "manifest.json").read_text())
    chat = manifest["encoding"]["chat"]
    assert chat["bad_lines"] == 4 and [b["line"] for b in chat["bad"]] == [3, 5, 8, 11]
    assert sum(chat["conversations"].values()) == 56 - chat["dropped_overlong"]
    assert manifest["version"] == 2 and manifest["content"] == "chat" and manifest["row_tokens"] == ROW


def test_overlong_conversations_are_truncated_or_dropped_and_counted(prepared_chat):
    root = prepared_chat["root"]
    packed = json.loads((root / "packed" / "manifest.json").read_text())["encoding"]["chat"]
    rows = json.loads((root / "rows" / "manifest.json").read_text())["encoding"]["chat"]
    long = [i for i in range(60) if i % 17 == 0 and i + 1 not in BAD]  # conversations 0, 17, 34, 51
    assert packed["truncated"] == len(long) and packed["dropped_overlong"] == 0
    assert rows["dropped_overlong"] == len(long) and rows["truncated"] == 0
    assert f"{len(long)} conversation(s) truncated, 0 dropped" in prepared_chat["packed"].stdout
    assert sum(rows["conversations"].values()) == sum(packed["conversations"].values()) - len(long)


def conversations_of(
    template: ChatTemplate, source: Path, seq: int, skip_long: bool
) -> list[tuple[list, list]]:
    """(ids, weights) of every good conversation of `source`, cut to seq tokens (or left out)."""
    out = []
    for line in source.read_text().splitlines():
        try:
            ids, weights = template.encode(parse_conversation(line))
        except BadConversation:
            continue
        if len(ids) > seq and skip_long:
            continue
        out.append((ids[:seq].tolist(), weights[:seq].tolist()))
    return out


@pytest.mark.parametrize("layout", ["packed", "rows"])
def test_rows_hold_whole_conversations_with_their_weights(prepared_chat, layout):
    data = PreparedData(prepared_chat["root"] / layout)
    template = ChatTemplate(Tokenizer(data.tokenizer_path))
    assert template.text == Tokenizer(prepared_chat["tokenizer"]).chat_template  # kept with the data
    want = conversations_of(template, prepared_chat["source"], ROW, skip_long=layout == "rows")
    found = []
    for split in ("train", "val"):
        n = len(data.split(split)) // ROW
        loader = TokenLoader(data, split, tokens_per_sample=ROW, global_batch_size=1, micro_batch_size=1,
                             document_masking=True)  # fmt: skip
        for batch in loader.val_batches(0) if split == "val" else [loader.next_batch() for _ in range(n)]:
            tokens, weights, docs = batch.tokens[0], batch.weights[0], batch.documents[0]
            starts = [0, *(torch.nonzero(docs[1:] != docs[:-1])[:, 0] + 1).tolist(), ROW]
            pieces = [
                (tokens[a:b].tolist(), weights[a:b].int().tolist()) for a, b in zip(starts[:-1], starts[1:])
            ]
            pad = template.tok.pad_id
            if pieces[-1][0] == [pad] * len(pieces[-1][0]):  # the row's padding: a document, weight 0
                assert sum(pieces.pop()[1]) == 0
            assert layout == "packed" or len(pieces) == 1
            found += pieces
    assert sorted(map(str, found)) == sorted(map(str, want))  # every conversation once, whole
    rows = sum(len(data.split(s)) for s in ("train", "val")) // ROW
    assert rows < len(found) if layout == "packed" else rows == len(found)


def test_prepared_chat_is_reused_and_refused_when_settings_change(prepared_chat, tmp_path):
    root, source, tokenizer = prepared_chat["root"], prepared_chat["source"], prepared_chat["tokenizer"]
    again = run_prepare(*chat_overrides(source, tokenizer, root / "packed"), cwd=root)
    assert again.returncode == 0 and "reusing" in again.stdout, again.stderr
    other = run_prepare(*chat_overrides(source, tokenizer, root / "packed", "data.overlong=drop"), cwd=root)
    assert other.returncode == 2 and "data.overlong truncate, now drop" in other.stderr, other.stderr
    with pytest.raises(
        DataError,
        match=rf"packed for data.seq_len={SEQ} \(rows of {ROW} tokens\), but this run reads samples of 64",
    ):
        TokenLoader(PreparedData(root / "packed"), "train", tokens_per_sample=64, global_batch_size=1,
                    micro_batch_size=1)  # fmt: skip
    no_tokenizer = [o for o in chat_overrides(source, tokenizer, tmp_path / "x") if "tokenizer" not in o]
    proc = run_prepare(*no_tokenizer, cwd=tmp_path)
    assert proc.returncode == 2 and "data.format=chat needs data.tokenizer=" in proc.stderr


def test_preview_shows_what_is_trained(prepared_chat, tmp_path):
    transformers = pytest.importorskip("transformers")
    root, source, tokenizer = prepared_chat["root"], prepared_chat["source"], prepared_chat["tokenizer"]
    out = tmp_path / "preview.json"
    overrides = chat_overrides(source, tokenizer, tmp_path / "never")
    proc = run_prepare(*overrides, "preview=4", f"preview_json={out}", cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "never").exists()  # a preview writes no data
    shown = json.loads(out.read_text())
    auto = transformers.AutoTokenizer.from_pretrained(tokenizer)
    messages = []
    for line in source.read_text().splitlines():
        try:
            messages.append(parse_conversation(line))
        except BadConversation:
            continue
    messages = messages[:4]  # lines 1, 2, 4 and 6
    want = [auto.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"] for m in messages]
    assert [s["ids"] for s in shown] == want
    first = proc.stdout.split("\n--- ")[1]
    assert first.startswith(f"{source}:1: ") and "[[Item 0 is number 0." in first and "<|im_end|>]]" in first
    assert "<|im_start|>assistant\n[[" in first  # the header untrained, the reply trained
    assert np.array_equal(np.array(shown[0]["weights"]).nonzero()[0][-1:], [len(shown[0]["ids"]) - 2])
    assert f"{source}:3: invalid JSON" in proc.stdout


def test_packed_conversations_without_document_masking_are_warned_of(prepared_chat, capsys):
    for layout, warned in (("packed", True), ("rows", False)):
        data = PreparedData(prepared_chat["root"] / layout)
        TokenLoader(data, "train", tokens_per_sample=ROW, global_batch_size=1, micro_batch_size=1)
        assert ("data.document_masking=true makes each its own sequence" in capsys.readouterr().err) == warned
