"""The parts of a training run that hook into its loop (lmsys.training.trainer): fault injection,
the hang watchdog, a bad step's health checks, the memory measurement, the checkpoint saves. Each
is a `Component`; `train()` registers them, and the loop calls each hook on every component, in
the order they were registered:

    begin(loop)                   the engine is built and the run directory open; no step run yet
    before_step(step)             step `step` begins
    at(step, phase, micro_batch)  where the step is: forward, backward, loss all-reduce, ...
    after_forward(step, i, loss)  micro-batch i's loss, which a hook may replace
    after_backward(step)          every backward is done and the step's global loss known
    after_update(step)            the optimizer step is done (or skipped)
    after_step(step)              the step is recorded: its line and its metrics
    step_finished(step)           it was evaluated and saved when due; the loop moves on
    end()                         the loop is over: finished, stopped or failed

A hook does nothing unless a component overrides it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from lmsys.data.loader import Batch, TokenLoader
from lmsys.engine.checkpoint import Checkpoint, TrainState
from lmsys.engine.zero import EngineInfo, StepOutcome


@dataclass
class Event:
    """A step that went wrong, as every rank knows it after the report (lmsys.training.health)."""

    step: int
    kind: str  # non-finite | diverging
    what: str  # e.g. "loss is nan", "loss 21.3 is above log(V) + 1.0 = 7.24"
    report: Path
    data_step: int  # the loader's stream step of the step's data


@dataclass
class Step:
    """One optimizer step as the loop and its components see it, filled in as it runs."""

    step: int
    lr: float
    started: float  # time.perf_counter() at its start
    data_step: int = 0  # the loader's stream step of its data
    batches: list[Batch] = field(default_factory=list)  # this rank's micro-batches
    scales: list[float] = field(default_factory=list)  # each one's share of the step's loss weights
    loss: float = math.nan  # the step's global weighted mean loss
    outcome: StepOutcome | None = None  # the optimizer step's
    seconds: float = 0.0  # the step's wall time, its diagnosis included
    stop: str | None = None  # "preempted" | "interrupted": a rank was signalled to stop after it
    event: Event | None = None  # its loss or gradient went non-finite, or its loss diverged

    @property
    def applied(self) -> bool:
        return self.outcome is not None and self.outcome.applied


class Loop(Protocol):
    """What a component sees of the training loop (lmsys.training.trainer.Trainer)."""

    engine: Any  # the DeepSpeed engine
    engine_info: EngineInfo
    loader: TokenLoader
    state: TrainState
    run_dir: Path
    start_step: int  # the step this launch continues from

    def save(self, announce: bool = True) -> Path:
        """A checkpoint of the step just finished."""
        ...

    def rewind_to(self, found: Checkpoint, data_step: int) -> None:
        """Back to checkpoint `found`, never to train on stream step `data_step` again."""
        ...


class Component:
    """A part of the run that hooks into the loop (module docstring); every hook does nothing."""

    def begin(self, loop: Loop) -> None:
        pass

    def before_step(self, step: int) -> None:
        pass

    def at(self, step: int, phase: str, micro_batch: int | None = None) -> None:
        pass

    def after_forward(self, step: int, micro_batch: int, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def after_backward(self, step: Step) -> None:
        pass

    def after_update(self, step: Step) -> None:
        pass

    def after_step(self, step: Step) -> None:
        pass

    def step_finished(self, step: int) -> None:
        pass

    def end(self) -> None:
        pass


class Components(Component):
    """The registered components, each hook called on every one in order."""

    def __init__(self, components: Sequence[Component] = ()) -> None:
        self.components = list(components)

    def __iter__(self) -> Iterator[Component]:
        return iter(self.components)

    def begin(self, loop: Loop) -> None:
        for c in self.components:
            c.begin(loop)

    def before_step(self, step: int) -> None:
        for c in self.components:
            c.before_step(step)

    def at(self, step: int, phase: str, micro_batch: int | None = None) -> None:
        for c in self.components:
            c.at(step, phase, micro_batch)

    def after_forward(self, step: int, micro_batch: int, loss: torch.Tensor) -> torch.Tensor:
        for c in self.components:
            loss = c.after_forward(step, micro_batch, loss)
        return loss

    def after_backward(self, step: Step) -> None:
        for c in self.components:
            c.after_backward(step)

    def after_update(self, step: Step) -> None:
        for c in self.components:
            c.after_update(step)

    def after_step(self, step: Step) -> None:
        for c in self.components:
            c.after_step(step)

    def step_finished(self, step: int) -> None:
        for c in self.components:
            c.step_finished(step)

    def end(self) -> None:
        for c in self.components:
            c.end()
