"""Reading raw text: sources (files, directories, globs) into a stream of documents.

A *document* is the unit the packer separates with `eos` and the unit of the train/validation
split: one per `.txt`/`.md` file, one per line of a `.jsonl` file (its `data.text_field`
string). Any of them may be gzip-compressed (`.txt.gz`, `.jsonl.gz`, ...).

Everything here streams. `Corpus.pieces()` yields `(text, ends_document)`: a jsonl line or a
text file up to `PIECE_BYTES` is one piece; a longer text file is read incrementally and cut
into pieces of about `PIECE_BYTES` at paragraph (else line, else space) boundaries, all but
the last with `ends_document=False`. So memory is bounded by `PIECE_BYTES` and the longest
jsonl line, never by a file or the corpus. `documents()` joins the pieces back (for callers that
want whole documents and have small ones).

`default_corpus()` is the corpus every machine has without a download: the docstrings of the
Python standard library found on this machine, read with `ast` (no module is imported), one
document per module, in a deterministic order (about 1.8 MB of English on CPython 3.11).

Mistakes in the input raise `DataError` with one line naming the path (and byte offset for
undecodable bytes); `lmsys-prepare` prints it and exits 2.
"""

from __future__ import annotations

import ast
import codecs
import json
import os
import platform
import sysconfig
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmsys.core.choices import text_encoding
from lmsys.core.errors import DataError
from lmsys.data.sources import SourceFile, SourceScan, first_undecodable_byte, open_binary, scan_sources
from lmsys.data.sources import resolve_sources as resolve_sources  # the name callers know here

DEFAULT_CORPUS_DESCRIPTION = "default corpus: python stdlib docstrings"
PIECE_BYTES = 4 << 20  # text files longer than this are read and encoded in pieces of about this size


# ----------------------------------------------------------------------------- statistics


@dataclass
class CorpusStats:
    """Counts from the latest pass over a corpus (reset at the start of each pass)."""

    documents: int = 0  # non-empty documents yielded
    empty: int = 0  # empty or whitespace-only documents, dropped
    skipped_decode_error: int = 0  # dropped under data.on_decode_error=skip
    text_bytes: int = 0  # UTF-8 bytes of the documents yielded
    skipped: list[str] = field(default_factory=list)  # first few "path@offset" skipped, for the report

    def as_dict(self) -> dict[str, int]:
        return {
            "documents": self.documents,
            "empty": self.empty,
            "skipped_decode_error": self.skipped_decode_error,
            "text_bytes": self.text_bytes,
        }


# ----------------------------------------------------------------------------- corpora


class Corpus:
    """A re-iterable stream of documents plus what the manifest records about its origin."""

    stats: CorpusStats

    def documents(self) -> Iterator[str]:
        raise NotImplementedError

    def pieces(self) -> Iterator[tuple[str, bool]]:
        """`(text, ends_document)` in corpus order; the pieces of a document are consecutive and
        only its last one has `ends_document=True`. By default every document is one piece."""
        for doc in self.documents():
            yield doc, True

    def describe(self) -> dict[str, Any]:
        """The `sources` entry of manifest.json."""
        raise NotImplementedError

    def fingerprint(self) -> dict[str, Any]:
        """What must be unchanged for prepared data to be reused (cheap: no file is read)."""
        raise NotImplementedError

    def _check_nonempty(self) -> None:
        """Called at the end of a pass: a corpus without a single document is a mistake."""
        s = self.stats
        if s.documents == 0:
            what = []
            if s.empty:
                what.append(f"{s.empty} empty")
            if s.skipped_decode_error:
                what.append(f"{s.skipped_decode_error} skipped for undecodable bytes")
            detail = f" ({', '.join(what)})" if what else ""
            raise DataError(f"no documents in {self.name()}{detail}; nothing to train on")

    def name(self) -> str:
        raise NotImplementedError


