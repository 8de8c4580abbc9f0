"""Sources: what `data.sources` names (files, directories, globs) resolved to the files to read,
and what else it matched, for lmsys.data.corpus.

A file named explicitly is read whatever its name. In a directory or glob: `.txt`, `.md` and
`.jsonl` files (each optionally `.gz`) are read; files of OTHER_SUFFIXES (data, code, markup,
media, archives) are skipped; any other file is read when its start is UTF-8 text (sniffed:
LICENSE, Apache-2.0, systemd.automount, ls.1.gz). A file reached twice (a symlink, a second
entry) is read once and reported as a duplicate, so the counts of `SourceScan.summary` add up.
"""

from __future__ import annotations

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


def looks_like_text(path: Path) -> bool:
    """Whether a file's first TEXT_SNIFF_BYTES (decompressed, for .gz) are UTF-8 text: no NUL
    byte, and valid UTF-8 but for a character the cut itself may have split."""
    try:
        with open_binary(path) as fh:
            head = fh.read(TEXT_SNIFF_BYTES)
    except (OSError, EOFError, zlib.error):
        return False
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data" and len(head) == TEXT_SNIFF_BYTES
    return True


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

    def pick(self, path: Path) -> bool:
        """Whether a file a directory or glob matched is read (it is counted either way)."""
        if is_supported(path):
            return True
        if base_suffix(path).lower() in OTHER_SUFFIXES:
            self.skipped_type.append(path)
            return False
        if looks_like_text(path):
            self.by_content.add(path.resolve())
            return True
        self.skipped_binary.append(path)
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
        if self.skipped_binary:
            why.append(f"{len(self.skipped_binary)} binary")
        if self.skipped_type:
            why.append(f"{len(self.skipped_type)} of other types")
        found = f" (it matched {', '.join(why)})" if why else ""
        return DataError(f"data.sources: {what} has no {SUPPORTED_HINT} files{found}")


def scan_sources(sources: Iterable[str]) -> SourceScan:
    """Expand `data.sources` into the ordered files to read (`SourceScan.files`).

    Each entry is a file, a directory (searched recursively, hidden files skipped) or a glob
    (`**` recurses). A file named explicitly is read whatever its name: as jsonl when it ends in
    .jsonl(.gz), as text otherwise. In a directory or glob, .txt, .md and .jsonl files (each
    optionally .gz) are read; files of OTHER_SUFFIXES (.csv, .py, .png, ...) are skipped; any
    other file (LICENSE, Apache-2.0, systemd.automount, ls.1.gz) is read when its start is UTF-8
    text, else skipped as binary. Order: entries as given; inside a directory or glob, sorted by
    path. A file named twice, or through a symlink, is read once (its first place in the order)
    and counted as a duplicate. Raises DataError for a missing path, or a directory or glob with
    nothing to read."""
    scan = SourceScan()
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
            picked = [m for m in matches if scan.pick(m)]
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
