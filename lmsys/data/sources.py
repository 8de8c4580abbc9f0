"""Sources: what `data.sources` names (files, directories, globs) resolved to the files to read,
and what else it matched, for lmsys.data.corpus.

A file named explicitly is read whatever its name, and so is every file a glob matches when the
glob names a suffix (`src/**/*.py`, `notes/*.cfg`). In a directory, or a glob that names none
(`corpus/*`): with `data.suffixes` set, exactly the files of those suffixes (each optionally
`.gz`); else `.txt`, `.md` and `.jsonl` files (each optionally `.gz`) are read, files of
OTHER_SUFFIXES (data, code, markup, media, archives) are skipped, and any other file is read when
its start is text (sniffed: LICENSE, Apache-2.0, systemd.automount, ls.1.gz). Text is UTF-8
unless `data.encoding` says otherwise: a sniffed file whose start is neither text in that
encoding nor binary (no NUL byte: text in another encoding, such as Latin-1) is named, for the
corpus to refuse or skip. A file reached twice (a symlink, a second entry) is read once and
reported as a duplicate, so the counts of `SourceScan.summary` add up.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmsys.core.errors import DataError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
SUPPORTED = "|".join(s.lstrip(".") for s in TEXT_SUFFIXES + JSONL_SUFFIXES)
SUPPORTED_HINT = ".txt, .md, .jsonl (each optionally .gz) or other UTF-8 text"
# Suffixes of files that are not prose (data, code, markup, media, archives, binaries): skipped in
# a directory or glob without reading them. Any other suffix (none, a version such as `-2.0`'s
# `.0`, a man page's `.5`, `systemd.automount`'s `.automount`) is read when its content is text.
OTHER_SUFFIXES = frozenset(
    ".csv .tsv .json .xml .yaml .yml .toml .ini .cfg .ipynb .py .pyc .pyi .c .h .cc .cpp .hpp .js .ts "
    ".java .go .rs .sh .html .htm .css .svg .png .jpg .jpeg .gif .bmp .ico .webp .pdf .zip .tar .tgz .bz2 "
    ".xz .zst .7z .so .o .a .dll .exe .bin .pt .safetensors .npy .npz .pkl .parquet .arrow .db .sqlite "
    ".mp3 .mp4 .wav .ogg .mov .avi .woff .woff2 .ttf .otf .class .jar .whl .model".split()
)
TEXT_SNIFF_BYTES = 8192  # how much of a file of an unknown suffix is read to tell text from binary


# ----------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class SourceFile:
    path: Path  # absolute
    size: int  # bytes on disk (compressed size for .gz)
    mtime_ns: int

    @property
    def compressed(self) -> bool:
        return self.path.suffix == ".gz"

    @property
    def is_jsonl(self) -> bool:
        return base_suffix(self.path) in JSONL_SUFFIXES

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "bytes": self.size, "mtime_ns": self.mtime_ns}


def base_suffix(path: Path) -> str:
    """`.txt` for both x.txt and x.txt.gz."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] == ".gz":
        return suffixes[-2] if len(suffixes) >= 2 else ""
    return path.suffix


def is_supported(path: Path) -> bool:
    return base_suffix(path) in TEXT_SUFFIXES + JSONL_SUFFIXES


TEXT, BINARY, OTHER_ENCODING = "text", "binary", "other encoding"


def sniff(path: Path, encoding: str = "utf-8") -> str:
    """What a file's first TEXT_SNIFF_BYTES (decompressed, for .gz) are: TEXT in `encoding` (no
    NUL character, a character the cut itself split allowed), BINARY (a NUL byte, or unreadable),
    or OTHER_ENCODING (no NUL byte, yet not text in `encoding`: text in another encoding)."""
    try:
        with open_binary(path) as fh:
            head = fh.read(TEXT_SNIFF_BYTES)
    except (OSError, EOFError, zlib.error):
        return BINARY
    try:
        text = codecs.getincrementaldecoder(encoding)().decode(head, final=len(head) < TEXT_SNIFF_BYTES)
    except UnicodeDecodeError:
        return BINARY if b"\0" in head else OTHER_ENCODING
    return BINARY if "\0" in text else TEXT


