"""What a training run shows the person who started it: one object, rank 0 only.

Lines go to stdout, warnings to stderr as `<prog>: warning: ...`, and while the progress bar is up
both go through it, so they print above the bar instead of tearing it. The other ranks of a job
print nothing: they do the same work and would only repeat rank 0.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm


class Console:
    def __init__(self, prog: str, rank: int = 0, progress: bool = True) -> None:
        self.prog = prog
        self.rank = rank
        self.show_progress = progress
        self._bar: tqdm | None = None

    @property
    def active(self) -> bool:
        return self.rank == 0

    def say(self, message: str) -> None:
        """A line for the user (rank 0)."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)

    def warn(self, message: str) -> None:
        """`<prog>: warning: <message>` on stderr (rank 0)."""
        if not self.active:
            return
        line = f"{self.prog}: warning: {message}"
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def status(self, message: str, end: str = "\n") -> None:
        """A line about the run as a whole (stopping on a signal) on stderr (rank 0), flushed at
        once; `end=""` leaves it open, for the outcome of what it announces."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr, end=end)
        else:
            print(message, file=sys.stderr, end=end, flush=True)

    @contextmanager
    def progress(self, total: int, initial: int) -> Iterator[None]:
        """A progress bar over optimizer steps while the block runs (rank 0, trainer.progress)."""
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=self.prog,
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            file=sys.stderr,
            disable=not (self.active and self.show_progress),
        )
        try:
            yield
        finally:
            self._bar.close()
            self._bar = None

    def step_done(self, loss: float, tokens_per_s: float) -> None:
        """Advance the bar by one step, showing the step's loss and throughput."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self._bar.update(1)
