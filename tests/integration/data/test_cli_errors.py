"""Every bad input through the real CLI: exit code 2, one line on stderr naming the problem, and
nothing half-written (no temporary directory, an existing data.dir untouched)."""

from __future__ import annotations

import gzip
import random
import shutil
from pathlib import Path

import pytest

from tests.fixtures.data import (
    VOCAB,
    assert_nothing_left,
    assert_one_line_error,
    base_overrides,
    run_prepare,
    synthetic_text,
)


def _bad_corpus(tmp_path: Path) -> tuple[Path, int]:
    """A directory whose second file has an invalid byte at a known offset."""
    src = tmp_path / "bad_src"
    src.mkdir()
    (src / "a.txt").write_text(synthetic_text(random.Random(0), 60))
    head = "fine text ✓ ".encode() * 7
    with gzip.open(src / "b.txt.gz", "wb") as fh:
        fh.write(head + b"\x80 after" + b" more" * 40)
    return src, len(head)


@pytest.mark.parametrize(
    "case",
    ["missing", "missing_unbracketed", "empty_dir", "whitespace_file", "empty_jsonl", "bad_glob"],
)
def test_missing_or_empty_inputs(tmp_path, out_root, case):
    src = tmp_path / "src"
    src.mkdir()
    entry, fragments = {
        "missing": (tmp_path / "nope.txt", ["nope.txt does not exist"]),
        # data.sources=PATH, no brackets: a list of one (was OmegaConf's "str is not a ListConfig")
        "missing_unbracketed": (tmp_path / "nope.txt", ["nope.txt does not exist"]),
        "empty_dir": (src, ["has no .txt, .md, .jsonl"]),
        "whitespace_file": (src / "blank.txt", ["no documents in", "blank.txt", "1 empty"]),
        "empty_jsonl": (src / "none.jsonl", ["no documents in", "none.jsonl"]),
        "bad_glob": (src / "*.txt", ["matched no files"]),
    }[case]
    (src / "blank.txt").write_text("  \n\n") if case == "whitespace_file" else None
    (src / "none.jsonl").write_text("\n\n") if case == "empty_jsonl" else None
    sources = f"data.sources={entry}" if case == "missing_unbracketed" else f"data.sources=[{entry}]"
    proc = run_prepare(sources, f"data.dir={out_root / 'out'}", cwd=tmp_path)
    assert_one_line_error(proc, *fragments)
    assert_nothing_left(out_root)


def test_undecodable_bytes_error_and_skip(tmp_path, out_root):
    src, offset = _bad_corpus(tmp_path)
    out = out_root / "out"
    common = [f"data.sources=[{src}]", f"data.dir={out}", "model.vocab_size=300", "data.num_workers=1"]
    proc = run_prepare(*common, cwd=tmp_path)
    assert_one_line_error(
        proc, "b.txt.gz", f"undecodable UTF-8 at byte offset {offset} ", "on_decode_error=skip"
    )
    assert_nothing_left(out_root)
    proc = run_prepare(*common, "data.on_decode_error=skip", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "skipped 1 with undecodable bytes" in proc.stdout and "b.txt.gz@" in proc.stdout
    assert_nothing_left(out_root, keep={"out"})


def test_failed_overwrite_leaves_existing_data(prepared, tmp_path):
    """An error found in the middle of a pass (after the temporary directory exists) removes it
    and leaves the data.dir that was there as it was."""
    out = tmp_path / "outputs" / "prepared"
    shutil.copytree(prepared, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    src, _ = _bad_corpus(tmp_path)
    proc = run_prepare(
        f"data.sources=[{src}]", f"data.dir={out}", "model.vocab_size=300", "data.overwrite=true"
    )
    assert_one_line_error(proc, "undecodable UTF-8")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert_nothing_left(out.parent, keep={"prepared"})


def test_tokenizer_vocabulary_disagrees_with_model(prepared, tmp_path, out_root, corpus_dir):
    proc = run_prepare(
        f"data.sources=[{corpus_dir}]", f"data.dir={out_root / 'out'}",
        f"data.tokenizer={prepared / 'tokenizer.model'}", "model.vocab_size=512", cwd=tmp_path,
    )  # fmt: skip
    assert_one_line_error(
        proc, f"has vocab_size {VOCAB} but model.vocab_size=512", f"model.vocab_size={VOCAB}"
    )
    assert_nothing_left(out_root)


def test_shards_made_by_another_tokenizer(prepared, corpus_dir, other_tokenizer, tmp_path):
    out = tmp_path / "outputs" / "prepared"
    shutil.copytree(prepared, out)
    # 1. data.tokenizer names another tokenizer than the one data.dir's shards were made with
    proc = run_prepare(*base_overrides(corpus_dir, out), f"data.tokenizer={other_tokenizer}", cwd=tmp_path)
    assert_one_line_error(proc, "holds shards made by another tokenizer", "data.overwrite=true")
    # 2. someone replaced tokenizer.model beside the shards
    shutil.copyfile(other_tokenizer, out / "tokenizer.model")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = run_prepare(*base_overrides(corpus_dir, out), cwd=tmp_path)
    assert_one_line_error(proc, "were made by another tokenizer", "manifest.json says sha256")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # not silently re-prepared
    assert_nothing_left(out.parent, keep={"prepared"})


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            ["data.seq_len=4096"],
            ["data.seq_len=4096 is longer than the model's positions", "model.max_seq_len="],
        ),
        (["data.bogus=1"], ["data.bogus"]),
        (["data.val_fraction=2"], ["data.val_fraction=2.0 must be in (0, 1)"]),
        (["data.on_decode_error=ignore"], ["data.on_decode_error='ignore' is not valid", "error, skip"]),
        (["data.sources"], ["overrides are key=value"]),
        (["data.encoding=latin-9000"], ["data.encoding='latin-9000' is not a text encoding", "latin-1"]),
    ],
    ids=["context_too_long", "unknown_key", "bad_fraction", "bad_choice", "not_key_value", "bad_encoding"],
)
def test_bad_config(tmp_path, out_root, overrides, fragments):
    proc = run_prepare(f"data.dir={out_root / 'out'}", *overrides, cwd=tmp_path)
    assert_one_line_error(proc, *fragments)
    assert_nothing_left(out_root)


