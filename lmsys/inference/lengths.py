"""The length a model was trained at, and the window evaluation and generation use by default.

A run trains on sequences of data.seq_len tokens, which may be shorter than model.max_seq_len (the
size of its position table): positions from data.seq_len on were never trained, and a model read
there scores worse and writes worse text (a tiny model trained at 128 of 256 positions gives a
perplexity of 140 instead of 130 in windows of 256). The trained length travels with the model:
a checkpoint's run config holds data.seq_len, and an export records it in its metadata
(`trained_seq_len`, lmsys.engine.checkpoint.provenance). lmsys-eval, lmsys-generate and the
lm_eval model use it as their window unless told otherwise, and warn when told to go past it.
Models whose trained length is not known (imported, or exported before it was recorded) keep
model.max_seq_len.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def trained_length(meta: dict[str, Any]) -> int | None:
    """data.seq_len of the run that trained the model (export metadata or checkpoint config)."""
    value = meta.get("trained_seq_len")
    if value is None:
        value = ((meta.get("train_config") or {}).get("data") or {}).get("seq_len")
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):  # a hand-edited or foreign value: nothing known
        return None


def default_window(cfg, meta: dict[str, Any]) -> int:
    """The window when none is asked for: the trained length, else model.max_seq_len."""
    trained = trained_length(meta)
    return min(trained, cfg.max_seq_len) if trained else cfg.max_seq_len


def choose_window(
    asked: int | None, cfg, meta: dict[str, Any], warn: Callable[[str], None], key: str = "seq_len"
) -> int:
    """`asked` (the `key=` option) or the default window; a warning when `asked` goes past the
    trained length (still within model.max_seq_len: the callers check that bound)."""
    trained = trained_length(meta)
    if asked is None:
        return default_window(cfg, meta)
    if trained and trained < asked:
        warn(past_trained(key, asked, trained))
    return asked


def past_trained(what: str, length: int, trained: int) -> str:
    return (
        f"{what}={length} goes past the length the model was trained at ({trained} tokens, its "
        f"run's data.seq_len): positions {trained}-{length - 1} were never trained, so results "
        f"there are worse; leave it unset to use {trained}"
    )