def first_undecodable_byte(path: Path, encoding: str) -> tuple[int, int] | None:
    """(offset, byte) where the start of a file stops being text in `encoding`, for a line naming it."""
    with open_binary(path) as fh:
        head = fh.read(TEXT_SNIFF_BYTES)
    try:
        codecs.getincrementaldecoder(encoding)().decode(head, final=False)
    except UnicodeDecodeError as e:
        return e.start, head[e.start]
    return None


def names_files(pattern: str) -> bool:
    """Whether a glob names its files by a suffix (`*.py`, `src/**/*.[ch]`), not just a place
    (`corpus/*`, `corpus/**`, `*.*`)."""
    last = Path(pattern).name
    return "." in last and last.rsplit(".", 1)[1] not in ("", "*")


def normal_suffixes(suffixes: Iterable[str]) -> tuple[str, ...]:
    """data.suffixes as lower-case suffixes with their dot (`py` and `.PY` are `.py`)."""
    out = []
    for suffix in suffixes:
        text = str(suffix).strip().lower()
        if not text.lstrip("."):
            raise DataError(f"data.suffixes has an empty entry ({list(suffixes)!r}); give suffixes like .py")
        out.append(text if text.startswith(".") else f".{text}")
    return tuple(out)


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


@dataclass
class SourceScan:
    """What `data.sources` resolved to: the files to read, and what else its entries matched.
    Every file matched is exactly one of: read (`files`), a duplicate of a file read (a symlink to
    it, or the same file named twice), binary, or of another type (OTHER_SUFFIXES)."""

    files: list[SourceFile] = field(default_factory=list)
    matched: int = 0  # files the entries named or matched
    by_content: set[Path] = field(default_factory=set)  # (resolved) read because their content is text
    duplicates: list[tuple[Path, Path]] = field(default_factory=list)  # (path, the file read instead)
    skipped_binary: list[Path] = field(default_factory=list)  # an unknown suffix, not text
    skipped_type: list[Path] = field(default_factory=list)  # a suffix of OTHER_SUFFIXES (.csv, .py, ...)
    # an unknown suffix, no NUL byte, not text in data.encoding: refused or skipped by the corpus
    other_encoding: list[Path] = field(default_factory=list)
    suffixes: tuple[str, ...] = ()  # data.suffixes: exactly these in a directory, when given
    encoding: str = "utf-8"  # data.encoding

    def pick(self, path: Path) -> bool:
        """Whether a file a directory or glob matched is read (it is counted either way)."""
        if self.suffixes:
            if base_suffix(path).lower() in self.suffixes:
                return True
            self.skipped_type.append(path)
            return False
        if is_supported(path):
            return True
        if base_suffix(path).lower() in OTHER_SUFFIXES:
            self.skipped_type.append(path)
            return False
        kind = sniff(path, self.encoding)
        if kind == TEXT:
            self.by_content.add(path.resolve())
            return True
        (self.other_encoding if kind == OTHER_ENCODING else self.skipped_binary).append(path)
        return False

    def summary(self) -> str:
        """One line for lmsys-prepare: what was matched, read and skipped, and why; the counts add
        up to the files matched."""
        line = f"{self.matched:,} files matched: {len(self.files):,} read"
        content = sum(1 for f in self.files if f.path in self.by_content)
        if content:
            line += f" ({content:,} recognised as text by their content)"
        if self.duplicates:
            n = len(self.duplicates)
            links = all(path.is_symlink() for path, _ in self.duplicates)
            names = ", ".join(f"{path.name} -> {target.name}" for path, target in self.duplicates[:5])
            more = f" and {n - 5} more" if n > 5 else ""
            kind = ("symlink" if n == 1 else "symlinks") if links else "same file as"
            line += f", {n:,} duplicate{'s' if n > 1 else ''} read once ({kind} {names}{more})"
        skipped = []
        if self.other_encoding:
            names = ", ".join(p.name for p in self.other_encoding[:5])
            more = ", ..." if len(self.other_encoding) > 5 else ""
            skipped.append(f"{len(self.other_encoding):,} not {self.encoding} text ({names}{more})")
        if self.skipped_binary:
            skipped.append(f"{len(self.skipped_binary):,} binary")
        if self.skipped_type:
            kinds = sorted({base_suffix(p) for p in self.skipped_type})
            more = ", ..." if len(kinds) > 5 else ""
            skipped.append(f"{len(self.skipped_type):,} of other types ({', '.join(kinds[:5])}{more})")
        if skipped:
            line += "; skipped: " + ", ".join(skipped)
        return line

    def nothing_readable(self, what: str) -> DataError:
        """The error for a directory or glob that matched files but none to read."""
        why = []
        if self.other_encoding:
            why.append(f"{len(self.other_encoding)} not {self.encoding} text")
        if self.skipped_binary:
            why.append(f"{len(self.skipped_binary)} binary")
        if self.skipped_type:
            why.append(f"{len(self.skipped_type)} of other types")
        found = f" (it matched {', '.join(why)})" if why else ""
        if self.suffixes:
            return DataError(
                f"data.sources: {what} has no files of data.suffixes={list(self.suffixes)}{found}"
            )
        return DataError(f"data.sources: {what} has no {SUPPORTED_HINT} files{found}")


