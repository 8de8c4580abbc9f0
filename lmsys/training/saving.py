"""The trainer's checkpoint saves, synchronous or asynchronous (trainer.async_save), and what they
report: the save line and the metrics.jsonl "checkpoint" row carry the loop's stall and the write
time separately (lmsys/engine/async_save.py; the format: lmsys/engine/checkpoint.py).

Asynchronous: `save` starts a save and returns; `poll` (every step) reports it once committed;
`wait` finishes it (the end of the run, a stop, a training error); `abandon` drops it (a second
Ctrl-C, an unexpected failure). At most one is in flight: a new `save` waits for the previous one
and says so.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lmsys.engine import checkpoint as ckpt
from lmsys.engine.async_save import AsyncSaver, SaveResult
from lmsys.engine.rundir import CHECKPOINTS
from lmsys.training.reporter import Reporter


class Saves:
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
        self.pause_s = pause_s  # fault injection (trainer.debug_save_delay_s)
        self.saver = AsyncSaver(rank, world_size, timeout_s, pin) if asynchronous else None
        self.quiet: set[int] = set()  # steps whose save line a stop line says instead

    @property
    def asynchronous(self) -> bool:
        return self.saver is not None

    def save(
        self, engine: Any, state: ckpt.TrainState, rank_state: dict[str, Any], announce: bool = True
    ) -> Path:
        """Save `state.step` (every rank): started in the background, or written and committed."""
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
            self.report.checkpoint_saved(state.step, path, seconds, announce, write_s=seconds)
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

    def abandon(self) -> None:
        if self.saver is not None:
            self.saver.abandon()

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()

    def _report(self, result: SaveResult | None) -> None:
        if result is None:
            return
        for warning in result.warnings:
            self.report.warn(warning)
        self.report.checkpoint_saved(
            result.step,
            result.path,
            result.stall_s,
            announce=result.step not in self.quiet,
            write_s=result.write_s,
            waited_s=result.waited_s,
            asynchronous=True,
        )
