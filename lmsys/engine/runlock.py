"""One launch per run directory: the lock that keeps a second launch out of a running run's
directory (a requeued job and a manual rerun, two sweeps with one name), which would otherwise
overwrite the first one's checkpoints and mix its metrics.jsonl rows.

    <run_dir>/run.lock      {"host": ..., "pid": ..., "since": ..., "slurm_job_id": ...}

Rank 0 takes the lock before it writes anything into the run directory (lmsys.training.preflight)
and holds it until the process ends. Taking it is atomic: an exclusive `flock` on the file, which
the kernel drops when its holder dies however it dies (kill -9 included), so a lock left by a dead
process is taken over at once. The file's JSON names the holder, for the refusal line and for
the fall-backs:

- a filesystem without flock (ENOLCK, some NFS mounts): the holder named in the file is
  trusted: refused while it is a live process on this host or any process on another host,
  taken over when it names a process of this host that is gone;
- a requeued SLURM job (the same SLURM_JOB_ID as the holder's) takes the lock over even while
  the flock looks held: the scheduler ended the job's earlier run, whose node may still look
  alive to the lock server for a while.

On NFS, flock works across nodes only where the mount forwards locks to the server (NFSv4, or v3
with lockd; not `local_lock=all`); elsewhere it guards one node, and the SLURM rule still holds.
Releasing empties the file (a file left in place, never unlinked: unlinking a locked file lets two
launches lock two different files of one name), also on the hang watchdog's exit (`release_held`);
only a holder killed outright leaves its name there, for the next launch to take over.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from lmsys.core.errors import ConfigError

LOCK_FILE = "run.lock"
RETRIES = 10
_HELD: list[RunLock] = []  # the locks this process holds (release_held)


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run directory's lock."""

    host: str
    pid: int
    since: str  # ISO time the holder took the lock
    slurm_job_id: str | None = None

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"pid {self.pid} on {self.host} (since {self.since}{job})"

    def is_gone(self) -> bool:
        """Known to be dead: a process of this host that no longer exists."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False


def _me() -> Holder:
    return Holder(
        host=socket.gethostname(),
        pid=os.getpid(),
        since=datetime.now().isoformat(timespec="seconds"),
        slurm_job_id=os.environ.get("SLURM_JOB_ID") or None,
    )


def _read_holder(fd: int) -> Holder | None:
    """The holder the lock file names; None when it is empty (released) or unreadable."""
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 4096):
        raw += chunk
    try:
        data: Any = json.loads(raw.decode("utf-8"))
        return Holder(str(data["host"]), int(data["pid"]), str(data["since"]), data.get("slurm_job_id"))
    except (ValueError, KeyError, TypeError):
        return None


def _write_holder(fd: int, holder: Holder | None) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    if holder is not None:
        os.write(fd, json.dumps(asdict(holder)).encode("utf-8"))
    os.fsync(fd)


def _try_flock(fd: int) -> bool | None:
    """True when this process now holds the flock, False when another holds it, None when the
    filesystem does not lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise
    return True


class RunLock:
    """The lock on one run directory, held by this process once `acquire` returns."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self.took_over: Holder | None = None  # the dead or requeued holder this launch replaced
        self._announced = False
        self.created_dir = False  # this launch made the run directory (nothing was there before)

    def acquire(self, announce: bool = True) -> RunLock:
        """Take the lock (creating the run directory), or raise ConfigError naming the holder.
        announce=False leaves the file as it is until `announce()` (a launch that may still be
        refused for another reason leaves the directory untouched)."""
        self.created_dir = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            locked = _try_flock(fd)
            for _ in range(RETRIES):  # a launcher's check (holder_of) holds it for a moment
                if locked is not False:
                    break
                time.sleep(0.1)
                locked = _try_flock(fd)
            holder = _read_holder(fd)
            me = _me()
            same_job = (
                holder is not None and me.slurm_job_id is not None and holder.slurm_job_id == me.slurm_job_id
            )
            if locked is False and not same_job:
                raise self.busy(holder)
            if locked is None and holder is not None and not same_job and not holder.is_gone():
                raise self.busy(holder)
            # free: never taken, released, or left by a holder that died (its flock went with it),
            # or by this SLURM job's earlier run
            if holder is not None:
                self.took_over = holder
        except BaseException:
            os.close(fd)  # closing drops a flock this process took
            raise
        self._fd = fd
        _HELD.append(self)
        if announce:
            self.announce()
        return self

    def announce(self) -> None:
        """Name this process as the holder in the lock file."""
        assert self._fd is not None
        _write_holder(self._fd, _me())
        self._announced = True

    def busy(self, holder: Holder | None) -> ConfigError:
        who = holder.describe() if holder is not None else "another process"
        return ConfigError(
            f"trainer.run_dir={self.run_dir} is in use by another launch: {who}; wait for it to end "
            f"or choose another trainer.run_dir (a crashed holder on another host: remove {self.path})"
        )

    def release(self) -> None:
        """Empty the lock file and drop the lock (also what this process's exit does)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if self in _HELD:
            _HELD.remove(self)
        if self._announced:
            with contextlib.suppress(OSError):
                _write_holder(fd, None)
        os.close(fd)

    def release_untouched(self) -> None:
        """Release after a launch that failed before writing anything: a run directory this launch
        created and that holds nothing but the lock file goes again (a refused launch leaves no
        trace)."""
        self.release()
        if self.created_dir and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
            with contextlib.suppress(OSError):
                self.path.unlink()
                self.run_dir.rmdir()


def release_held() -> None:
    """Release every lock this process holds: for an exit that skips the code which would (the
    hang watchdog's os._exit), so the file does not go on naming a process that is gone."""
    for lock in list(_HELD):
        lock.release()


def holder_of(run_dir: Path) -> Holder | None:
    """Who holds `run_dir`'s lock now, None when it is free: for checks before a launch (the
    launchers), which take nothing."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # no lock file (or none we may open): no run has held it
        return None
    try:
        locked = _try_flock(fd)
        holder = _read_holder(fd)
        if locked is True:
            return None  # free (the flock is dropped when fd closes)
        if holder is None:
            return Holder("an unknown host", 0, "an unknown time") if locked is False else None
        if locked is None and holder.is_gone():
            return None
        if holder.slurm_job_id is not None and holder.slurm_job_id == os.environ.get("SLURM_JOB_ID"):
            return None  # this SLURM job's earlier run: a requeue takes it over
        return holder
    finally:
        os.close(fd)
