"""Fault injection: the trainer.debug_* settings, in one place. Tests (and anyone checking what a
run does when something goes wrong) cause real faults with them; real runs leave them at their
defaults, which inject nothing.

    trainer.debug_nan_steps=[4]          the loss is NaN at these steps (first micro-batch)
    trainer.debug_step_delay_s=0.5       every step takes this much longer
    trainer.debug_crash_at_step=3        the last rank exits (status 13) at this step, first attempt only
    trainer.debug_signal_at_step=3       the last rank sends itself SIGTERM during this step
    trainer.debug_save_delay_s=2         a checkpoint save sleeps this long before it is committed

The trainer calls the hooks at fixed points of a step: `before_step`, `poison_loss` on each
micro-batch's loss, `after_step`; the checkpoint save reads `save_pause_s`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmsys.core.config import TrainerConfig


@dataclass(frozen=True)
class Faults:
    """The faults to inject into one rank of one run."""

    nan_steps: frozenset[int] = frozenset()
    step_delay_s: float = 0.0
    crash_at_step: int = 0
    signal_at_step: int = 0
    save_pause_s: float = 0.0
    rank: int = 0
    last_rank: bool = False  # crashes and signals reach the last rank only
    first_attempt: bool = True  # crashes happen on a job's first attempt only (torchrun restarts)

    @classmethod
    def of(cls, t: TrainerConfig, rank: int, world_size: int, restarts: int) -> Faults:
        return cls(
            nan_steps=frozenset(t.debug_nan_steps),
            step_delay_s=t.debug_step_delay_s,
            crash_at_step=t.debug_crash_at_step,
            signal_at_step=t.debug_signal_at_step,
            save_pause_s=t.debug_save_delay_s,
            rank=rank,
            last_rank=rank == world_size - 1,
            first_attempt=restarts == 0,
        )

    def before_step(self, step: int) -> None:
        """A preemption that reaches one rank: the last rank signals itself during `step`."""
        if step == self.signal_at_step and self.last_rank:
            os.kill(os.getpid(), signal.SIGTERM)

    def poison_loss(self, step: int, micro_batch: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss as computed, or NaN on the first micro-batch of a trainer.debug_nan_steps step."""
        if micro_batch == 0 and step in self.nan_steps:
            return loss * float("nan")
        return loss

    def after_step(self, step: int, prog: str, before_exit: Callable[[], None] | None = None) -> None:
        """A slow step, or the last rank dying abruptly (as a lost node would). before_exit: runs
        first (the trainer finishes this rank's part of a save in flight, so that the crash comes
        after the checkpoints taken before it, as it did when saves were synchronous)."""
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        if step == self.crash_at_step and self.last_rank and self.first_attempt:
            if before_exit is not None:
                before_exit()
            print(
                f"{prog}: debug: rank {self.rank} exits at step {step} (trainer.debug_crash_at_step)",
                flush=True,
            )
            os._exit(13)
