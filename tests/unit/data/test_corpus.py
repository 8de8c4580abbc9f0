"""Reading sources: files, directories, globs, gzip, jsonl; streaming of long files; bad bytes."""

from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path

import pytest

from lmsys.core.errors import DataError
from lmsys.data.corpus import DefaultCorpus, FileCorpus, default_corpus, resolve_sources
from tests.fixtures.data import UNICODE_SAMPLES


def test_resolve_sources_kinds_and_order(corpus_dir):
    files = [f.path for f in resolve_sources([str(corpus_dir)])]
    names = [p.name for p in files]
    assert ".hidden.txt" not in names and "ignored.csv" not in names
    assert {"book.txt.gz", "records.jsonl", "packed.jsonl.gz", "notes.md"} <= set(names)
    assert files == sorted(files)  # a directory is read in path order
    assert all(f.is_absolute() for f in files)
    # a glob, a file and the same file again (read once), in the order given
    picked = resolve_sources(
        [str(corpus_dir / "nested" / "**" / "*.md"), str(corpus_dir / "records.jsonl")] * 2
    )
    assert [f.path.name for f in picked] == ["notes.md", "records.jsonl"]
    assert picked[1].size == (corpus_dir / "records.jsonl").stat().st_size


@pytest.mark.parametrize(
    "entry, message",
    [
        ("missing_dir", "does not exist"),
        ("empty_dir", "has no .txt, .md, .jsonl"),
        ("*.nothing", "matched no files"),
        ("bin_dir", r"has no .* files \(it matched 1 binary, 1 of other types\)"),
        ("bin_dir/*", r"glob .* has no .* files \(it matched 1 binary, 1 of other types\)"),
    ],
)
def test_resolve_sources_errors(tmp_path, entry, message):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "bin_dir").mkdir()
    (tmp_path / "bin_dir" / "blob").write_bytes(b"\x7fELF\x00\x01\x02")  # no extension, not text
    (tmp_path / "bin_dir" / "image.png").write_bytes(b"\x89PNG\r\n")
    with pytest.raises(DataError, match=message):
        resolve_sources([str(tmp_path / entry)])


def test_text_is_recognised_by_content(tmp_path):
    """Named explicitly, a file is read as text whatever its name; in a directory or glob, files
    without an extension are read when they are UTF-8 text, and what is skipped is counted."""
    (tmp_path / "table.csv").write_text("a,b\n1,2\n")
    assert [f.path.name for f in resolve_sources([str(tmp_path / "table.csv")])] == ["table.csv"]
    licenses = tmp_path / "licenses"
    licenses.mkdir()
    for name in ("GPL-3", "copyright", "COPYING"):
        (licenses / name).write_text(f"{name}: Permission is hereby granted, free of charge ...\n")
    (licenses / "NOTICE").write_text("Ünïcödé text ✓ " * 2000)  # longer than the sniffed head
    (licenses / "blob").write_bytes(bytes(range(256)))
    (licenses / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    corpus = FileCorpus.from_sources([str(licenses)])
    assert sorted(f.path.name for f in corpus.files) == ["COPYING", "GPL-3", "NOTICE", "copyright"]
    assert corpus.scan.summary() == (
        "6 files matched: 4 read (4 recognised as text by their content); "
        "skipped: 1 binary, 1 of other types (.png)"
    )
    assert len(list(corpus.documents())) == 4
    globbed = resolve_sources([str(licenses / "*")])
    assert [f.path.name for f in globbed] == ["COPYING", "GPL-3", "NOTICE", "copyright"]


def test_text_files_are_read_whatever_their_names(tmp_path):
    """Names that end like versions or carry dots (the system's licenses, man pages) are read when
    their content is text; a symlink to a file already read is a duplicate named in the report;
    the counts add up: every file matched is read, a duplicate, binary or of another type."""
    licenses = tmp_path / "common-licenses"
    licenses.mkdir()
    for name in ("Apache-2.0", "CC0-1.0", "LGPL-2.1", "systemd.automount", "GPL-3"):
        (licenses / name).write_text(f"{name}: the licence text, version and terms ...\n")
    (licenses / "GPL").symlink_to("GPL-3")
    (licenses / "blob.0").write_bytes(bytes(range(256)))  # an unknown suffix, binary content
    (licenses / "table.csv").write_text("a,b\n1,2\n")
    (licenses / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    corpus = FileCorpus.from_sources([str(licenses)])
    read = ["Apache-2.0", "CC0-1.0", "GPL-3", "LGPL-2.1", "systemd.automount"]
    assert sorted(f.path.name for f in corpus.files) == read
    scan = corpus.scan
    assert scan.summary() == (
        "9 files matched: 5 read (5 recognised as text by their content), 1 duplicate read once "
        "(symlink GPL -> GPL-3); skipped: 1 binary, 2 of other types (.csv, .png)"
    )
    assert scan.matched == len(scan.files) + len(scan.duplicates) + len(scan.skipped_binary) + len(
        scan.skipped_type
    )
    assert len(list(corpus.documents())) == 5


def test_the_systems_licenses_are_all_read(tmp_path):
    """/usr/share/common-licenses (the README's example): every text file is read, once."""
    system = Path("/usr/share/common-licenses")
    if not system.is_dir():
        pytest.skip("no /usr/share/common-licenses on this machine")
    scan = FileCorpus.from_sources([str(system)]).scan
    real = {p.resolve() for p in system.iterdir() if p.is_file()}
    assert {f.path for f in scan.files} == real and not scan.skipped_binary and not scan.skipped_type
    assert scan.matched == len(scan.files) + len(scan.duplicates)


def test_documents_from_every_format(tmp_path):
    (tmp_path / "a.txt").write_text("\ufeffplain text with a BOM", encoding="utf-8")
    (tmp_path / "b.md").write_text("# markdown\n", encoding="utf-8")
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"body": "first"})
        + "\n\n"
        + json.dumps({"body": "  "})
        + "\n"
        + json.dumps({"body": "ü"})
        + "\n"
    )
    with gzip.open(tmp_path / "d.txt.gz", "wt", encoding="utf-8") as fh:
        fh.write("compressed 日本")
    (tmp_path / "e.txt").write_text("   \n\n")  # whitespace only: dropped, counted
    corpus = FileCorpus.from_sources([str(tmp_path)], text_field="body")
    docs = list(corpus.documents())
    assert docs == ["plain text with a BOM", "# markdown\n", "first", "ü", "compressed 日本"]
    assert corpus.stats.documents == 5 and corpus.stats.empty == 2
    assert corpus.stats.text_bytes == sum(len(d.encode()) for d in docs)


