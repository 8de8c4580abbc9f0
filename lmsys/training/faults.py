"""Fault injection: the trainer.debug_* settings, in one place. Tests (and anyone checking what a
run does when something goes wrong) cause real faults with them; real runs leave them at their
defaults, which inject nothing.

    trainer.debug_nan_steps=[4]          the loss is NaN at these steps (first micro-batch)
    trainer.debug_step_delay_s=0.5       every step takes this much longer
    trainer.debug_crash_at_step=3        the last rank exits (status 13) at this step, first attempt only
    trainer.debug_signal_at_step=3       the last rank sends itself SIGTERM during this step
    trainer.debug_save_delay_s=2         a checkpoint save sleeps this long before it is committed
    trainer.debug_nonfinite_at=["blocks.1.attn:backward:rank1:step4"]
                                         a NaN appears in blocks.1.attn on rank 1 at step 4: in its
                                         output (forward), in the gradient it passes to its input
                                         (backward; optionally on micro-batch M only: ...:microM), or
                                         in one of its weights after the step (weights)
    trainer.debug_hang_step=4            the last rank hangs at the start of this step, first attempt
                                         only: asleep (trainer.debug_hang_how=sleep) or frozen with
                                         SIGSTOP (=stop), for the hang watchdog (training/watchdog.py)
    trainer.debug_break_kernel=attention the kernel self-check sees that kernel's output perturbed
    trainer.debug_replay_oom=["copy:rank1:step3"]
                                         the replay that diagnoses bad step 3 runs out of memory on
                                         rank 1: allocating its copy of the model (copy) or in its
                                         first forward (replay), an allocation of 2**61 bytes that
                                         every allocator refuses

The trainer calls the hooks at fixed points of a step: `before_step`, `poison_loss` on each
micro-batch's loss, `after_step`; the checkpoint save reads `save_pause_s`. A non-finite
injection is a broken module: `arm(model)` hooks it into the training model and into the copy
that lmsys.training.nonfinite replays a step on, so the replay meets the same fault. It fires the
first time its step runs in a launch only (a fault of that step's data: after a rewind, which
never trains on that data again, the step runs clean).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmsys.core.config import TrainerConfig
from lmsys.core.errors import ConfigError


@dataclass
class NonfiniteInjection:
    """trainer.debug_nonfinite_at: MODULE:PASS:rankR:stepS[:microM]."""

    module: str  # dotted path in the Transformer, e.g. blocks.1.attn
    where: str  # forward | backward | weights
    rank: int
    step: int
    micro_batch: int | None = None  # None: every micro-batch of the step
    current_step: int = 0  # the step under way (before_step)
    calls: int = 0  # the module's forwards in the step under way: the micro-batch index
    fired_steps: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, spec: str) -> NonfiniteInjection:
        module, where, rank, step, *micro = spec.split(":")  # validated by lmsys.core.config
        return cls(
            module,
            where,
            int(rank.removeprefix("rank")),
            int(step.removeprefix("step")),
            int(micro[0].removeprefix("micro")) if micro else None,
        )

    def begin_step(self, step: int) -> None:
        if self.current_step == self.step and step != self.step:
            self.fired_steps = self.fired_steps | {self.step}
        self.current_step, self.calls = step, 0

    def live(self) -> bool:
        return self.current_step == self.step and self.step not in self.fired_steps

    def arm(self, model: nn.Module) -> None:
        """Hook the fault into `model` (a Transformer) at self.module."""
        try:
            target = model.get_submodule(self.module)
        except AttributeError:
            raise ConfigError(
                f"trainer.debug_nonfinite_at: the model has no module {self.module!r} (e.g. blocks.0.attn)"
            ) from None
        self.calls = 0  # a replay counts its micro-batches afresh
        if self.where == "forward":
            target.register_forward_hook(self._forward)
        elif self.where == "backward":
            target.register_forward_pre_hook(self._count)
            target.register_full_backward_hook(self._backward)

    def _hit(self) -> bool:
        return self.live() and (self.micro_batch is None or self.calls - 1 == self.micro_batch)

    def _count(self, _module: nn.Module, _args: tuple) -> None:
        self.calls += 1

    def _forward(self, _module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return output * float("nan") if self._hit() else output

    def _backward(self, _module: nn.Module, grad_input: tuple, _grad_output: tuple) -> tuple | None:
        if not self._hit():
            return None
        return tuple(None if g is None else g * float("nan") for g in grad_input)

    def poison_weights(self, model: nn.Module) -> None:
        """After the step: one weight of the module becomes NaN (its local ZeRO-3 partition when
        it has one), as an update with non-finite gradients that got through would leave it."""
        if self.where == "weights" and self.live():
            p = next(model.get_submodule(self.module).parameters())
            local = getattr(p, "ds_tensor", p)
            with torch.no_grad():
                local.data.view(-1)[0] = float("nan")


@dataclass(frozen=True)
class Faults:
    """The faults to inject into one rank of one run."""

    nan_steps: frozenset[int] = frozenset()
    step_delay_s: float = 0.0
    crash_at_step: int = 0
    signal_at_step: int = 0
    save_pause_s: float = 0.0
    hang_step: int = 0
    hang_how: str = "sleep"
    break_kernel: str = ""  # read by the kernel self-check (lmsys/model/selfcheck.py)
    rank: int = 0
    last_rank: bool = False  # crashes and signals reach the last rank only
    first_attempt: bool = True  # crashes happen on a job's first attempt only (torchrun restarts)
    nonfinite: tuple[NonfiniteInjection, ...] = ()  # this rank's (trainer.debug_nonfinite_at)
    replay_oom: frozenset[tuple[str, int]] = frozenset()  # this rank's (where, step): debug_replay_oom

    @classmethod
    def of(cls, t: TrainerConfig, rank: int, world_size: int, restarts: int) -> Faults:
        return cls(
            nan_steps=frozenset(t.debug_nan_steps),
            step_delay_s=t.debug_step_delay_s,
            crash_at_step=t.debug_crash_at_step,
            signal_at_step=t.debug_signal_at_step,
            save_pause_s=t.debug_save_delay_s,
            hang_step=t.debug_hang_step,
            hang_how=t.debug_hang_how,
            break_kernel=t.debug_break_kernel,
            rank=rank,
            last_rank=rank == world_size - 1,
            first_attempt=restarts == 0,
            nonfinite=tuple(i for i in map(NonfiniteInjection.parse, t.debug_nonfinite_at) if i.rank == rank),
            replay_oom=frozenset(
                (where, int(step.removeprefix("step")))
                for where, r, step in (spec.split(":") for spec in t.debug_replay_oom)  # lmsys.core.config
                if int(r.removeprefix("rank")) == rank
            ),
        )

    def arm(self, model: nn.Module, replay_step: int | None = None) -> None:
        """Hook this rank's non-finite injections into `model` (a Transformer); into the copy that
        replays step `replay_step`, its out-of-memory injection too."""
        for injection in self.nonfinite:
            injection.arm(model)
        if replay_step is not None and ("replay", replay_step) in self.replay_oom:
            first = next(module for name, module in model.named_modules() if name)  # the embedding
            device = next(model.parameters()).device
            first.register_forward_pre_hook(lambda _module, _args: refuse_allocation(device))

    def replay_allocated(self, step: int, device: torch.device) -> None:
        """Called once the replay of `step` has allocated its copy of the model (copy:...)."""
        if ("copy", step) in self.replay_oom:
            refuse_allocation(device)

    def before_step(self, step: int, before_hang: Callable[[], None] | None = None) -> None:
        """A preemption that reaches one rank: the last rank signals itself during `step`; or the
        last rank hangs there. before_hang: runs first (the trainer finishes this rank's part of a
        save in flight, so the hang comes after the checkpoints taken before it, as it did when
        saves were synchronous)."""
        for injection in self.nonfinite:
            injection.begin_step(step)
        if step == self.signal_at_step and self.last_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.hang_step and self.last_rank and self.first_attempt:
            if before_hang is not None:
                before_hang()
            if self.hang_how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # every thread, the watchdog's too
            else:
                time.sleep(24 * 3600)  # the watchdog's thread still runs, and answers

    def poison_loss(self, step: int, micro_batch: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss as computed, or NaN on the first micro-batch of a trainer.debug_nan_steps step."""
        if micro_batch == 0 and step in self.nan_steps:
            return loss * float("nan")
        return loss

    def after_update(self, model: nn.Module) -> None:
        """Weights made non-finite after the step's update (trainer.debug_nonfinite_at ...:weights)."""
        for injection in self.nonfinite:
            injection.poison_weights(model)

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


def refuse_allocation(device: torch.device) -> None:
    """A real allocation the allocator refuses (2**61 bytes): its own out-of-memory error."""
    torch.empty(2**61, dtype=torch.uint8, device=device)
