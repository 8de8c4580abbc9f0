"""lmsys-prepare's main() in this process on corpora it must name or read in another way: Latin-1
files named in one line, or read with data.encoding; a directory of code read with data.suffixes.
Every bad input through the real CLI: tests/integration/data/test_cli_errors.py."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.data import assert_nothing_left


def test_latin1_text_is_named_or_read_with_data_encoding(tmp_path, out_root, capsys):
    """A corpus of Latin-1 files: one line naming the first (not "binary", not skipped unnamed);
    with data.encoding=latin-1 it is prepared and its shards decode to the files' text."""
    from lmsys.data.shards import PreparedData
    from lmsys.data.tokenizer import Tokenizer
    from lmsys.prepare import main
    from tests.unit.data.test_corpus import _latin1_corpus
    from tests.unit.data.test_prepare import split_documents

    src = _latin1_corpus(tmp_path / "briefe")
    (src / "utf8.md").unlink()
    out = out_root / "out"
    common = [f"data.sources=[{src}]", f"data.dir={out}", "model.vocab_size=300", "data.val_fraction=0.4"]
    assert main(common) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"lmsys-prepare: error: {src / 'ANLEITUNG'}: not utf-8 text"
    ), err
    assert "data.encoding=latin-1" in err[0]
    assert_nothing_left(out_root)
    assert main([*common, "data.encoding=latin-1"]) == 0
    data = PreparedData(out)
    tok = Tokenizer(data.tokenizer_path)
    docs = [tok.decode(d[:-1]) for split in ("train", "val") for d in split_documents(data, split)]
    wanted = [(src / n).read_bytes().decode("latin-1") for n in ("ANLEITUNG", "HANDBUCH", "brief.txt")]
    assert sorted(docs) == sorted(wanted)
    assert data.manifest["fingerprint"]["sources"]["encoding"] == "iso8859-1"


def test_a_code_corpus_with_data_suffixes(tmp_path, out_root, capsys):
    """data.suffixes=[.py,.pyi]: a directory of code is a corpus (every .py and .pyi file, nothing
    else); the sources line accounts for the rest."""
    import json

    from lmsys.prepare import main
    from tests.unit.data.test_corpus import _code_tree

    src = _code_tree(tmp_path / "src")
    for i in range(8):  # enough documents for both splits
        (src / "pkg" / f"mod_{i}.py").write_text(
            f"def f{i}(a, b):\n    return a * {i} + b\n", encoding="utf-8"
        )
    out = out_root / "out"
    assert (
        main([f"data.sources=[{src}]", f"data.dir={out}", "model.vocab_size=300", "data.suffixes=[.py,.pyi]"])
        == 0
    )
    assert "13 files matched: 11 read; skipped: 2 of other types (.rs, .txt)" in capsys.readouterr().out
    files = json.loads((out / "manifest.json").read_text())["sources"]["files"]
    assert sorted(Path(f["path"]).suffix for f in files) == [".py"] * 10 + [".pyi"]
