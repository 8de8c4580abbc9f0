"""What a training run reports, in one place. The trainer hands the `Reporter` typed events and
the reporter feeds its sinks:

    event                      console (rank 0)                metrics.jsonl (rank 0)   W&B (rank 0)
    step_done(StepReport)      bar, or a line every interval   every step ("train")    every log_interval
    eval_done(...)             the validation line             "eval"                  always
    checkpoint_saved(...)      "saved checkpoint ... (stall;   "checkpoint" (stall_s,  no
                               written in the background in)   write_s, waited_s)
    note / warn                the line                        -                       -
    close(exit_code)           -                               closed                  finished; loss.png

One record per step (`lmsys.core.console.StepReport`) carries every number of the step: the
console formats it and `StepReport.metrics()` is what metrics.jsonl stores. The metrics file and
W&B open only once the run directory is settled (`open`), on rank 0; before that, and on the
other ranks, events reach the console alone (which prints on rank 0 only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmsys.core.console import Console, StepReport
from lmsys.training.metrics import MetricsLogger
from lmsys.training.planning import Measured, Plan, memory_line
from lmsys.training.plots import plot_losses


class Reporter:
    """The one place a training run reports through (module docstring)."""

    def __init__(self, console: Console, log_interval: int, plot: bool = True) -> None:
        self.console = console
        self.log_interval = log_interval
        self.plot = plot  # logger.plot: loss.png when the run closes
        self.logger: MetricsLogger | None = None
        self.first_step: int | None = None  # of this launch
        self.max_steps: int | None = None

    @property
    def prog(self) -> str:
        return self.console.prog

    # -- sinks --------------------------------------------------------------------------------

    def open(self, open_logger: Callable[[Callable[[str], None]], MetricsLogger]) -> None:
        """Rank 0, once the run directory is settled: metrics.jsonl and W&B from now on."""
        self.logger = open_logger(self.console.warn)

    @property
    def wandb_id(self) -> str | None:
        return self.logger.wandb_id if self.logger is not None else None

    def wandb_line(self) -> str:
        return self.logger.wandb_line() if self.logger is not None else ""

    # -- events -------------------------------------------------------------------------------

    def note(self, message: str) -> None:
        self.console.note(message)

    def warn(self, message: str) -> None:
        self.console.warn(message)

    @contextmanager
    def steps(self, first: int, last: int) -> Iterator[None]:
        """The loop over steps first..last: the progress bar is up while it runs."""
        self.first_step, self.max_steps = first, last
        with self.console.progress(total=last, initial=first - 1):
            yield

    def step_done(self, report: StepReport) -> None:
        if self.logger is not None:
            due = report.step % self.log_interval == 0 or report.step in (self.first_step, report.max_steps)
            self.logger.log("train", report.step, report.metrics(), to_wandb=due)
        self.console.step_done(report)

    def eval_done(self, step: int, train_loss: float, val_loss: float, coverage: str) -> None:
        if self.logger is not None:
            self.logger.log("eval", step, {"loss": val_loss, "ppl": math.exp(min(val_loss, 80.0))})
        self.console.eval_done(step, train_loss, val_loss, coverage)

    def checkpoint_saved(
        self,
        step: int,
        path: Path,
        seconds: float,
        announce: bool = True,
        write_s: float | None = None,
        waited_s: float = 0.0,
        asynchronous: bool = False,
    ) -> None:
        """A committed checkpoint. seconds: the loop's stall; write_s: writing, checking and
        committing it (the same as the stall when saved synchronously, in the background when not);
        waited_s: of the stall, waiting for the previous save to finish."""
        write_s = seconds if write_s is None else write_s
        if self.logger is not None:
            row = {"path": str(path), "seconds": seconds, "stall_s": seconds, "write_s": write_s}
            row.update(waited_s=waited_s, **{"async": asynchronous})
            self.logger.log("checkpoint", step, row, to_wandb=False)
        if not announce:
            return
        if not asynchronous:
            self.note(f"saved checkpoint {path} ({seconds:.1f} s)")
            return
        waited = f", {waited_s:.2f} s of it waiting for the previous save" if waited_s >= 0.005 else ""
        self.note(
            f"saved checkpoint {path} (loop stalled {seconds:.2f} s{waited}; "
            f"written in the background in {write_s:.2f} s)"
        )

    def memory_measured(
        self, step: int, plan: Plan | None, ranks: list[dict[str, int]], measured: Measured
    ) -> None:
        """After the second applied step (rank 0): every rank's measured peak (lmsys.training.
        planning.measured_peak_bytes; `measured` is rank 0's, for how it was taken) beside the
        prediction, as a line and a `memory` record."""
        peaks = [int(r["measured_peak_bytes"]) for r in ranks]
        largest = max(range(len(peaks)), key=peaks.__getitem__, default=None)
        peak = peaks[largest] if largest is not None else 0
        traced = measured.by == "traced_tensors" and largest is not None
        unconfirmed = int(ranks[largest]["measured_peak_unconfirmed_bytes"]) if traced else 0
        predicted = measured.predicted(plan) if plan is not None else None
        if self.logger is not None:
            values: dict[str, Any] = {
                "measured_peak_bytes": peak,
                "measured_peak_bytes_per_rank": peaks,
                "predicted_peak_bytes": predicted,
                "measured_by": measured.by,
            }
            if measured.includes_diagnosis:
                values["measured_includes_diagnosis"] = True
            if traced:
                values["measured_peak_unconfirmed_bytes"] = unconfirmed
                values["rank0_peak_during"] = measured.during
                values["rank0_peak_holders"] = measured.holders
            self.logger.log("memory", step, values, to_wandb=False)
        if predicted is not None:
            self.note(memory_line(predicted, peak, measured.by, unconfirmed, measured.includes_diagnosis))

    def summary(self, values: dict[str, Any]) -> None:
        if self.logger is not None:
            self.logger.summary(values)

    def close(self, exit_code: int = 0, run_dir: Path | None = None) -> None:
        """Close metrics.jsonl and W&B (with the run's exit status) and draw loss.png (rank 0,
        logger.plot). Safe to call again: only the first call does anything."""
        if self.logger is None:
            return
        logger, self.logger = self.logger, None
        logger.close(exit_code=exit_code)
        if run_dir is not None and self.plot:
            plot_losses(run_dir)