class FileCorpus(Corpus):
    """Documents from resolved source files (see `resolve_sources`)."""

    def __init__(
        self,
        files: list[SourceFile],
        text_field: str = "text",
        on_decode_error: str = "error",
        piece_bytes: int | None = None,
        encoding: str = "utf-8",
    ):
        if on_decode_error not in ("error", "skip"):
            raise DataError(
                f"data.on_decode_error={on_decode_error!r} is not valid; choose one of: error, skip"
            )
        if not files:
            raise DataError("data.sources matched no files")
        self.files = files
        self.text_field = text_field
        self.on_decode_error = on_decode_error
        self.encoding = checked_encoding(encoding)
        self.piece_bytes = piece_bytes or PIECE_BYTES  # read at call time: tests make it small
        self.stats = CorpusStats()
        self.scan = SourceScan(files=list(files))

    @classmethod
    def from_sources(
        cls,
        sources: Iterable[str],
        text_field: str = "text",
        on_decode_error: str = "error",
        piece_bytes: int | None = None,
        encoding: str = "utf-8",
        suffixes: Iterable[str] = (),
    ) -> FileCorpus:
        """The files `data.sources` names (lmsys.data.sources.scan_sources). A file of no known
        suffix whose start is not text in `encoding` is refused by name (DataError), or with
        on_decode_error=skip left out and named in the scan's summary."""
        scan = scan_sources(sources, suffixes, checked_encoding(encoding))
        if scan.other_encoding and on_decode_error == "error":
            path = scan.other_encoding[0]
            offset, byte = first_undecodable_byte(path, scan.encoding) or (0, 0)
            raise DataError(
                f"{path}: not {scan.encoding} text (byte 0x{byte:02x} at offset {offset}) and not binary "
                f"(no NUL byte){_other_encoding_hint(scan.encoding)}"
                + (f" ({len(scan.other_encoding)} such files)" if len(scan.other_encoding) > 1 else "")
            )
        corpus = cls(
            scan.files,
            text_field=text_field,
            on_decode_error=on_decode_error,
            piece_bytes=piece_bytes,
            encoding=scan.encoding,
        )
        corpus.scan = scan
        return corpus

    def name(self) -> str:
        if len(self.files) == 1:
            return str(self.files[0].path)
        return f"{len(self.files)} source files"

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "files",
            "files": [f.describe() for f in self.files],
            "total_bytes": sum(f.size for f in self.files),
            "matched": self.scan.matched,
            "skipped": [str(p) for p in self.scan.skipped_binary + self.scan.skipped_type][:100],
        }

    def fingerprint(self) -> dict[str, Any]:
        found = {
            "kind": "files",
            "files": [[str(f.path), f.size, f.mtime_ns] for f in self.files],
            "text_field": self.text_field,
            "on_decode_error": self.on_decode_error,
        }
        if self.encoding != "utf-8":  # absent for UTF-8, as in the data prepared before it existed
            found["encoding"] = self.encoding
        return found

    def pieces(self) -> Iterator[tuple[str, bool]]:
        self.stats = CorpusStats()
        for f in self.files:
            if f.is_jsonl:
                for text in self._jsonl_documents(f.path):
                    if text is None:
                        continue
                    if not text.strip():
                        self.stats.empty += 1
                        continue
                    self._count(text)
                    yield text, True
            else:
                yield from self._text_pieces(f.path)
        self._check_nonempty()

    def documents(self) -> Iterator[str]:
        parts: list[str] = []
        for text, end in self.pieces():
            parts.append(text)
            if end:
                yield "".join(parts)
                parts = []

    def _count(self, text: str, document: bool = True) -> None:
        self.stats.documents += int(document)
        self.stats.text_bytes += len(text.encode("utf-8"))

    # -- readers: yield a str per document, or None for one skipped under on_decode_error=skip

    def _undecodable(self, path: Path, offset: int, reason: str, where: str = "") -> None:
        """A document with bytes that are not text: DataError, or skipped (on_decode_error=skip).
        `where`: a jsonl line (always UTF-8, JSON's encoding); else a text file in data.encoding."""
        stream = " of the decompressed stream" if path.suffix == ".gz" else ""
        if self.on_decode_error == "error":
            encoding = "UTF-8" if where or self.encoding == "utf-8" else self.encoding
            hint = (
                "; fix the file or set data.on_decode_error=skip"
                if where
                else _other_encoding_hint(self.encoding)
            )
            raise DataError(
                f"{path}{where}: undecodable {encoding} at byte offset {offset}{stream} ({reason}){hint}"
            )
        self.stats.skipped_decode_error += 1
        if len(self.stats.skipped) < 5:
            self.stats.skipped.append(f"{path}@{offset}")

    def _text_pieces(self, path: Path) -> Iterator[tuple[str, bool]]:
        """A text file: one piece when it holds at most `piece_bytes`, else streamed in pieces."""
        try:
            with open_binary(path) as fh:
                head = fh.read(self.piece_bytes + 1)
                if len(head) <= self.piece_bytes:
                    text = self._decode_whole(path, head)
                    if text is None:
                        return
                    if not text.strip():
                        self.stats.empty += 1
                        return
                    self._count(text)
                    yield text, True
                    return
                if self.on_decode_error == "skip":  # the whole document goes, so look before yielding
                    bad = _first_undecodable(path, self.piece_bytes, self.encoding)
                    if bad is not None:
                        self._undecodable(path, *bad)
                        return
                # A piece is held back until the next one exists, so the last one can say it ends
                # the document (the file is longer than a piece, so there is at least one).
                held: str | None = None
                for piece in self._stream_pieces(path, head, fh):
                    if held is not None:
                        self._count(held, document=False)
                        yield held, False
                    held = piece
                assert held is not None
                self._count(held)
                yield held, True
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: cannot read: {e}") from e

    def _decode_whole(self, path: Path, raw: bytes) -> str | None:
        try:
            text = raw.decode(self.encoding)
        except UnicodeDecodeError as e:
            self._undecodable(path, e.start, e.reason)
            return None
        return text[1:] if text.startswith("\ufeff") else text  # a BOM is not text

    def _stream_pieces(self, path: Path, head: bytes, fh: Any) -> Iterator[str]:
        """Non-empty pieces of about `piece_bytes` from an open file whose first bytes are `head`."""
        pending = ""
        first = True
        for text in _decode_stream(path, head, fh, self.piece_bytes, self._undecodable, self.encoding):
            if first:
                text, first = (text[1:] if text.startswith("\ufeff") else text), False
            pending += text
            if len(pending) >= self.piece_bytes // 4:  # at least a quarter piece (4-byte characters)
                cut = _boundary(pending)
                if cut > 0:
                    yield pending[:cut]
                    pending = pending[cut:]
        if pending:
            yield pending

    def _jsonl_documents(self, path: Path) -> Iterator[str | None]:
        offset = 0
        with open_binary(path) as fh:
            lineno = 0
            try:
                for line in fh:
                    lineno += 1
                    start, offset = offset, offset + len(line)
                    try:
                        decoded = line.decode("utf-8")
                    except UnicodeDecodeError as e:
                        self._undecodable(path, start + e.start, e.reason, where=f":{lineno}")
                        yield None
                        continue
                    if not decoded.strip():
                        continue  # blank lines separate nothing in jsonl
                    yield self._jsonl_text(path, lineno, start, decoded)
            except (OSError, EOFError, zlib.error) as e:
                raise DataError(f"{path}: cannot read line {lineno + 1}: {e}") from e

    def _jsonl_text(self, path: Path, lineno: int, start: int, line: str) -> str | None:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object with a {self.text_field!r} field")
        if self.text_field not in record:
            keys = ", ".join(sorted(map(str, record))[:10]) or "none"
            raise DataError(
                f"{path}:{lineno}: no field {self.text_field!r} (set data.text_field; fields here: {keys})"
            )
        text = record[self.text_field]
        if not isinstance(text, str):
            raise DataError(
                f"{path}:{lineno}: field {self.text_field!r} is {type(text).__name__}, not a string"
            )
        try:  # "\ud800" escapes decode to lone surrogates, which are not UTF-8 text
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            self._undecodable(
                path, start, f"lone surrogate escape at character {e.start}", where=f":{lineno}"
            )
            return None
        return text


