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

Ctrl-C is acknowledged at once (rank 0, from the handler: a step may take minutes), naming the
step that will be saved. The line after the save names the command that continues the run
(`continue_command`): the one the launcher passed down in LMSYS_RESUME_COMMAND verbatim (make
train, launch.sweep), else the launcher's own line (LMSYS_LAUNCH_COMMAND, set by
launch.torchrun) or this process's, with `trainer.run_dir=<the run>` and `trainer.resume=auto`.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from lmsys.core.console import is_reporting_rank

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
RESUME_COMMAND_ENV = "LMSYS_RESUME_COMMAND"  # the exact command that continues the run (make, a sweep)
LAUNCH_COMMAND_ENV = "LMSYS_LAUNCH_COMMAND"  # the launcher's command line (launch.torchrun)


class StopRequest:
    """The signals that ask this process to stop, noted for the step loop."""

    def __init__(self, prog: str = "lmsys-train") -> None:
        self.prog = prog
        self.signum: int | None = None  # the first signal received
        self.armed = False  # set when the step loop starts; before it, Ctrl-C stops at once
        self.step = 0  # the optimizer step under way
        self._flags_read = False  # whether this step's flags went into its all-reduce already
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
            if signum == signal.SIGINT:
                self._acknowledge()

    def _acknowledge(self) -> None:
        """The Ctrl-C line, at once. os.write: a print here could re-enter a print under way."""
        if not is_reporting_rank():
            return
        step = self.step + 1 if self._flags_read else self.step  # read already: the next step stops
        line = (
            f"{self.prog}: Ctrl-C: stopping after step {step}, then saving it; Ctrl-C again abandons the save"
        )
        try:
            os.write(sys.stderr.fileno(), f"\n{line}\n".encode())
        except (OSError, ValueError):  # no usable stderr: the stop line still comes
            pass

    def begin_step(self, step: int) -> None:
        self.step, self._flags_read = step, False

    def flags(self) -> tuple[float, float]:
        """(preemption requested, interrupt requested) on this rank, for the step's all-reduce."""
        self._flags_read = True
        return float(self.signum in PREEMPTION_SIGNALS), float(self.signum == signal.SIGINT)

    def name(self) -> str | None:
        """The signal this process received, e.g. SIGTERM."""
        return None if self.signum is None else signal.Signals(self.signum).name


def _with_setting(args: list[str], key: str, value: str) -> list[str]:
    """args with `key=value` replacing any setting of key (or appended)."""
    kept = [a for a in args if a.lstrip("+~").split("=", 1)[0] != key]
    return [*kept, f"{key}={value}"]


def continue_command(run_dir: Path, resume: str) -> str:
    """The command that continues this run from its newest checkpoint (module docstring)."""
    exact = os.environ.get(RESUME_COMMAND_ENV)
    if exact:
        return exact
    launch = os.environ.get(LAUNCH_COMMAND_ENV)
    args = shlex.split(launch) if launch else ["python", "-m", "lmsys.train", *sys.argv[1:]]
    if "-m" in args[3:] or "--multirun" in args:  # a Hydra sweep: run it again in its directory
        return shlex.join(_with_setting(args, "hydra.sweep.dir", str(run_dir.parent)))
    args = _with_setting(args, "trainer.run_dir", str(run_dir))
    if resume != "auto":
        args = _with_setting(args, "trainer.resume", "auto")
    return shlex.join(args)
