"""Integrity-check benchmark: what opening prepared data costs (lmsys.data.integrity), by check.

    python -m tools.bench integrity              # 300 MB of shards
    python -m tools.bench integrity mb=1000

A prepared directory of `mb` megabytes of uint16 ids in shards of 100 MB is written to a
temporary directory, then opened with each check: the full check (every shard's sha256 and every
id, what data up to 64 MiB gets: the baseline), the id check (a vectorised max over each
memory-mapped shard, what data up to 1 GiB gets) and the sample (above that). Each is timed from
the page cache (warm, after a first read) and, where the kernel drops the files' pages on request
(posix_fadvise DONTNEED), from the disk (cold). The figure to report: the id check's rate and its
ratio to the full check's.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from lmsys.cli import Option, parse_options, run_cli
from lmsys.core.errors import UsageError
from lmsys.data.integrity import check_shard_ids
from lmsys.data.shards import ShardWriter, token_dtype, write_manifest

PROG = "tools.bench integrity"
VOCAB = 50_257
SHARD_TOKENS = 50_000_000  # 100 MB shards
OPTIONS = [Option("mb", "float", 300.0, "megabytes of shards")]
# (label, full_check_bytes, id_check_bytes) that make check_shard_ids take each path
CHECKS = (
    ("full check (sha256 + ids)", sys.maxsize, sys.maxsize),
    ("id check", 0, sys.maxsize),
    ("sample", 0, 0),
)


def write_data(directory: Path, mb: float) -> dict[str, Any]:
    """A prepared directory of `mb` MB of random ids below VOCAB; returns its manifest."""
    writers = {s: ShardWriter(directory, s, token_dtype(VOCAB), SHARD_TOKENS) for s in ("train", "val")}
    rng = np.random.default_rng(0)
    left = int(mb * 1e6) // 2
    while left > 0:
        n = min(left, 1 << 24)
        writers["train"].write(rng.integers(0, VOCAB, n, dtype=np.uint16))
        left -= n
    writers["val"].write(rng.integers(0, VOCAB, 1000, dtype=np.uint16))
    (directory / "tokenizer.model").write_bytes(b"stand-in")  # never parsed by the checks
    tokenizer = {"kind": "sentencepiece", "file": "tokenizer.model", "sha256": "", "vocab_size": VOCAB}
    return write_manifest(directory, writers, tokenizer, {})


def _drop_cache(directory: Path) -> bool:
    """Ask the kernel to drop the shards' cached pages; whether it could be asked."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in directory.glob("*.bin"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def run(mb: float) -> list[tuple[str, str, float]]:
    """(check, warm or cold, seconds) of each check on `mb` MB of shards."""
    root = Path(tempfile.mkdtemp(prefix="tools-bench-integrity-"))
    try:
        manifest = write_data(root, mb)
        rows = []
        for label, full, ids in CHECKS:
            for state in ("cold", "warm"):
                if state == "cold" and not _drop_cache(root):
                    continue
                start = time.perf_counter()
                check_shard_ids(root, manifest, VOCAB, "", full, ids)
                rows.append((label, state, time.perf_counter() - start))
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(rows: list[tuple[str, str, float]], mb: float) -> str:
    lines = [f"{PROG}: {mb:g} MB of shards on {platform.node()} ({os.cpu_count()} cores)"]
    for label, state, seconds in rows:
        lines.append(f"  {label:<26} {state}: {seconds:7.3f} s  {mb / seconds:9.0f} MB/s")
    seconds = {(label, state): s for label, state, s in rows}
    for state in ("cold", "warm"):
        full, ids = seconds.get((CHECKS[0][0], state)), seconds.get((CHECKS[1][0], state))
        if full and ids:
            lines.append(f"  id check / full check ({state}): {ids / full:.3f}x the time")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts = parse_options(PROG, argv, OPTIONS, __doc__ or PROG)
        if opts is None:
            return 0
        if opts["mb"] is None or opts["mb"] <= 0:
            raise UsageError(f"mb={opts['mb']} must be > 0")
        print(report(run(opts["mb"]), opts["mb"]), flush=True)
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