def _decode_stream(
    path: Path, head: bytes, fh: Any, block: int, on_error: Any, encoding: str = "utf-8"
) -> Iterator[str]:
    """Decode `head` and then the rest of `fh`, `block` bytes at a time, strictly in `encoding`;
    on undecodable bytes call `on_error(path, byte_offset, reason)` (which raises) and stop."""
    decoder = codecs.getincrementaldecoder(encoding)()
    fed = 0  # bytes given to the decoder before `chunk`
    chunk = head
    while True:
        final = len(chunk) == 0
        buffered = len(decoder.getstate()[0])  # an incomplete character carried from before
        try:
            text = decoder.decode(chunk, final=final)
        except UnicodeDecodeError as e:
            on_error(path, fed - buffered + e.start, e.reason)
            return
        fed += len(chunk)
        if text:
            yield text
        if final:
            return
        chunk = fh.read(block)


def _first_undecodable(path: Path, block: int, encoding: str = "utf-8") -> tuple[int, str] | None:
    """(byte offset, reason) of the first bytes of a file that are not text in `encoding`, or
    None; one streaming pass."""
    found: list[tuple[int, str]] = []

    def note(_path: Path, offset: int, reason: str) -> None:
        found.append((offset, reason))

    with open_binary(path) as fh:
        for _ in _decode_stream(path, fh.read(block), fh, block, note, encoding):
            pass
    return found[0] if found else None


