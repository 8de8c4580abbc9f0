"""Fixtures for the data tests: a small synthetic corpus, one dataset prepared from it by the
real CLI (shared by the session), and a helper that runs `python -m lmsys.prepare`."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCAB = 400
SHARD_TOKENS = 20_000  # small, so the prepared train split spans several shards

# Text the tokenizer has not been trained on much: every one must survive encode -> decode.
UNICODE_SAMPLES = [
    "日本語のテキストと中文文本，还有한국어 문장。",
    "emoji 😀🎉 family 👨‍👩‍👧‍👦 flag 🇫🇷 skin 👍🏽 keycap 1️⃣",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u0362\u0335a\u0336\u034fl\u0327g\u0310o",
    "control: \x00\x01\x07\x08\x0b\x0c\x1b[31mred\x1b[0m \x7f\x85 end",
    "  leading and trailing spaces  \t\ttabs\r\nCRLF\rCR\n\n\nblank lines   ",
    "full-width ＡＢＣ１２３ ligature ﬁ compatibility ㎏ ① nbsp\u00a0 zwsp\u200b",
    "bom\ufeff in the middle, rtl override \u202eabc\u202c, soft\u00adhyphen",
    "עברית ومرحبا بالعالم Ελληνικά кириллица ไทย देवनागरी",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∀x∈ℝ: x²≥0 — “quotes” ‘single’ … ½",
    "",
    " ",
    "\n",
]

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not but which "
    "data token model train loss value shard batch rank epoch step sequence document corpus text "
    "python function return class module object list string number file read write open close"
).split()


def synthetic_text(rng: random.Random, paragraphs: int) -> str:
    out = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(rng.randint(2, 6)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
            sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", "?", "!", ":"]))
        if rng.random() < 0.3:
            sentences.append(f"Value {rng.randint(0, 99999)} at line {rng.randint(1, 500)}.")
        out.append(" ".join(sentences))
    return "\n\n".join(out) + "\n"


def write_corpus(root: Path, seed: int = 0) -> Path:
    """About 120 KB in .txt, .md, .jsonl and gzip files, with nested directories and unicode."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "nested" / "deeper").mkdir(parents=True, exist_ok=True)
    for i in range(12):
        folder = root if i % 3 else root / "nested"
        (folder / f"doc_{i:02d}.txt").write_text(synthetic_text(rng, rng.randint(3, 12)), encoding="utf-8")
    (root / "nested" / "deeper" / "notes.md").write_text(
        "# Notes\n\n" + synthetic_text(rng, 6) + "\n".join(UNICODE_SAMPLES), encoding="utf-8"
    )
    with open(root / "records.jsonl", "w", encoding="utf-8") as fh:
        for _ in range(60):
            fh.write(
                json.dumps({"id": rng.randint(0, 1000), "text": synthetic_text(rng, rng.randint(1, 4))})
                + "\n"
            )
    with gzip.open(root / "nested" / "packed.jsonl.gz", "wt", encoding="utf-8") as fh:
        for sample in UNICODE_SAMPLES[:8]:
            fh.write(json.dumps({"text": sample + " " + synthetic_text(rng, 1)}, ensure_ascii=False) + "\n")
    with gzip.open(root / "book.txt.gz", "wt", encoding="utf-8") as fh:
        fh.write(synthetic_text(rng, 40))
    (root / ".hidden.txt").write_text("never read", encoding="utf-8")  # hidden: skipped
    (root / "ignored.csv").write_text("a,b\n1,2\n", encoding="utf-8")  # unsupported: skipped
    return root


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_prepare(
    *overrides: str, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """The real CLI in a child process (cwd: a scratch directory, lmsys from this checkout)."""
    return subprocess.run(
        [sys.executable, "-m", "lmsys.prepare", *overrides],
        cwd=cwd or REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def base_overrides(corpus: Path, out: Path) -> list[str]:
    return [
        f"data.sources=[{corpus}]",
        f"data.dir={out}",
        f"model.vocab_size={VOCAB}",
        "data.val_fraction=0.2",
        f"data.shard_tokens={SHARD_TOKENS}",
        "data.num_workers=2",
    ]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data_corpus") / "corpus")


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, corpus_dir) -> Path:
    """`python -m lmsys.prepare` on the synthetic corpus, once per session (read-only for tests)."""
    out = tmp_path_factory.mktemp("data_prepared") / "prepared"
    proc = run_prepare(*base_overrides(corpus_dir, out), cwd=out.parent)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def other_tokenizer(tmp_path_factory) -> Path:
    """A second tokenizer with the same vocabulary size, trained on other text."""
    from lmsys.data.tokenizer import train_tokenizer

    rng = random.Random(7)
    texts = [synthetic_text(rng, 8)[::-1] for _ in range(20)]  # reversed words: other merges
    path = tmp_path_factory.mktemp("data_other_tok") / "tokenizer.model"
    train_tokenizer(texts, VOCAB, path, seed=7)
    return path


BPE_VOCAB = 384  # a GPT-2-style byte-level BPE: 256 bytes, 127 merges, <|endoftext|> last


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory, corpus_dir) -> Path:
    """A directory holding a byte-level BPE trained with `tokenizers` on the synthetic corpus, as
    OpenAI's GPT-2 files hold theirs: tokenizer.json, and a tokenizer_config.json naming no
    special token (`<|endoftext|>` is implied)."""
    from lmsys.data.corpus import FileCorpus
    from tests.hf_files import train_byte_level_bpe

    texts = list(FileCorpus.from_sources([str(corpus_dir)]).documents())
    tokenizer = train_byte_level_bpe(texts, BPE_VOCAB)
    out = tmp_path_factory.mktemp("data_bpe") / "gpt2-style"
    out.mkdir()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    return out
