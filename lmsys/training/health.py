"""A step that goes wrong: a non-finite loss or gradient norm, or a loss that diverges while
finite. It is replayed to find where it came from, reported, then handled as
trainer.on_nonfinite says.

Diverging: the step's loss is above log(vocab_size) + trainer.spike_margin (worse than guessing
uniformly, which is where training starts) or above trainer.spike_factor times the median of the
last `WINDOW` applied steps' losses (once there are `MIN_HISTORY` of them).

`Health` is a component of the training loop (lmsys.training.components): it judges the step's
loss `after_backward`, before the update, and its gradient `after_update`. Every rank decides
alike: the decision reads the step's global loss and gradient norm only. Then every rank replays
its share of the step (`replay`, below); rank 0 writes `<run>/diagnostics/nonfinite-step-<N>.json`
(or `divergence-step-<N>.json`) and prints one line. `after_step`, once the step is recorded, the
policy applies:
- skip: the step's update is not applied (each one reported);
- stop: the run ends, exit 1, after the report;
- rewind: the trainer goes back to its last intact checkpoint and never trains on the bad step's
  data again: its stream step (lmsys.data.loader) joins the loader's skipped steps, which every
  later checkpoint carries, and `<run>/diagnostics/skipped-data.json`, which a resume reads (a
  checkpoint older than the rewind does not know of it).
Whatever the policy, more than trainer.max_nan_skips such steps in a launch stop the run.

Where a non-finite value, or a diverging loss, comes from: the step replayed with hooks. Every
rank replays its own micro-batches of the step on a plain copy of the model (`replica`: the
engine's current weights, gathered at ZeRO-3, in the engine's dtype; a bad step's update is never
applied, so they are the weights the step ran with). The replay is
deterministic: the batches are the step's own, and the model has no dropout. A hook on every
module watches each micro-batch, in order:

- forward: the first module to finish with a NaN/inf in its output while its inputs are finite
  is where the value appeared. Hooks fire as a module finishes, innermost first, and a module
  whose inputs were already non-finite only passes the value on, so the origin is named even
  when it sits in a parent's own code (then the parent is named). A non-finite weight among the
  module's own or its submodules' names the weight's owner, with the weight.
- backward: the first module whose gradient with respect to its inputs is non-finite while the
  gradient reaching its output is finite; failing that, the first module with a non-finite weight
  gradient.

`replay` also leaves every rank's share of the step's gradient in the copy (each micro-batch's
loss weighted by its share of the step's loss weights, as the trainer does): summed over the
ranks (`module_grad_norms`) it is the step's gradient, whose largest modules a divergence report
names.

A replay needs memory the training step did not: the whole copy, its gradients, and one
micro-batch's activations without checkpointing. When an allocation is refused, the rank's replay
stops with `ReplayDidNotFit` and the report says so; the run goes on under its policy. Where a
collective follows (the ZeRO-3 gather, the gradient norms of a divergence), every rank first
learns which ranks ran short (`ranks_where`), so none waits alone.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmsys.core import rundir
from lmsys.core.config import Config, ModelConfig
from lmsys.core.errors import TrainingError
from lmsys.core.files import atomic_write_text
from lmsys.core.runtime import Setup
from lmsys.data.loader import Batch
from lmsys.engine.checkpoint import find_latest, newest_saved
from lmsys.model.transformer import Transformer
from lmsys.training.components import Component, Event, Loop, Step
from lmsys.training.faults import Faults
from lmsys.training.peak_memory import diagnosis
from lmsys.training.reporter import Reporter

WINDOW = 50  # losses in the running median
MIN_HISTORY = 10  # applied steps before the median test starts


def _number(x: float | None) -> float | str | None:
    """JSON has no NaN or inf: those are written as strings."""
    return x if x is None or math.isfinite(x) else str(x)


class Health(Component):
    """Watches every step's global loss and gradient norm; reports and handles a bad step."""

    def __init__(
        self,
        cfg: Config,
        setup: Setup,
        run_dir: Path,
        reporter: Reporter,
        faults: Faults,
        finish_saves: Callable[[], None] = lambda: None,
    ) -> None:
        t = cfg.trainer
        self.finish_saves = (
            finish_saves  # before a rewind: the checkpoint being written is the one to go back to
        )
        self.cfg, self.setup, self.run_dir, self.report, self.faults = cfg, setup, run_dir, reporter, faults
        self.policy, self.limit = t.on_nonfinite, t.max_nan_skips
        self.save_interval = t.save_interval
        self.factor, self.margin = t.spike_factor, t.spike_margin
        self.ceiling = math.log(cfg.model.vocab_size) + t.spike_margin
        self.history: deque[float] = deque(maxlen=WINDOW)
        self.events = 0  # bad steps in this launch (a rewind does not give them back)
        self.loop: Loop | None = None

    # -- the loop's hooks -----------------------------------------------------------------------

    def begin(self, loop: Loop) -> None:
        self.loop = loop

    def after_backward(self, step: Step) -> None:
        """A bad loss is replayed before the update, on the weights it ran with."""
        step.event = self.investigate(step, self.verdict(step.loss))

    def after_update(self, step: Step) -> None:
        if step.event is None and step.outcome is not None:
            grad_norm = step.outcome.grad_norm
            step.event = self.investigate(
                step, self.gradient_verdict(step.loss, grad_norm, step.applied), grad_norm
            )

    def after_step(self, step: Step) -> None:
        if step.event is not None:
            self.settle(step.event, step.applied)  # raises to stop the run
            if self.policy == "rewind":
                self.rewind(step.event)

    # -- deciding -------------------------------------------------------------------------------

    def verdict(self, loss: float) -> tuple[str, str] | None:
        """(kind, what) when the step's global loss is non-finite or diverging, before its update."""
        if not math.isfinite(loss):
            return "non-finite", f"loss is {loss}"
        if self.margin > 0 and loss > self.ceiling:
            return "diverging", f"loss {loss:.4g} is above log(V) + {self.margin:g} = {self.ceiling:.4g}"
        if self.factor > 0 and len(self.history) >= MIN_HISTORY:
            median = statistics.median(self.history)
            if loss > self.factor * median:
                return "diverging", (
                    f"loss {loss:.4g} is above trainer.spike_factor={self.factor:g} x its running median "
                    f"{median:.4g}"
                )
        return None

    def gradient_verdict(self, loss: float, grad_norm: float | None, applied: bool) -> tuple[str, str] | None:
        """(kind, what) when the update met a non-finite gradient (the loss being finite); else
        the step's loss joins the running median. Under fp16 a skipped update is the loss
        scaler's business (it overflowed and lowers its scale), not an event."""
        if grad_norm is not None and not math.isfinite(grad_norm):
            return "non-finite", f"gradient norm is {grad_norm}"
        if not applied and self.setup.precision != "fp16":
            return "non-finite", "gradient is non-finite"
        if applied:
            self.history.append(loss)
        return None

    # -- reporting ------------------------------------------------------------------------------

    def investigate(
        self, seen: Step, verdict: tuple[str, str] | None, grad_norm: float | None = None
    ) -> Event | None:
        """Every rank, when `verdict` says the step went wrong: replay this rank's micro-batches
        of the step, gather what each found, and (rank 0) write the report and print its line."""
        if verdict is None:
            return None
        assert self.loop is not None
        kind, what = verdict
        setup, step, data_step, batches, loss = self.setup, seen.step, seen.data_step, seen.batches, seen.loss
        # a replica of the whole model, its gradient and activations: not the training step's
        # memory, so the measured peak leaves it out (peak_memory.diagnosis)
        with diagnosis(setup.device):
            finding, largest, total, short_of_memory = self._replay(self.loop.engine, seen, kind)
        grad_norm = total if grad_norm is None else grad_norm
        data = [self.loop.loader.provenance(data_step, i) for i in range(len(batches))]
        gathered: list[Any] = [None] * setup.world_size
        dist.all_gather_object(gathered, (finding, data, short_of_memory))
        findings: list[Finding] = [f for f, _, _ in gathered if f is not None]
        did_not_fit = [{"rank": r, **short} for r, (_, _, short) in enumerate(gathered) if short]
        path = rundir.bad_step_report_file(self.run_dir, kind, step)
        first = min(findings, key=lambda f: (f.micro_batch, f.rank)) if findings else None
        report: dict[str, Any] = {
            "step": step,
            "kind": kind,
            "what": what,
            "loss": _number(loss),
            "grad_norm": _number(grad_norm),
            "rank": first.rank if first else None,
            "micro_batch": first.micro_batch if first else None,
            "module": first.module if first else (largest[0]["module"] if largest else None),
            "pass": first.pass_ if first else None,
            "tensor": first.tensor if first else None,
            "findings": [f.as_dict() for f in findings],
            "largest_gradients": largest,
            "replay_did_not_fit": did_not_fit,
            "data_step": data_step,
            "data": [
                {"rank": r, "micro_batch": i, "sequences": seqs}
                for r, (_, per_micro, _) in enumerate(gathered)
                for i, seqs in enumerate(per_micro)
                if first is None or (r, i) in {(f.rank, f.micro_batch) for f in findings}
            ],
            "policy": self.policy,
        }
        if setup.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(report, indent=1) + "\n")
            where = self._where(first, largest, [d["rank"] for d in did_not_fit if d["out_of_memory"]])
            self.report.note(f"step {step}: {what}; {where}; report: {path}")
        return Event(step, kind, what, path, data_step)

    def _replay(
        self, engine: Any, seen: Step, kind: str
    ) -> tuple[Finding | None, list[dict[str, Any]], float | None, dict[str, Any] | None]:
        """This rank's replay of the step: (where a non-finite value first appeared, the largest
        gradients and the gradient norm of a divergence, None), or, when it runs short of memory,
        (None, [], None, {"out_of_memory": this rank's own, "error": what did not fit}). A
        diagnosis must not end the run it diagnoses."""
        setup, model, finding, short_of_memory = self.setup, None, None, None
        try:
            allocated = partial(self.faults.replay_allocated, seen.step)
            model = replica(engine, self.cfg.model, self.cfg.deepspeed.stage, allocated)
            self.faults.arm(model, replay_step=seen.step)  # an injected fault is part of the model
            finding = replay(model, seen.batches, seen.scales, setup.device, setup.rank)
        except RuntimeError as exc:  # ReplayDidNotFit is one
            if not (isinstance(exc, ReplayDidNotFit) or out_of_memory(exc)):
                raise
            elsewhere = isinstance(exc, ReplayDidNotFit) and exc.elsewhere
            built = "" if isinstance(exc, ReplayDidNotFit) else "the replay: "
            short_of_memory = {"out_of_memory": not elsewhere, "error": built + first_line(exc)}
        largest: list[dict[str, Any]] = []
        total = None
        # the gradient norms are a collective: skipped by every rank when one has no gradient
        if kind == "diverging" and not ranks_where(short_of_memory is not None, setup.device):
            total, largest = module_grad_norms(model)
        del model
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()  # what an out-of-memory replay left cached goes back to training
        return finding, largest, total, short_of_memory

    @staticmethod
    def _where(first: Finding | None, largest: list[dict[str, Any]], did_not_fit: list[int]) -> str:
        if did_not_fit:
            ranks = ", ".join(map(str, did_not_fit))
            short = f"its replay ran out of memory on rank(s) {ranks} (report: replay_did_not_fit)"
            return short if first is None else f"{Health._where(first, [], [])}; {short}"
        if largest:
            return "largest gradients in " + ", ".join(
                f"{g['module']} ({g['grad_norm']:.3g})" for g in largest[:3]
            )
        if first is None:
            return "its replay on every rank stayed finite (not reproducible: a non-deterministic kernel?)"
        module = first.module or "the loss, outside every module"
        tensor = "" if first.tensor in ("output", "input gradient") else f", {first.tensor}"
        return (
            f"first non-finite in {module} ({first.pass_}{tensor}) on rank {first.rank}, "
            f"micro-batch {first.micro_batch}"
        )

    # -- handling -------------------------------------------------------------------------------

    def settle(self, event: Event, applied: bool) -> None:
        """Apply the policy to the run (every rank): raise TrainingError to stop. `applied`: the
        step's update went through (a diverging step's does: only a rewind undoes it)."""
        self.events += 1
        # where the run could resume: the newest checkpoint, or that none was saved yet
        checkpoints = newest_saved(self.run_dir, self.save_interval)
        if self.policy == "stop":
            raise TrainingError(
                f"step {event.step}: {event.what}; stopping (trainer.on_nonfinite=stop): report "
                f"{event.report}; {checkpoints}"
            )
        if self.events > self.limit:
            raise TrainingError(
                f"loss was NaN/inf or diverged at {self.events} steps, more than trainer.max_nan_skips="
                f"{self.limit}; stopping at step {event.step} (lower optim.lr or raise optim.warmup_steps; "
                f"reports in {rundir.diagnostics_dir(self.run_dir)}; {checkpoints})"
            )
        if self.policy == "skip":
            update = "the update was applied" if applied else "skipped the update"
            self.report.warn(
                f"step {event.step}: {event.what}; {update} "
                f"({self.events} of trainer.max_nan_skips={self.limit})"
            )

    def rewind(self, event: Event) -> None:
        """trainer.on_nonfinite=rewind: back to the last intact checkpoint, never to train on the
        event's data again (this launch, every later checkpoint, and a resume through
        skipped-data.json)."""
        assert self.loop is not None
        self.finish_saves()
        found = find_latest(self.run_dir, self.report.warn)
        if found is None:
            raise TrainingError(
                f"step {event.step}: {event.what}; trainer.on_nonfinite=rewind has no checkpoint to go "
                f"back to in {self.run_dir / rundir.CHECKPOINTS} (report: {event.report})"
            )
        back_to = found.state.step
        if self.setup.rank == 0:
            rundir.add_skipped_data(self.run_dir, event.step, event.data_step, back_to, event.report)
        self.report.warn(
            f"step {event.step}: {event.what}; rewound to the checkpoint of step {back_to}; the data of "
            f"step {event.step} (stream step {event.data_step}) is skipped from now on "
            f"({rundir.skipped_data_file(self.run_dir)})"
        )
        self.loop.rewind_to(found, event.data_step)