def checked_encoding(encoding: str) -> str:
    """data.encoding as Python's codec name (`latin-1` is `iso8859-1`); DataError when Python
    has no such text encoding."""
    name = text_encoding(encoding)
    if name is None:
        raise DataError(
            f"data.encoding={encoding!r} is not a text encoding Python knows; e.g. utf-8, latin-1, cp1252"
        )
    return name


def _other_encoding_hint(encoding: str) -> str:
    if encoding == "utf-8":
        return (
            "; if it is text in another encoding, set data.encoding to it (e.g. data.encoding=latin-1 or "
            "cp1252), else fix the file or set data.on_decode_error=skip"
        )
    return "; set data.encoding to the file's encoding, fix the file, or set data.on_decode_error=skip"


def _boundary(text: str) -> int:
    """Where to cut a long text into a piece: after the last paragraph break in its second half,
    else after the last newline there, else before the last space there (SentencePiece attaches
    a space to the word after it), else at its end."""
    half = len(text) // 2
    brk = text.rfind("\n\n", half)
    if brk >= 0:
        return brk + 2
    brk = text.rfind("\n", half)
    if brk >= 0:
        return brk + 1
    brk = text.rfind(" ", half)
    if brk > 0:
        return brk
    return len(text)


# ----------------------------------------------------------------------------- default corpus

# Directories of the standard library that hold tests, demos of tests, or third-party code.
_SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "__phello__",
    "_bundled",
}


def _stdlib_files(root: Path) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith((".", "config-", "lib-dynload"))
        )
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith(("test_", "_sysconfigdata")):
                out.append(Path(dirpath) / name)
    return out


def _collect_docstrings(body: list[ast.stmt], prefix: str, out: list[str]) -> None:
    """Docstrings of the classes and functions in `body` (recursively), as `qualname` + text.
    Only statements are visited, never expressions: much faster than ast.walk."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}.{node.name}" if prefix else node.name
            doc = ast.get_docstring(node)
            if doc and doc.strip():
                out.append(f"{name}\n{doc}")
            _collect_docstrings(node.body, name, out)
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            _collect_docstrings(node.body, prefix, out)
            _collect_docstrings(getattr(node, "orelse", []), prefix, out)
            for handler in getattr(node, "handlers", []):
                _collect_docstrings(handler.body, prefix, out)
            _collect_docstrings(getattr(node, "finalbody", []), prefix, out)


def module_docstrings(path: Path, module: str) -> str:
    """One document: the module's, classes' and functions' docstrings, or "" if it has none
    (or does not parse, e.g. lib2to3 fixtures written in Python 2)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        return ""
    parts: list[str] = []
    doc = ast.get_docstring(tree)
    if doc and doc.strip():
        parts.append(doc)
    _collect_docstrings(tree.body, "", parts)
    if not parts:
        return ""
    return f"Module {module}\n\n" + "\n\n".join(parts) + "\n"


