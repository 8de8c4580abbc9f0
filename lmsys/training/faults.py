"""Fault injection: the debug.* settings (lmsys.core.config.DebugConfig). Tests (and anyone
checking what a run does when something goes wrong) cause real faults with them; real runs leave
them at their defaults, which inject nothing.

    debug.nan_steps=[4]           the loss is NaN at these steps (first micro-batch)
    debug.step_delay_s=0.5        every step takes this much longer
    debug.crash_at_step=3         the last rank exits (status 13) at this step, first attempt only
    debug.signal_at_step=3        the last rank sends itself SIGTERM during this step
    debug.save_delay_s=2          a checkpoint save sleeps this long before it is committed
                                  (lmsys.training.saving)
    debug.nonfinite_at=["blocks.1.attn:backward:rank1:step4"]
                                  a NaN appears in blocks.1.attn on rank 1 at step 4: in its output
                                  (forward), in the gradient it passes to its input (backward;
                                  optionally on micro-batch M only: ...:microM), or in one of its
                                  weights after the step (weights)
    debug.hang_step=4             the last rank hangs at the start of this step, first attempt only:
                                  asleep (debug.hang_how=sleep) or frozen with SIGSTOP (=stop), for
                                  the hang watchdog (lmsys.training.watchdog)
    debug.break_kernel=attention  the kernel self-check sees that kernel's output perturbed
                                  (lmsys.model.selfcheck)
    debug.replay_oom=["copy:rank1:step3"]
                                  the replay that diagnoses bad step 3 runs out of memory on rank 1:
                                  allocating its copy of the model (copy) or in its first forward
                                  (replay), an allocation of 2**61 bytes that every allocator refuses

`Faults` is a component of the training loop (lmsys.training.components): it signals or hangs
`before_step`, poisons a micro-batch's loss `after_forward`, a module's weights `after_update`,
and sleeps or crashes once the step is `step_finished`. A non-finite injection is a broken module:
`arm(model)` hooks it into the training model and into the copy that lmsys.training.health
replays a step on, so the replay meets the same fault. It fires the first time its step runs in a
launch only (a fault of that step's data: after a rewind, which never trains on that data again,
the step runs clean).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmsys.core.config import DebugConfig
from lmsys.core.console import command
from lmsys.core.errors import ConfigError
from lmsys.training.components import Component, Loop, Step


@dataclass
class NonfiniteInjection:
    """debug.nonfinite_at: MODULE:PASS:rankR:stepS[:microM]."""

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
                f"debug.nonfinite_at: the model has no module {self.module!r} (e.g. blocks.0.attn)"
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


@dataclass
class Faults(Component):
    """The faults to inject into one rank of one run."""

    nan_steps: frozenset[int] = frozenset()
    step_delay_s: float = 0.0
    crash_at_step: int = 0
    signal_at_step: int = 0
    hang_step: int = 0
    hang_how: str = "sleep"
    rank: int = 0
    last_rank: bool = False  # crashes and signals reach the last rank only
    first_attempt: bool = True  # crashes happen on a job's first attempt only (torchrun restarts)
    nonfinite: tuple[NonfiniteInjection, ...] = ()  # this rank's (debug.nonfinite_at)
    replay_oom: frozenset[tuple[str, int]] = frozenset()  # this rank's (where, step): debug.replay_oom
    # runs before a hang or a crash: the trainer finishes this rank's part of a save in flight, so
    # the fault comes after the checkpoints taken before it, as it did when saves were synchronous
    finish_saves: Callable[[], None] | None = None
    model: nn.Module | None = None  # the training model, once armed

    @classmethod
    def of(
        cls,
        d: DebugConfig,
        rank: int,
        world_size: int,
        restarts: int,
        finish_saves: Callable[[], None] | None = None,
    ) -> Faults:
        return cls(
            nan_steps=frozenset(d.nan_steps),
            step_delay_s=d.step_delay_s,
            crash_at_step=d.crash_at_step,
            signal_at_step=d.signal_at_step,
            hang_step=d.hang_step,
            hang_how=d.hang_how,
            rank=rank,
            last_rank=rank == world_size - 1,
            first_attempt=restarts == 0,
            nonfinite=tuple(i for i in map(NonfiniteInjection.parse, d.nonfinite_at) if i.rank == rank),
            replay_oom=frozenset(
                (where, int(step.removeprefix("step")))
                for where, r, step in (spec.split(":") for spec in d.replay_oom)  # lmsys.core.config
                if int(r.removeprefix("rank")) == rank
            ),
            finish_saves=finish_saves,
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

    # -- the loop's hooks -----------------------------------------------------------------------

    def begin(self, loop: Loop) -> None:
        self.model = loop.engine.module.model
        self.arm(self.model)

    def before_step(self, step: int) -> None:
        """A preemption that reaches one rank: the last rank signals itself during `step`; or the
        last rank hangs there."""
        for injection in self.nonfinite:
            injection.begin_step(step)
        if step == self.signal_at_step and self.last_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.hang_step and self.last_rank and self.first_attempt:
            if self.finish_saves is not None:
                self.finish_saves()
            if self.hang_how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # every thread, the watchdog's too
            else:
                time.sleep(24 * 3600)  # the watchdog's thread still runs, and answers

    def after_forward(self, step: int, micro_batch: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss as computed, or NaN on the first micro-batch of a debug.nan_steps step."""
        if micro_batch == 0 and step in self.nan_steps:
            return loss * float("nan")
        return loss

    def after_update(self, step: Step) -> None:
        """Weights made non-finite after the step's update (debug.nonfinite_at ...:weights)."""
        for injection in self.nonfinite if self.model is not None else ():
            injection.poison_weights(self.model)

    def step_finished(self, step: int) -> None:
        """A slow step, or the last rank dying abruptly (as a lost node would)."""
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        if step == self.crash_at_step and self.last_rank and self.first_attempt:
            if self.finish_saves is not None:
                self.finish_saves()
            print(f"{command()}: debug: rank {self.rank} exits at step {step} (debug.crash_at_step)")
            sys.stdout.flush()
            os._exit(13)


def refuse_allocation(device: torch.device) -> None:
    """A real allocation the allocator refuses (2**61 bytes): its own out-of-memory error."""
    torch.empty(2**61, dtype=torch.uint8, device=device)
