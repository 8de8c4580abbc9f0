"""lmsys-prepare as a command on the prepared dataset's own sources: it reuses the data when
nothing changed, and says what its sources matched."""

from __future__ import annotations

from lmsys.data.shards import MANIFEST
from tests.fixtures.data import base_overrides, run_prepare


def test_reuse_when_nothing_changed(prepared, corpus_dir, tmp_path):
    before = (prepared / MANIFEST).read_bytes()
    proc = run_prepare(*base_overrides(corpus_dir, prepared), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "reusing" in proc.stdout and (prepared / MANIFEST).read_bytes() == before


def test_prepare_says_what_its_sources_matched(prepared, corpus_dir, tmp_path):
    """The corpus directory holds 16 readable files and ignored.csv (hidden files are not matched)."""
    proc = run_prepare(*base_overrides(corpus_dir, prepared), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "sources:" in ln)
    assert line == "lmsys-prepare: sources: 17 files matched: 16 read; skipped: 1 of other types (.csv)"