def scan_sources(sources: Iterable[str], suffixes: Iterable[str] = (), encoding: str = "utf-8") -> SourceScan:
    """Expand `data.sources` into the ordered files to read (`SourceScan.files`).

    Each entry is a file, a directory (searched recursively, hidden files skipped) or a glob
    (`**` recurses). A file named explicitly, or matched by a glob that names a suffix (`*.py`),
    is read whatever its name: as jsonl when it ends in .jsonl(.gz), as text otherwise. In a
    directory or another glob, the files of `suffixes` (data.suffixes) when given; else .txt, .md
    and .jsonl files (each optionally .gz) are read, files of OTHER_SUFFIXES (.csv, .py, .png, ...)
    are skipped, and any other file (LICENSE, Apache-2.0, systemd.automount, ls.1.gz) is read when
    its start is text in `encoding`, skipped as binary when it holds a NUL byte, and named in
    `other_encoding` otherwise. Order: entries as given; inside a directory or glob, sorted by
    path. A file named twice, or through a symlink, is read once (its first place in the order)
    and counted as a duplicate. Raises DataError for a missing path, or a directory or glob with
    nothing to read."""
    scan = SourceScan(suffixes=normal_suffixes(suffixes), encoding=encoding)
    files: list[Path] = []
    for entry in sources:
        entry = str(entry)
        if not entry.strip():
            raise DataError("data.sources has an empty entry")
        expanded = os.path.expanduser(entry)
        if _is_glob(expanded):
            matches = sorted(Path(m) for m in glob.glob(expanded, recursive=True) if Path(m).is_file())
            if not matches:
                raise DataError(f"data.sources: glob {entry!r} matched no files")
            scan.matched += len(matches)
            picked = matches if names_files(expanded) else [m for m in matches if scan.pick(m)]
            if not picked:
                raise scan.nothing_readable(f"glob {entry!r}")
            files.extend(picked)
            continue
        path = Path(expanded)
        if not path.exists():
            raise DataError(f"data.sources: {entry} does not exist")
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p, path))
            scan.matched += len(found)
            picked = [p for p in found if scan.pick(p)]
            if not picked:
                raise scan.nothing_readable(f"directory {entry}")
            files.extend(picked)
        else:
            scan.matched += 1
            files.append(path)
    first: dict[Path, Path] = {}  # resolved file -> the path it was first read through
    for path in files:
        f = path.resolve()
        if f in first:
            scan.duplicates.append((path, first[f]))
            continue
        first[f] = path
        st = f.stat()
        scan.files.append(SourceFile(path=f, size=st.st_size, mtime_ns=st.st_mtime_ns))
    # a symlink read first stands for its target: the report names the link as the duplicate
    scan.duplicates = [_link_first(path, kept) for path, kept in scan.duplicates]
    return scan


def _link_first(path: Path, kept: Path) -> tuple[Path, Path]:
    """(the duplicate, the file read) of two names of one file, the symlink as the duplicate."""
    return (kept, path) if kept.is_symlink() and not path.is_symlink() else (path, kept)


def resolve_sources(sources: Iterable[str]) -> list[SourceFile]:
    """The files `data.sources` names, in reading order (see `scan_sources`)."""
    return scan_sources(sources).files


def open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