def test_help(tmp_path):
    proc = run_prepare("--help", cwd=tmp_path)
    assert proc.returncode == 0 and "data.sources" in proc.stdout and "data.on_decode_error" in proc.stdout


def test_a_split_left_empty_is_warned_about(tmp_path, out_root):
    """One document goes to one split whole: the other one is empty, which training refuses."""
    (tmp_path / "only.txt").write_text(synthetic_text(random.Random(0), 40), encoding="utf-8")
    sources = f"data.sources=[{tmp_path / 'only.txt'}]"
    proc = run_prepare(sources, f"data.dir={out_root / 'out'}", f"model.vocab_size={VOCAB}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "the val split is empty (1 document(s) in all" in warnings[0]


def test_an_argparse_flag_names_the_override(tmp_path):
    """`--vocab_size 512` (an argparse habit): one line with the key=value it means, nothing written."""
    line = assert_one_line_error(
        run_prepare("--vocab_size", "512", cwd=tmp_path), "unknown option --vocab_size"
    )
    assert "did you mean model.vocab_size=512" in line, line
    assert_nothing_left(tmp_path)


def _other_corpus(tmp_path: Path) -> Path:
    """Markdown files of another text than the session corpus."""
    src = tmp_path / "other_src"
    src.mkdir()
    rng = random.Random(11)
    for i in range(5):
        (src / f"chapter_{i}.md").write_text(f"# Chapter {i}\n\n" + synthetic_text(rng, 8), encoding="utf-8")
    return src


@pytest.mark.parametrize(
    "change, fragments",
    [
        ("sources", ["was prepared from other sources (", "5 file(s) added, e.g.", "16 file(s) removed"]),
        ("settings", ["other settings (data.seed 1234, now 99, data.val_fraction 0.2, now 0.3)"]),
        ("tokenizer", ["other tokenizer (vocab_size 400, now 320)"]),
    ],
)
def test_prepared_data_is_never_replaced_unasked(prepared, corpus_dir, tmp_path, capsys, change, fragments):
    """A data.dir prepared from other sources, settings or tokenizer size stays as it is without
    data.overwrite=true: one line says what differs and how to proceed (runs trained on it would
    lose their data), nothing is written; with data.overwrite=true it is prepared again."""
    from lmsys.prepare import main

    out = tmp_path / "outputs" / "prepared"
    shutil.copytree(prepared, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    overrides = base_overrides(corpus_dir, out)
    if change == "sources":
        overrides[0] = f"data.sources=[{_other_corpus(tmp_path)}]"
    elif change == "settings":
        overrides += ["data.seed=99", "data.val_fraction=0.3"]
    else:
        overrides += ["model.vocab_size=320"]
    assert main(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lmsys-prepare: error: data.dir={out} was prepared"), err
    for fragment in [*fragments, "choose another data.dir, or set data.overwrite=true"]:
        assert fragment in err[0], (fragment, err[0])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert_nothing_left(out.parent, keep={"prepared"})
    assert main([*overrides, "data.overwrite=true"]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} != before


def test_a_damaged_prepared_directory_is_not_replaced_unasked(prepared, corpus_dir, tmp_path):
    """Shards that no longer check out are named, not silently prepared again."""
    out = tmp_path / "outputs" / "prepared"
    shutil.copytree(prepared, out)
    (out / "val_0000.bin").unlink()
    proc = run_prepare(*base_overrides(corpus_dir, out), cwd=tmp_path)
    assert_one_line_error(proc, "val_0000.bin listed in manifest.json is missing", "data.overwrite=true")
    assert not (out / "val_0000.bin").exists()


def test_data_dir_that_is_a_file(tmp_path, out_root):
    """data.dir naming a file: prepare and every reader say it is a file, not that it is missing."""
    from lmsys.core.errors import DataError
    from lmsys.data.shards import PreparedData

    afile = out_root / "notes.txt"
    afile.write_text("not a directory\n", encoding="utf-8")
    proc = run_prepare(f"data.dir={afile}", "data.sources=[/nonexistent]", cwd=tmp_path)
    assert_one_line_error(proc, "nonexistent does not exist")  # the sources are checked first
    src = tmp_path / "src.txt"
    src.write_text(synthetic_text(random.Random(1), 30), encoding="utf-8")
    proc = run_prepare(f"data.dir={afile}", f"data.sources=[{src}]", cwd=tmp_path)
    assert_one_line_error(proc, f"data.dir={afile} is a file, not a directory")
    with pytest.raises(DataError, match=rf"prepared data directory {afile} is a file, not a directory"):
        PreparedData(afile)
    assert afile.read_text(encoding="utf-8") == "not a directory\n"
