"""What a command or a training run shows the person who started it: one-line errors and warnings,
and a run's `Console` (rank 0 only).

Lines go to stdout, warnings to stderr as `<prog>: warning: ...`, and while the progress bar is up
both go through it, so they print above the bar instead of tearing it. The other ranks of a job
print nothing: they do the same work and would only repeat rank 0.

A step's line and a validation's are formatted from their metrics records (lmsys.core.rundir), the
same numbers metrics.jsonl and W&B get. Two modes. In a terminal (stderr is a tty) with
trainer.progress=true, a progress bar over the steps. Anywhere else (a log file, `| tee`, SLURM,
CI) or with trainer.progress=false, a bar would be carriage-return frames in one endless line: a
plain line every logger.console_interval steps instead (and at the first and last step of a
launch), with the same fields evaluation lines show.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

from lmsys.core.rundir import EvalRecord, TrainRecord

# ----------------------------------------------------------------------------- one-line messages


def one_line(exc: BaseException) -> str:
    """The exception's message with its whitespace (newlines included) folded to single spaces."""
    return " ".join(str(exc).split()) or type(exc).__name__


_COMMAND = ["lmsys"]  # the running command's name (lmsys.cli.run_cli sets it), for library warnings


def set_command(prog: str) -> None:
    _COMMAND[0] = prog


def command() -> str:
    """The name of the command this process runs (`lmsys-train`, ...): the prefix of a warning
    from library code, so every line of a command starts the same way."""
    return _COMMAND[0]


def is_reporting_rank() -> bool:
    """Rank 0 reports; the other ranks of a job fail with the same status, silently."""
    return os.environ.get("RANK", "0") == "0"


def report_error(prog: str, exc: BaseException) -> None:
    """`<prog>: error: <message>` on stderr (rank 0 only)."""
    if is_reporting_rank():
        sys.stdout.flush()
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr, flush=True)


def warn(prog: str, message: str) -> None:
    """`<prog>: warning: <message>` on stderr (rank 0 only)."""
    if is_reporting_rank():
        print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- a training run's console


def duration(seconds: float) -> str:
    """42s, 3m05s, 1h02m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Console:
    def __init__(
        self,
        prog: str,
        rank: int = 0,
        progress: bool = True,
        interval: int = 10,
        terminal: bool | None = None,  # None: whether stderr is a terminal
    ) -> None:
        self.prog = prog
        self.rank = rank
        self.interval = interval
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self.show_bar = progress and terminal
        self._bar: tqdm | None = None
        self._first_step: int | None = None  # of this launch
        self.last_step: TrainRecord | None = None
        self.max_steps: int | None = None  # the last step of the launch (`progress`)
        self.eval_interval: int | None = None  # steps between evaluations (the ETA counts them)
        self.evaluation_estimate_s: float | None = None  # one evaluation, before the first is timed
        self._evaluations_s = 0.0  # this launch's evaluations so far
        self._evaluations_at_last_step_s = 0.0
        self._last_evaluation_s: float | None = None

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

    def note(self, message: str) -> None:
        """`<prog>: <message>` for the user (rank 0)."""
        self.say(f"{self.prog}: {message}")

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
        """A progress bar over optimizer steps while the block runs (rank 0, trainer.progress): the
        launch's steps initial + 1 .. total."""
        self.max_steps = total
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=self.prog,
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            file=sys.stderr,
            disable=not (self.active and self.show_bar),
        )
        try:
            yield
        finally:
            self._bar.close()
            self._bar = None

    def step_done(self, record: TrainRecord) -> None:
        """Advance the bar by one step with the step's fields, or print the plain line when due."""
        if self._first_step is None:
            self._first_step = record.step
        self.last_step = record
        self._evaluations_at_last_step_s = self._evaluations_s
        max_steps = self.max_steps or record.step
        if self._bar is not None and not self._bar.disable:
            postfix = {"loss": f"{record.loss:.4f}", "lr": f"{record.lr:.2e}"}
            if record.grad_norm is not None:
                postfix["gnorm"] = f"{record.grad_norm:.3g}"
            postfix["tok_s"] = f"{record.tokens_per_s:,.0f}"
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)
            return
        due = record.step % self.interval == 0 or record.step in (self._first_step, max_steps)
        if due:
            head = [f"{self.prog}: step {record.step}/{max_steps}", f"loss {record.loss:.4f}"]
            self.say(" | ".join(head + self._fields(record)))

    def eval_done(self, record: EvalRecord, train_loss: float, coverage: str) -> None:
        """The validation line: both losses and the last step's fields."""
        if record.seconds is not None:
            self._evaluations_s += record.seconds
            self._last_evaluation_s = record.seconds
        parts = [
            f"{self.prog}: step {record.step}: train loss {train_loss:.4f}",
            f"val loss {record.loss:.4f} ({coverage})",
        ]
        if self.last_step is not None and self.last_step.step == record.step:
            parts += self._fields(self.last_step)
        self.say(" | ".join(parts))

    def _fields(self, record: TrainRecord) -> list[str]:
        """`lr 3.00e-04`, `grad norm 0.91`, ... (the loss is the caller's: train or val)."""
        out = [f"lr {record.lr:.2e}"]
        if record.grad_norm is not None:
            out.append(f"grad norm {record.grad_norm:.3g}")
        out.append(f"{record.tokens_per_s:,.0f} tok/s")
        if record.mfu is not None:
            out.append(f"MFU {100 * record.mfu:.1f}%")
        out.append(f"elapsed {duration(record.elapsed_s)}")
        max_steps = self.max_steps or record.step
        if record.step < max_steps:
            out.append(f"ETA {duration(self.eta_s(record, max_steps))}")
        return out

    def eta_s(self, record: TrainRecord, max_steps: int) -> float:
        """The time to max_steps: the remaining steps at this launch's mean pace of training so far
        (its evaluations taken out), plus the remaining evaluations at the last one's duration
        (before the first: evaluation_estimate_s, the plan's, when known)."""
        evaluations_s = self._evaluations_at_last_step_s  # those record.elapsed_s holds
        steps_done = max(record.step - (self._first_step or record.step) + 1, 1)
        pace = max(record.elapsed_s - evaluations_s, 0.0) / steps_done
        eta = pace * (max_steps - record.step)
        per_evaluation = self._last_evaluation_s
        if per_evaluation is None:
            per_evaluation = self.evaluation_estimate_s
        if self.eval_interval and per_evaluation is not None:
            eta += per_evaluation * evaluations_after(record.step, max_steps, self.eval_interval)
        return eta


def evaluations_after(step: int, max_steps: int, eval_interval: int) -> int:
    """How many evaluations a run makes after `step`: every eval_interval steps and at max_steps."""
    every = max_steps // eval_interval - step // eval_interval
    return every + (1 if max_steps % eval_interval else 0)