# ----------------------------------------------------------------------------- the replay

COMPILED_PREFIX = "_orig_mod."  # torch.compile's wrapper in parameter names


class ReplayDidNotFit(TrainingError):
    """A bad step's replay ran out of memory: on this rank (the allocator's message), or, at
    ZeRO-3, on another rank before the gather that every rank joins (`elsewhere`)."""

    def __init__(self, message: str, elsewhere: bool = False) -> None:
        super().__init__(message)
        self.elsewhere = elsewhere


def out_of_memory(exc: BaseException) -> bool:
    """A refused allocation: torch.OutOfMemoryError (CUDA's) or the CPU allocator's RuntimeError."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def ranks_where(flag: bool, device: torch.device) -> list[int]:
    """The ranks whose `flag` is true (a collective every rank joins; [] or [0] on one process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [0] if flag else []
    flags = torch.zeros(dist.get_world_size(), device=device)  # (world,)
    flags[dist.get_rank()] = float(flag)
    dist.all_reduce(flags)
    return [rank for rank, value in enumerate(flags.tolist()) if value]


@dataclass(frozen=True)
class Finding:
    """Where a non-finite value first appeared on one rank."""

    rank: int
    micro_batch: int
    module: str  # dotted path in the Transformer, e.g. blocks.1.attn ("" when outside every module)
    pass_: str  # forward | backward
    tensor: str  # output | weight <name> | input gradient | weight gradient <name> | loss

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "micro_batch": self.micro_batch,
            "module": self.module,
            "pass": self.pass_,
            "tensor": self.tensor,
        }