def test_jsonl_field_errors(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"content": "a"}) + "\n")
    with pytest.raises(
        DataError, match=r"x.jsonl:1: no field 'text' \(set data.text_field; fields here: content\)"
    ):
        list(FileCorpus.from_sources([str(tmp_path / "x.jsonl")]).documents())
    (tmp_path / "y.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"y.jsonl:2: invalid JSON"):
        list(FileCorpus.from_sources([str(tmp_path / "y.jsonl")]).documents())


def test_empty_corpus(tmp_path):
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(DataError, match=r"no documents in .*blank.txt \(1 empty\)"):
        list(FileCorpus.from_sources([str(tmp_path / "blank.txt")]).documents())


@pytest.mark.parametrize("compressed", [False, True], ids=["txt", "gz"])
def test_undecodable_offset(tmp_path, compressed):
    good = "ok ✓ ".encode() * 10
    raw = good + b"\xff\xfe" + b" more"
    path = tmp_path / ("bad.txt.gz" if compressed else "bad.txt")
    path.write_bytes(gzip.compress(raw) if compressed else raw)
    with pytest.raises(
        DataError, match=rf"bad.txt(.gz)?: undecodable UTF-8 at byte offset {len(good)}\b"
    ) as err:
        list(FileCorpus.from_sources([str(path)]).documents())
    assert "on_decode_error=skip" in str(err.value)
    (tmp_path / "fine.txt").write_text("fine")
    corpus = FileCorpus.from_sources([str(tmp_path)], on_decode_error="skip")
    assert list(corpus.documents()) == ["fine"]
    assert corpus.stats.skipped_decode_error == 1 and str(path) in corpus.stats.skipped[0]


def test_undecodable_in_jsonl_line(tmp_path):
    first = (json.dumps({"text": "line one"}) + "\n").encode()
    path = tmp_path / "x.jsonl"
    path.write_bytes(first + b'{"text": "caf\xe9"}\n' + first)
    with pytest.raises(DataError, match=rf"x.jsonl:2: undecodable UTF-8 at byte offset {len(first) + 13}\b"):
        list(FileCorpus.from_sources([str(path)]).documents())
    corpus = FileCorpus.from_sources([str(path)], on_decode_error="skip")
    assert list(corpus.documents()) == ["line one", "line one"] and corpus.stats.skipped_decode_error == 1


def _long_text() -> str:
    paragraphs = []
    for i in range(300):
        # multi-byte characters everywhere, so reads split characters at random byte positions
        paragraphs.append(f"Paragraph {i}: " + UNICODE_SAMPLES[i % 8] + " word" * (i % 17) + "\n")
    return "\ufeff" + "\n".join(paragraphs) + "no final newline"


@pytest.mark.parametrize("compressed", [False, True], ids=["txt", "gz"])
def test_long_file_streams_in_pieces(tmp_path, compressed):
    text = _long_text()
    path = tmp_path / ("long.txt.gz" if compressed else "long.txt")
    path.write_bytes(gzip.compress(text.encode()) if compressed else text.encode())
    (tmp_path / "short.txt").write_text("short one")
    piece_bytes = 2000
    corpus = FileCorpus.from_sources([str(path), str(tmp_path / "short.txt")], piece_bytes=piece_bytes)
    pieces = list(corpus.pieces())
    long_pieces = pieces[:-1]
    assert len(long_pieces) > 10
    assert "".join(p for p, _ in long_pieces) == text[1:]  # exact, BOM dropped
    assert [end for _, end in pieces] == [False] * (len(long_pieces) - 1) + [True, True]
    assert all(0 < len(p.encode()) <= 2 * piece_bytes for p, _ in long_pieces)
    assert sum(p.endswith("\n") for p, _ in long_pieces[:-1]) >= len(long_pieces) - 2  # cut at line ends
    assert corpus.stats.documents == 2
    assert list(corpus.documents()) == [text[1:], "short one"]


def test_long_file_undecodable(tmp_path):
    text = _long_text()[1:].encode()
    cut = len(text) * 2 // 3
    cut -= next(i for i in range(4) if (text[cut - i] & 0xC0) != 0x80)  # at a character start
    path = tmp_path / "long.txt"
    path.write_bytes(text[:cut] + b"\xc3\x28" + text[cut:])  # invalid continuation byte
    with pytest.raises(DataError, match=rf"long.txt: undecodable UTF-8 at byte offset {cut}\b"):
        list(FileCorpus.from_sources([str(path)], piece_bytes=1000).pieces())
    # skip: the whole document goes, none of its pieces is yielded
    (tmp_path / "ok.txt").write_text("kept")
    corpus = FileCorpus.from_sources([str(tmp_path)], piece_bytes=1000, on_decode_error="skip")
    assert list(corpus.pieces()) == [("kept", True)]
    assert corpus.stats.skipped_decode_error == 1


def test_default_corpus_is_deterministic():
    full = default_corpus()  # describing it reads no file; parsing all of it is left to lmsys-prepare
    assert full.describe()["kind"] == "default" and len(full.files) > 300
    assert full.fingerprint() == default_corpus().fingerprint()
    root = Path(sysconfig.get_paths()["stdlib"]) / "json"  # a small part of it, parsed twice
    a, b = DefaultCorpus(root), DefaultCorpus(root)
    docs = list(a.documents())
    assert len(docs) >= 3 and docs == list(b.documents())
    assert all(d.startswith("Module ") for d in docs) and "JSON" in docs[0]
    assert a.stats.documents == len(docs) and a.stats.text_bytes == sum(len(d.encode()) for d in docs)


def test_stats_paths_are_strings(corpus_dir):
    described = FileCorpus.from_sources([str(corpus_dir)]).describe()
    json.dumps(described)  # goes into manifest.json
    assert all(Path(f["path"]).is_file() and f["bytes"] > 0 for f in described["files"])


# ----------------------------------------------------------------------------- other encodings, code

GERMAN = "Größe, Straße und Maß: über Äpfel, Öl und Übel. Café crème à la française.\n"


def _latin1_corpus(root: Path) -> Path:
    """A directory of German and French text in Latin-1 (ISO 8859-1): `ANLEITUNG` (no suffix)
    with its first accent at once, `HANDBUCH` with its first one after the sniffed head, and
    `brief.txt`; beside them one UTF-8 file."""
    root.mkdir()
    (root / "ANLEITUNG").write_bytes((GERMAN * 40).encode("latin-1"))
    (root / "HANDBUCH").write_bytes(("plain ascii words " * 600 + GERMAN * 20).encode("latin-1"))
    (root / "brief.txt").write_bytes(("Lieber Jürgen,\n" + GERMAN * 10).encode("latin-1"))
    (root / "utf8.md").write_text("# Notes\n\nÄ UTF-8 file ✓\n", encoding="utf-8")
    return root


def test_text_in_another_encoding_is_named_and_read_with_data_encoding(tmp_path):
    """Latin-1 text is never counted as binary: a file of no known suffix whose first bytes are
    not UTF-8 is refused by name with the data.encoding hint (or, with on_decode_error=skip, left
    out and named in the summary), one whose first foreign byte comes later stops the pass by name
    and offset with the same hint, and data.encoding=latin-1 reads every file exactly."""
    root = _latin1_corpus(tmp_path / "briefe")
    early = (GERMAN * 40).encode("latin-1").index("ö".encode("latin-1"))
    with pytest.raises(DataError) as err:
        FileCorpus.from_sources([str(root)])
    line = str(err.value)
    assert line.startswith(
        f"{root / 'ANLEITUNG'}: not utf-8 text (byte 0xf6 at offset {early}) and not binary"
    )
    assert "set data.encoding to it (e.g. data.encoding=latin-1" in line and "\n" not in line

    skipping = FileCorpus.from_sources([str(root)], on_decode_error="skip")
    assert "skipped: 1 not utf-8 text (ANLEITUNG)" in skipping.scan.summary()
    assert "binary" not in skipping.scan.summary()
    with pytest.raises(
        DataError, match=r"brief.txt: undecodable UTF-8 at byte offset 8 .*data.encoding=latin-1"
    ):
        list(FileCorpus.from_sources([str(root / "brief.txt")]).documents())
    late = ("plain ascii words " * 600).encode()
    with pytest.raises(DataError, match=rf"HANDBUCH: undecodable UTF-8 at byte offset {len(late) + 2} "):
        list(FileCorpus.from_sources([str(root / "HANDBUCH")]).documents())

    latin = FileCorpus.from_sources(
        [str(root / p) for p in ("ANLEITUNG", "HANDBUCH", "brief.txt")], encoding="latin-1"
    )
    assert list(latin.documents()) == [
        (root / name).read_bytes().decode("latin-1") for name in ("ANLEITUNG", "HANDBUCH", "brief.txt")
    ]
    assert latin.fingerprint()["encoding"] == "iso8859-1"  # data prepared in UTF-8 has no such key
    assert "encoding" not in FileCorpus.from_sources([str(root / "utf8.md")]).fingerprint()
    with pytest.raises(DataError, match="data.encoding='klingon' is not a text encoding"):
        FileCorpus.from_sources([str(root)], encoding="klingon")


def _code_tree(root: Path) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text('"""A package."""\n', encoding="utf-8")
    (root / "pkg" / "sub" / "tool.py").write_text("def tool(x):\n    return x + 1\n", encoding="utf-8")
    (root / "pkg" / "sub" / "tool.pyi").write_text("def tool(x: int) -> int: ...\n", encoding="utf-8")
    (root / "pkg" / "lib.rs").write_text("fn main() {}\n", encoding="utf-8")
    (root / "README.txt").write_text("Read me.\n", encoding="utf-8")
    return root


def test_code_is_a_corpus_through_a_glob_or_data_suffixes(tmp_path):
    """A glob that names a suffix reads the files it matches, code included; data.suffixes chooses
    which suffixes a directory contributes (and only those); without either, code in a directory
    is skipped as before."""
    root = _code_tree(tmp_path / "src")
    names = lambda files: sorted(f.path.name for f in files)  # noqa: E731
    assert names(resolve_sources([str(root)])) == ["README.txt"]
    assert names(resolve_sources([str(root / "**" / "*.py")])) == ["__init__.py", "tool.py"]
    with pytest.raises(DataError, match=r"glob .*pkg/\*' has no .* files \(it matched 2 of other types\)"):
        resolve_sources([str(root / "pkg" / "*")])  # a glob naming no suffix chooses as a directory
    corpus = FileCorpus.from_sources([str(root)], suffixes=["py", ".PYI"])
    assert names(corpus.files) == ["__init__.py", "tool.py", "tool.pyi"]
    assert corpus.scan.summary() == "5 files matched: 3 read; skipped: 2 of other types (.rs, .txt)"
    assert "def tool(x):\n    return x + 1\n" in list(corpus.documents())
    with pytest.raises(
        DataError, match=r"has no files of data.suffixes=\['.go'\] \(it matched 2 of other types\)"
    ):
        FileCorpus.from_sources([str(root / "pkg" / "sub")], suffixes=[".go"])
