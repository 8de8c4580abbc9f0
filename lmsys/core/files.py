"""Writing files so that a kill at any moment never leaves a half-written one behind.

Every lmsys output that something else reads back (checkpoints, prepared data, exports, run
files, sweep indexes) is written under a temporary name beside its destination and renamed
into place when complete: a reader sees the old version or the whole new one, never a mix.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from lmsys.core.errors import NoSpaceError

TMP_PREFIX = ".tmp-"  # the names of files and directories still being written


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (best effort: some filesystems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_files(directory: Path) -> None:
    """fsync every file under `directory`, so its contents are on disk before a rename shows them."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def usual_permissions(directory: Path) -> None:
    """Give `directory` and everything in it the permissions a new file gets here (0666 / 0777 less
    the umask): some writers (safetensors) create 0600 files, unreadable to the user's group."""
    mask = os.umask(0)
    os.umask(mask)
    directory.chmod(0o777 & ~mask)
    for path in directory.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so a reader sees either the old file or the whole new one."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sibling(path: Path, label: str) -> Path:
    """A hidden, unused name next to `path` (`.tmp-<name>.<label>-<pid>-<random>`), for a
    directory being written or an old one being moved aside: whatever a kill leaves under such a
    name is leftover work, which the writers clean up."""
    return path.with_name(f"{TMP_PREFIX}{path.name}.{label}-{os.getpid()}-{secrets.token_hex(4)}")


def destination_of(path: str | os.PathLike) -> Path:
    """The path the user named, for a temporary sibling of it (`.tmp-<name>.<label>-<pid>-<hex>`
    -> `<name>`); any other path as it is."""
    path = Path(path)
    match = re.fullmatch(re.escape(TMP_PREFIX) + r"(.+)\.[a-z]+-\d+-[0-9a-f]{8}", path.name)
    return path.with_name(match.group(1)) if match else path


def os_error_line(exc: OSError) -> str:
    """One line for an OSError a command could not avoid (permissions, a read-only filesystem):
    the path the user named (never a temporary name) and the reason in words."""
    reason = (exc.strerror or type(exc).__name__).lower()
    if exc.filename is None:
        return " ".join(str(exc).split())
    path = destination_of(os.fsdecode(exc.filename))
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {path}: {reason} in {path.parent}; choose a place you can write to"
    return f"{path}: {reason}"


def install_dir(tmp: Path, out: Path) -> None:
    """Rename the finished directory `tmp` to `out`. An existing `out` is moved aside first and
    removed last; if the rename fails it is put back."""
    old = None
    if out.exists():
        old = sibling(out, "old")
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- a full disk

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
MB = 1 << 20


def tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if Path(path).exists() else 0


def filesystem_of(path: Path) -> str:
    """`/mnt/scratch (tmpfs)`: the mount point holding `path` and its type where /proc/mounts says."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    mount = path
    while not os.path.ismount(mount):
        mount = mount.parent
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[1] == str(mount):
                return f"{mount} ({fields[2]})"
    return str(mount)


def is_disk_full(exc: BaseException, path: Path, needed_bytes: int) -> bool:
    """Whether `exc`, raised while writing about `needed_bytes` under `path`, came from a full
    filesystem: ENOSPC / EDQUOT anywhere in its chain, or any write error while less than
    `needed_bytes` is free (torch.save reports a full disk as `RuntimeError: [enforce fail at
    inline_container.cc] . unexpected pos`)."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any(isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS for e in chain):
        return True
    if any("No space left" in str(e) for e in chain):
        return True
    try:
        return shutil.disk_usage(_existing(path)).free < needed_bytes
    except OSError:
        return False


def _existing(path: Path) -> Path:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def no_space_line(path: Path, needed_bytes: int) -> str:
    """`no space left on /mnt/x (tmpfs): needed about 12 MB, 3.1 MB free`."""
    where = _existing(path)
    free = shutil.disk_usage(where).free
    needed = f"{needed_bytes / MB:.1f}" if needed_bytes < 10 * MB else f"{needed_bytes / MB:,.0f}"
    return f"no space left on {filesystem_of(where)}: needed about {needed} MB, {free / MB:.1f} MB free"


@contextlib.contextmanager
def space_checked(path: Path, needed_bytes: int, partial: Path | None, then: str) -> Iterator[None]:
    """Writes under `path` of about `needed_bytes`: a full filesystem becomes one NoSpaceError line
    (`no_space_line`, then `then`: what is kept and what to do), with the `partial` output removed
    first; any other error passes unchanged."""
    try:
        yield
    except Exception as exc:
        full = is_disk_full(exc, path, needed_bytes)
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        if not full:
            raise
        raise NoSpaceError(f"{no_space_line(path, needed_bytes)}; {then}") from exc