def _finite(value: Any) -> bool:
    """Whether every floating-point tensor in `value` (a tensor, or a tuple/list of them) is finite."""
    if torch.is_tensor(value):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, (tuple, list)):
        return all(_finite(v) for v in value)
    return True


class _Watch:
    """Forward and full backward hooks on every module of a Transformer; `found` is the first
    (module, pass, tensor) where a non-finite value appeared (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.found: tuple[str, str, str] | None = None
        self.handles = []
        for name, module in model.named_modules():
            if not name:
                continue  # the Transformer itself: its loss() is not its forward
            self.handles.append(module.register_forward_hook(partial(self._forward, name)))
            self.handles.append(module.register_full_backward_hook(partial(self._backward, name)))

    def _forward(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        if self.found is not None or _finite(output):
            return
        if not _finite(args):
            return  # it only carries on a value that appeared before it
        # A non-finite weight of a submodule the module calls other than through its forward
        # (e.g. Norm.add_norm), or its own: named by the weight's owner.
        bad = next((n for n, p in module.named_parameters() if not _finite(p)), None)
        if bad is None:
            self.found = (name, "forward", "output")
        else:
            full = f"{name}.{bad}"
            self.found = (full.rsplit(".", 1)[0], "forward", f"weight {full}")

    def _backward(self, name: str, _module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        if self.found is None and not _finite(grad_input) and _finite(grad_output):
            self.found = (name, "backward", "input gradient")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def replica(
    engine: Any, model_cfg: ModelConfig, stage: int, allocated: Callable[[torch.device], None] | None = None
) -> Transformer:
    """A plain Transformer holding the engine's current weights (the whole of them at ZeRO-3,
    gathered for the copy: a collective every rank joins), on the engine's device and dtype.
    Raises ReplayDidNotFit when the copy cannot be allocated: at ZeRO-3 on every rank alike, the
    gather skipped. allocated: fault injection, called once the copy is allocated."""
    source = engine.module.model
    named = {n.replace(COMPILED_PREFIX, ""): p for n, p in source.named_parameters()}
    buffers = {n.replace(COMPILED_PREFIX, ""): b for n, b in source.named_buffers()}
    first = next(iter(named.values()))
    copy, refused = None, None
    try:
        copy = Transformer(model_cfg).to(device=first.device, dtype=first.dtype)
        if allocated is not None:
            allocated(first.device)
    except RuntimeError as exc:
        if not out_of_memory(exc):
            raise
        copy, refused = None, first_line(exc)
    gather: Any = contextlib.nullcontext()
    if stage == 3:
        short = ranks_where(refused is not None, first.device)
        if short and refused is None:
            ranks = ", ".join(map(str, short))
            raise ReplayDidNotFit(f"skipped: rank(s) {ranks} could not allocate the copy", elsewhere=True)
        import deepspeed  # late: DeepSpeed's import costs seconds (lmsys.engine.zero)

        gather = deepspeed.zero.GatheredParameters(list(named.values()), modifier_rank=None)
    if copy is None:
        raise ReplayDidNotFit(f"the copy of the model: {refused}")
    with torch.no_grad(), gather:
        for name, p in copy.named_parameters():
            p.copy_(named[name].detach())
        for name, b in copy.named_buffers():
            if name in buffers:
                b.copy_(buffers[name].detach())
    copy.train()
    return copy


def first_line(exc: BaseException) -> str:
    """An error's first line (CUDA's out-of-memory message runs to several)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _weight_gradient(model: nn.Module) -> tuple[str, str] | None:
    """(module, parameter name) of the first parameter whose gradient is non-finite."""
    for name, p in model.named_parameters():
        if p.grad is not None and not _finite(p.grad):
            owner = name.rsplit(".", 1)[0] if "." in name else ""
            return owner, name
    return None


