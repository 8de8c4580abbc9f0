"""A job with a stuck rank, from the launcher's side: relay the hang watchdog's line and end every
worker of this node, a frozen (SIGSTOPped) one included.

The trainer's watchdog (lmsys/training/watchdog.py) ends the job when a rank stops making
progress: the ranks that still run write one line naming the stuck ranks to the file named by
$LMSYS_HANG_REPORT, kill the stuck ranks they can reach (their own host) and exit 86
(EXIT_STUCK_RANK). `HangRelay` gives each launch such a file and watches it from a thread: once the
line is there the workers get a few seconds to leave on their own, then every process that was
under this launcher then and is still alive gets SIGKILL (which a stopped process cannot ignore,
unlike torchrun's SIGTERM: torchrun would wait its whole --shutdown-timeout for it). With
--max-restarts the workers torchrun starts next are left alone, and watched the same way.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPORT_ENV = "LMSYS_HANG_REPORT"  # the same name as lmsys.training.watchdog.REPORT_ENV
GRACE_S = 5.0  # for the workers to exit by themselves once the line is written


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; its parent has not collected it yet


def _kill(pid: int) -> bool:
    """SIGKILL `pid` (a stopped process too); whether it was still there."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


class HangRelay:
    """The report file of one launch and the thread that ends the workers once it is written."""

    def __init__(self, path: Path | None = None, say: Callable[[str], None] | None = None) -> None:
        self.owned = path is None  # a file of our own is removed by stop(); a sweep's is its to read
        if path is None:
            fd, name = tempfile.mkstemp(prefix="lmsys-hang-", suffix=".txt")
            os.close(fd)
            os.unlink(name)  # the watchdog creates it: its existence is the signal
            path = Path(name)
        self.path = path
        self.killed: list[int] = []
        self.last_line: str | None = None
        self.say = say  # told each line as it comes (a launch with restarts goes on after it)
        self._done = threading.Event()
        # line() must not read the file between the thread's last check of last_line and its
        # unlink: it would find neither (a race seen once in a loaded suite)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="lmsys-hang-relay", daemon=True)

    @classmethod
    def start(cls, say: Callable[[str], None] | None = None) -> HangRelay:
        """Set $LMSYS_HANG_REPORT for the workers (a sweep's own file when it set one) and watch it."""
        given = os.environ.get(REPORT_ENV)
        relay = cls(Path(given) if given else None, say)
        os.environ[REPORT_ENV] = str(relay.path)
        relay._thread.start()
        return relay

    def _watch(self) -> None:
        while not self._done.wait(0.5):
            try:
                line = self.path.read_text().strip()
            except OSError:
                continue
            # The workers of this attempt, as they are now: with --max-restarts torchrun may start
            # new ones once these are gone, and those must live.
            workers = descendants(os.getpid())
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and any(_alive(p) for p in workers):
                time.sleep(0.2)
            self.killed += [p for p in workers if _kill(p)]
            with self._lock:
                self.last_line = line
                if self.owned:
                    self.path.unlink(missing_ok=True)  # a restarted attempt may hang again
            if self.say is not None:
                self.say(line)
            if not self.owned:
                return  # a sweep's file: the sweep reads it; one job is one launch

    def line(self) -> str | None:
        """The watchdog's line, once written (the last one, after restarts)."""
        with self._lock:
            if self.last_line is not None:
                return self.last_line
            try:
                return self.path.read_text().strip() or None
            except OSError:
                return None

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=2)
        if self.owned:
            self.path.unlink(missing_ok=True)
