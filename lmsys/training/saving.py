"""The trainer's checkpoint saves, synchronous or asynchronous (trainer.async_save), and what they
report: the save line and the metrics.jsonl checkpoint record carry the loop's stall and the write
time separately (lmsys/engine/async_save.py; the format: lmsys/engine/checkpoint.py). A run that
stops on a signal (lmsys/training/stopping.py) saves its last step here too (`stop_run`).

Asynchronous: `save` starts a save and returns; `poll` (after every step: `Saves` is a component of
the loop, lmsys.training.components) reports it once committed; `wait` finishes it (the end of the
run, a stop, a rewind); `settle` decides the fate of the one in flight when the run fails.
At most one is in flight: a new `save` waits for the previous one and says so.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

from lmsys.core.config import TrainerConfig
from lmsys.core.errors import EXIT_INTERRUPTED, EXIT_REQUEUE, Stopped, TrainingError
from lmsys.core.rundir import CHECKPOINTS, CheckpointRecord
from lmsys.core.runtime import Setup
from lmsys.engine import checkpoint as ckpt
from lmsys.engine.async_save import AsyncSaver, SaveResult
from lmsys.training.components import Component, Loop, Step
from lmsys.training.reporter import Reporter
from lmsys.training.stopping import continue_command


class Saves(Component):
    """This rank's checkpoint saves. Every rank constructs it at the same point (asynchronous
    saves form a process group of their own)."""

    def __init__(
        self,
        asynchronous: bool,
        run_dir: Path,
        rank: int,
        world_size: int,
        keep_last: int,
        report: Reporter,
        timeout_s: float,
        pin: bool,
        pause_s: float = 0.0,
    ) -> None:
        self.run_dir, self.rank, self.keep_last, self.report = run_dir, rank, keep_last, report
        self.pause_s = pause_s  # fault injection (debug.save_delay_s)
        self.saver = AsyncSaver(rank, world_size, timeout_s, pin) if asynchronous else None
        self.quiet: set[int] = set()  # steps whose save line a stop line says instead
        self.saved_step = -1  # the step of the last save this launch started, or the one it resumed
        self.loop: Loop | None = None

    @classmethod
    def of(cls, t: TrainerConfig, setup: Setup, run_dir: Path, report: Reporter, pause_s: float) -> Saves:
        """The saves trainer.async_save and trainer.keep_last ask for; pause_s: debug.save_delay_s."""
        pin = setup.device.type == "cuda"
        return cls(
            t.async_save,
            run_dir,
            setup.rank,
            setup.world_size,
            t.keep_last,
            report,
            t.dist_timeout_s,
            pin,
            pause_s,
        )

    def begin(self, loop: Loop) -> None:
        self.saved_step, self.loop = loop.start_step, loop

    def after_step(self, step: Step) -> None:
        self.poll()  # a save in the background: reported once committed

    @property
    def asynchronous(self) -> bool:
        return self.saver is not None

    def save(
        self, engine: Any, state: ckpt.TrainState, rank_state: dict[str, Any], announce: bool = True
    ) -> Path:
        """Save `state.step` (every rank): started in the background, or written and committed."""
        self.saved_step = state.step
        if not announce:
            self.quiet.add(state.step)
        if self.saver is None:
            start = time.perf_counter()
            path = ckpt.save(
                engine,
                self.run_dir,
                state,
                rank_state,
                self.rank,
                self.keep_last,
                warn=self.report.warn,
                pause_s=self.pause_s,
            )
            seconds = time.perf_counter() - start
            self.report.checkpoint_saved(
                CheckpointRecord(state.step, str(path), seconds, seconds, seconds), announce
            )
            return path
        previous = self.saver.start(
            engine,
            self.run_dir,
            state,
            rank_state,
            self.keep_last,
            pause_s=self.pause_s,
            on_wait=lambda step: self.report.note(
                f"checkpoint {ckpt.tag_for(step)} is still being written; waiting for it before "
                f"saving step {state.step}"
            ),
        )
        if previous is not None:
            self._report(previous)
        return self.run_dir / CHECKPOINTS / ckpt.tag_for(state.step)

    def poll(self) -> None:
        """Report the save in flight if it has been committed (raises if it failed)."""
        if self.saver is not None:
            self._report(self.saver.poll())

    def wait(self, timeout_s: float | None = None) -> None:
        """Finish the save in flight, if any, and report it; after timeout_s (if given) abandon it."""
        if self.saver is not None:
            self._report(self.saver.wait(timeout_s))
            self.saver.abandon()  # nothing left, or one that did not finish in time

    def settle(self, failure: BaseException) -> None:
        """A failing run and its save in flight: after a training error every rank agreed on,
        finish it (it is a good checkpoint); after a second Ctrl-C abandon it (never committed);
        after anything else (a lost rank) give it 30 s, then abandon it."""
        if self.saver is None:
            return
        if isinstance(failure, KeyboardInterrupt):  # a second Ctrl-C: out now
            self.saver.abandon()
            return
        try:  # a lost rank: a save whose files were all written still commits, in moments
            self.wait(None if isinstance(failure, (TrainingError, Stopped)) else 30.0)
        except Exception as failed:  # the run's own error is the one to report
            self.report.warn(f"the checkpoint being written was not committed: {failed}")

    def stop_run(self, why: str, signal: str | None, resume: str) -> NoReturn:
        """Save the step every rank has just finished (unless its periodic save did), say so in one
        line, and raise Stopped with the exit status for the launcher. why: interrupted (Ctrl-C)
        or preempted (by `signal`, or a signal to another rank); resume: trainer.resume."""
        assert self.loop is not None
        step, console = self.loop.state.step, self.report.console
        command = continue_command(self.run_dir, resume)
        if why == "interrupted":
            head, code, then = "interrupted", EXIT_INTERRUPTED, f"continue with: {command}"
        else:
            head, code = f"preempted ({signal or 'a signal to another rank'})", EXIT_REQUEUE
            then = f"exit {EXIT_REQUEUE}: requeue the job, or continue with: {command}"
        self.wait()  # the previous save, reported before the stop line
        console.status(f"{console.prog}: {head}: saving step {step} ...", end="")
        try:
            path = self.run_dir / CHECKPOINTS / ckpt.tag_for(step)
            if self.saved_step != step:
                path = self.loop.save(announce=False)  # the stop line says it
            self.wait()
        except BaseException:
            console.status(" not saved")
            raise
        console.status(f" saved {path}; {then}")
        self.report.close(exit_code=code, run_dir=self.run_dir)
        dist.barrier()  # leave together: a launcher stops the other ranks when the first one exits
        raise Stopped(f"stopped after step {step}", code)

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()

    def _report(self, result: SaveResult | None) -> None:
        if result is None:
            return
        for warning in result.warnings:
            self.report.warn(warning)
        record = CheckpointRecord(
            result.step,
            str(result.path),
            result.stall_s,
            result.stall_s,
            result.write_s,
            result.waited_s,
            asynchronous=True,
        )
        self.report.checkpoint_saved(record, announce=result.step not in self.quiet)