def replay(
    model: Transformer, batches: list[Batch], scales: list[float], device: torch.device, rank: int
) -> Finding | None:
    """Forward and backward each micro-batch of this rank's share of a step on `model`, in order,
    until a non-finite value appears; where it first did, or None. The gradients accumulate in
    `model` (micro-batch i's loss weighted by scales[i])."""
    watch = _Watch(model)
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        # the token embedding's input (ids) takes no gradient: its backward hook fires on its output
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return _replay(model, watch, batches, scales, device, rank)


def _replay(
    model: Transformer,
    watch: _Watch,
    batches: list[Batch],
    scales: list[float],
    device: torch.device,
    rank: int,
) -> Finding | None:
    try:
        for i, batch in enumerate(batches):
            on_device = batch.to(device)
            loss = model.loss(on_device.tokens, on_device.weights, on_device.documents)  # 0-dim
            if watch.found is None and not _finite(loss):
                watch.found = ("", "forward", "loss")
            if watch.found is not None:
                return Finding(rank, i, *watch.found)
            (loss * scales[i]).backward()
            if watch.found is None and (bad := _weight_gradient(model)) is not None:
                watch.found = (bad[0], "backward", f"weight gradient {bad[1]}")
            if watch.found is not None:
                return Finding(rank, i, *watch.found)
        return None
    finally:
        watch.remove()


def module_grad_norms(model: nn.Module, top: int = 5) -> tuple[float, list[dict[str, Any]]]:
    """The step's gradient norm and the `top` modules with the largest gradient norm in it: each
    rank's share of the gradient (left by `replay`) summed over the ranks. A collective every rank
    joins."""
    squares: dict[str, float] = {}
    for name, p in model.named_parameters():
        grad = p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(grad)
        owner = name.rsplit(".", 1)[0] if "." in name else name
        squares[owner] = squares.get(owner, 0.0) + float(grad.double().pow(2).sum().item())
    ranked = sorted(squares.items(), key=lambda item: -item[1] if math.isfinite(item[1]) else -math.inf)
    total = math.sqrt(sum(squares.values()))
    return total, [{"module": name, "grad_norm": math.sqrt(sq)} for name, sq in ranked[:top]]