class DefaultCorpus(Corpus):
    """Docstrings of the Python standard library on this machine, one document per module.

    The stdlib source directory is walked in sorted order, skipping tests and site-packages;
    each .py file is parsed with `ast` (never imported). The documents are small (about
    1.8 MB in all), so the first pass keeps them for the second (tokenizer sample, then encoding).
    """

    def __init__(self, stdlib: str | Path | None = None):
        self.root = Path(stdlib or sysconfig.get_paths()["stdlib"]).resolve()
        if not self.root.is_dir():
            raise DataError(f"default corpus: the standard library source directory {self.root} is missing")
        self.files = _stdlib_files(self.root)
        if not self.files:
            raise DataError(f"default corpus: no .py files under {self.root}")
        self.stats = CorpusStats()
        self._cache: list[str] | None = None

    def name(self) -> str:
        return f"the default corpus ({self.root})"

    def module_name(self, path: Path) -> str:
        rel = path.relative_to(self.root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1] or ["__init__"]
        return ".".join(parts)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "default",
            "description": DEFAULT_CORPUS_DESCRIPTION,
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "stdlib": str(self.root),
            "files": len(self.files),
            "total_bytes": sum(p.stat().st_size for p in self.files),
        }

    def fingerprint(self) -> dict[str, Any]:
        d = self.describe()
        return {k: d[k] for k in ("kind", "python", "implementation", "stdlib", "files", "total_bytes")}

    def documents(self) -> Iterator[str]:
        self.stats = CorpusStats()
        if self._cache is None:
            self._cache = [d for d in (module_docstrings(p, self.module_name(p)) for p in self.files) if d]
        for text in self._cache:
            self.stats.documents += 1
            self.stats.text_bytes += len(text.encode("utf-8"))
            yield text
        self._check_nonempty()


def default_corpus() -> DefaultCorpus:
    return DefaultCorpus()


def open_corpus(
    sources: Iterable[str],
    text_field: str = "text",
    on_decode_error: str = "error",
    encoding: str = "utf-8",
    suffixes: Iterable[str] = (),
) -> Corpus:
    """`data.sources` → a Corpus: the default corpus when empty, files otherwise (read with
    data.text_field, data.on_decode_error, data.encoding, data.suffixes)."""
    sources = list(sources)
    if not sources:
        return default_corpus()
    return FileCorpus.from_sources(
        sources, text_field=text_field, on_decode_error=on_decode_error, encoding=encoding, suffixes=suffixes
    )


def split_for_training(text: str, max_bytes: int) -> Iterator[str]:
    """Cut a document into SentencePiece training "sentences" of at most `max_bytes` UTF-8 bytes.

    SentencePiece reads one sentence per item and skips ones longer than its
    max_sentence_length, so documents are cut after paragraph breaks (a run of blank lines,
    kept at the end of the piece so newline pieces are learned), and a paragraph still too long
    is cut at its last newline or space before the limit (or hard, if it has none).
    """
    start = 0
    n = len(text)
    while start < n:
        brk = text.find("\n\n", start)
        if brk == -1:
            end = n
        else:
            end = brk + 2
            while end < n and text[end] == "\n":
                end += 1
        yield from _cut_long(text[start:end], max_bytes)
        start = end


def _cut_long(piece: str, max_bytes: int) -> Iterator[str]:
    while len(piece.encode("utf-8")) > max_bytes:
        window = max(1, len(piece.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")))
        cut = max(piece.rfind("\n", 0, window), piece.rfind(" ", 0, window))
        cut = cut + 1 if cut > 0 else window
        yield piece[:cut]
        piece = piece[cut:]
    if piece:
        yield piece
