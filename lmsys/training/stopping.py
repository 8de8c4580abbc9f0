"""Stopping a training run on a signal, after a step, with a checkpoint of it.

SIGTERM and SIGUSR1 mean preemption (a scheduler taking the nodes back, a time limit near: SLURM
sends them with `--signal=B:USR1@120`; torchrun passes them to its workers); SIGINT is Ctrl-C.
Each asks the run to stop after its current optimizer step. The handler only notes the signal.
The step loop reads the note through the step's loss all-reduce (lmsys.train), so every rank
learns of it at the same step, however late the signal reached each one (or if it reached only
one), and all of them finish that step, save it, and exit: EXIT_REQUEUE (75) after a
preemption, so that the launcher requeues the job, 130 after Ctrl-C (lmsys.core.errors).

Repeats of SIGTERM / SIGUSR1 are ignored: a scheduler may signal a job's processes both
directly and through their launcher, and the checkpoint must be finished. A second Ctrl-C, or
Ctrl-C before the first step began, stops at once (KeyboardInterrupt): a checkpoint being written
is abandoned, and since one only becomes visible once complete, nothing is damaged.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """The signals that ask this process to stop, noted for the step loop."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self.armed = False  # set when the step loop starts; before it, Ctrl-C stops at once
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python lets only the main thread handle signals
        for sig in (*PREEMPTION_SIGNALS, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and (not self.armed or self.signum is not None):
            raise KeyboardInterrupt  # nothing trained yet to save, or a second Ctrl-C
        if self.signum is None:
            self.signum = signum

    def flags(self) -> tuple[float, float]:
        """(preemption requested, interrupt requested) on this rank, for the step's all-reduce."""
        return float(self.signum in PREEMPTION_SIGNALS), float(self.signum == signal.SIGINT)

    def name(self) -> str | None:
        """The signal this process received, e.g. SIGTERM."""
        return None if self.signum is None else signal.Signals(self.signum).name
