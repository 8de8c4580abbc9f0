"""lmsys-prepare: raw text → tokenizer + token shards + manifest.json in `data.dir`.

    python -m lmsys.prepare                                  # default corpus, default model
    python -m lmsys.prepare data.sources=[corpus/] data.dir=data/mine model=gpt2_124m model.vocab_size=8192
    python -m lmsys.prepare data.sources=[corpus/] data.tokenizer=hf/gpt2 model=gpt2_124m
    python -m lmsys.prepare data.format=chat data.sources=[chat.jsonl] data.tokenizer=exports/qwen3 preview=3

Settings (Hydra overrides `key=value`; conf/data/default.yaml, lmsys/core/config.py DataConfig):
  data.sources=[a.txt,dir/,'x/*.jsonl.gz']  inputs (empty: the default corpus)
  data.dir=data/default                     where to write
  model.vocab_size=N                        tokenizer size (data.vocab_size follows it)
  data.tokenizer=PATH                       use a tokenizer instead of training one: a
                                            tokenizer.model, a tokenizer.json (GPT-2's byte-level
                                            BPE...), or a directory holding one (a Hugging Face
                                            model, an export, a prepared data.dir)
  data.text_field=text                      the .jsonl field holding a document
  data.val_fraction=0.05                    share of documents held out for validation
  data.tokenizer_sample_bytes=20000000      bound on the tokenizer training sample
  data.on_decode_error=error|skip           undecodable text: stop, or skip that document
  data.encoding=utf-8                       of the text files: latin-1, cp1252, utf-16, ...
  data.suffixes=[.py,.pyi]                  what a directory contributes: exactly these suffixes
  data.num_workers=0                        encoding threads (0: all cores)
  data.shard_tokens=50000000                tokens per shard file
  data.seed=1234
  data.overwrite=false                      true: replace a data.dir prepared from other sources or
                                            settings (never replaced otherwise)

Conversations (docs/data.md, "Chat data"; lmsys/data/chat.py):
  data.format=chat                          data.sources are JSON Lines of conversations
                                            ({"messages": [...]} or {"prompt": ..., "completion": ...}),
                                            rendered with the tokenizer's chat template (data.tokenizer
                                            is required), loss on the assistant's turns only
  data.seq_len=N                            the rows conversations are packed into
  data.packing=true                         false: one conversation per row, padded
  data.overlong=truncate                    a conversation longer than data.seq_len: truncate | drop
  data.chat_template=FILE                   a Jinja template instead of the tokenizer's own (without
                                            one: ChatML, docs/data.md)
  preview=N                                 show the first N conversations as they are trained (the
                                            trained text marked) and stop: nothing is written
  preview_json=FILE                         with preview: also write them to FILE, a JSON list of
                                            {"ids": [...], "weights": [...]}

The steps, the split rule and how nothing half-written is left: lmsys/data/preparation.py.

Errors (bad config, bad data) print one line `lmsys-prepare: error: ...` on stderr and exit 2:
a missing or empty input, undecodable bytes (file and byte offset) or a file in another encoding
(named, with the data.encoding hint), a `data.tokenizer` whose vocabulary is not
`model.vocab_size`, a `data.dir` prepared from other sources or settings (what differs),
`data.seq_len` longer than the model's positions, an unknown key or bad value.
"""

from __future__ import annotations

import sys

from lmsys.cli import flag_as_override, run_cli
from lmsys.core.config import compose, config_keys
from lmsys.core.errors import UsageError
from lmsys.data.chat_preparation import chat_template, preview
from lmsys.data.preparation import PROG, chat_sources, prepare
from lmsys.data.tokenizer import Tokenizer

PREVIEW_OPTIONS = ("preview", "preview_json")  # this command's own, beside the config overrides


def main(argv: list[str] | None = None) -> int:
    """`python -m lmsys.prepare [hydra overrides]`; returns the exit status (0 or 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)

    def body() -> int:
        if any(a in ("-h", "--help") for a in argv):
            print(__doc__)
            return 0
        if any(a.startswith("-") for a in argv):  # `--vocab_size 512`: name the key=value it means
            flag_as_override(PROG, argv, config_keys(), set())
        own = {k: v for k, _, v in (a.partition("=") for a in argv) if k in PREVIEW_OPTIONS}
        overrides = [a for a in argv if a.partition("=")[0] not in PREVIEW_OPTIONS]
        if own:
            return show_preview(compose(overrides), own)
        prepare(compose(overrides))
        return 0

    return run_cli(PROG, body, interrupted="interrupted; nothing was written")


def show_preview(cfg, own: dict[str, str]) -> int:
    """preview=N [preview_json=FILE]: the first N conversations of data.sources as trained."""
    count = own.get("preview", "")
    if not count.isdigit() or int(count) < 1:
        raise UsageError(f"preview={count} must be a number of conversations >= 1 (e.g. preview=3)")
    if cfg.data.format != "chat":
        raise UsageError(
            f"preview shows conversations: set data.format=chat (data.format is {cfg.data.format})"
        )
    if not cfg.data.tokenizer:
        raise UsageError("preview needs data.tokenizer=<the tokenizer of the model to fine-tune>")
    template = chat_template(Tokenizer(cfg.data.tokenizer), cfg.data.chat_template)
    preview(chat_sources(cfg.data), template, int(count), own.get("preview_json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
