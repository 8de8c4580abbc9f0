"""A step that goes wrong: a non-finite loss or gradient norm, or a loss that diverges while
finite. It is reported (where it came from: lmsys.training.nonfinite), then handled as
trainer.on_nonfinite says.

Diverging: the step's loss is above log(vocab_size) + trainer.spike_margin (worse than guessing
uniformly, which is where training starts) or above trainer.spike_factor times the median of the
last `WINDOW` applied steps' losses (once there are `MIN_HISTORY` of them).

Every rank decides alike: the decision reads the step's global loss and gradient norm only. Then
every rank replays its share of the step (`nonfinite.replay`); rank 0 writes
`<run>/diagnostics/nonfinite-step-<N>.json` (or `divergence-step-<N>.json`) and prints one line.

Policies:
- skip: the step's update is not applied (each one reported);
- stop: the run ends, exit 1, after the report;
- rewind: the run goes back to its last intact checkpoint and never trains on the bad step's
  data again: its stream step (lmsys.data.loader) joins the loader's skipped steps, which every
  later checkpoint carries, and `<run>/diagnostics/skipped-data.json`, which a resume reads (a
  checkpoint older than the rewind does not know of it).
Whatever the policy, more than trainer.max_nan_skips such steps in a launch stop the run.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmsys.core.config import Config
from lmsys.core.errors import TrainingError
from lmsys.core.files import atomic_write_text
from lmsys.core.runtime import Setup
from lmsys.data.loader import Batch, TokenLoader
from lmsys.engine.checkpoint import newest_saved
from lmsys.training.faults import Faults
from lmsys.training.metrics import diagnosis
from lmsys.training.nonfinite import (
    Finding,
    ReplayDidNotFit,
    first_line,
    module_grad_norms,
    out_of_memory,
    ranks_where,
    replay,
    replica,
)
from lmsys.training.reporter import Reporter

DIAGNOSTICS = "diagnostics"
SKIPPED_DATA = "skipped-data.json"
WINDOW = 50  # losses in the running median
MIN_HISTORY = 10  # applied steps before the median test starts


def _number(x: float | None) -> float | str | None:
    """JSON has no NaN or inf: those are written as strings."""
    return x if x is None or math.isfinite(x) else str(x)


@dataclass
class StepData:
    """What a step ran on, on this rank: enough to replay it."""

    step: int
    data_step: int  # the loader's stream step
    batches: list[Batch]  # this rank's micro-batches
    scales: list[float]  # each one's share of the step's loss weights (`scales_of`)
    loss: float  # the step's global loss


@dataclass
class Event:
    """A step that went wrong, as every rank knows it after the report."""

    step: int
    kind: str  # non-finite | diverging
    what: str  # e.g. "loss is nan", "loss 21.3 is above log(V) + 1.0 = 7.24"
    report: Path
    data_step: int  # the loader's stream step of the step's data


class Health:
    """Watches every step's global loss and gradient norm; reports and handles a bad step."""

    def __init__(self, cfg: Config, setup: Setup, run_dir: Path, reporter: Reporter, faults: Faults) -> None:
        t = cfg.trainer
        self.cfg, self.setup, self.run_dir, self.report, self.faults = cfg, setup, run_dir, reporter, faults
        self.policy, self.limit = t.on_nonfinite, t.max_nan_skips
        self.save_interval = t.save_interval
        self.factor, self.margin = t.spike_factor, t.spike_margin
        self.ceiling = math.log(cfg.model.vocab_size) + t.spike_margin
        self.history: deque[float] = deque(maxlen=WINDOW)
        self.events = 0  # bad steps in this launch (a rewind does not give them back)
        self.skipped = set(skipped_data_steps(run_dir))  # stream steps never trained on

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

    def after_update(self, loss: float, grad_norm: float | None, applied: bool) -> tuple[str, str] | None:
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
        self,
        engine: Any,
        loader: TokenLoader,
        seen: StepData,
        verdict: tuple[str, str] | None,
        grad_norm: float | None = None,
    ) -> Event | None:
        """Every rank, when `verdict` says the step went wrong: replay this rank's micro-batches
        of the step, gather what each found, and (rank 0) write the report and print its line."""
        if verdict is None:
            return None
        kind, what = verdict
        setup, step, data_step, batches, loss = self.setup, seen.step, seen.data_step, seen.batches, seen.loss
        # a replica of the whole model, its gradient and activations: not the training step's
        # memory, so the measured peak leaves it out (metrics.diagnosis)
        with diagnosis(setup.device):
            finding, largest, total, short_of_memory = self._replay(engine, seen, kind)
        grad_norm = total if grad_norm is None else grad_norm
        data = [loader.provenance(data_step, i) for i in range(len(batches))]
        gathered: list[Any] = [None] * setup.world_size
        dist.all_gather_object(gathered, (finding, data, short_of_memory))
        findings: list[Finding] = [f for f, _, _ in gathered if f is not None]
        did_not_fit = [{"rank": r, **short} for r, (_, _, short) in enumerate(gathered) if short]
        name = "nonfinite" if kind == "non-finite" else "divergence"
        path = self.run_dir / DIAGNOSTICS / f"{name}-step-{step}.json"
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
        self, engine: Any, seen: StepData, kind: str
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
                f"reports in {self.run_dir / DIAGNOSTICS}; {checkpoints})"
            )
        if self.policy == "skip":
            update = "the update was applied" if applied else "skipped the update"
            self.report.warn(
                f"step {event.step}: {event.what}; {update} "
                f"({self.events} of trainer.max_nan_skips={self.limit})"
            )

    def skip_data(self, event: Event, loader: TokenLoader, rewound_to: int) -> None:
        """trainer.on_nonfinite=rewind: never train on the event's data again (this launch, every
        later checkpoint, and a resume through skipped-data.json)."""
        self.skipped.add(event.data_step)
        loader.skip_steps(self.skipped)
        if self.setup.rank == 0:
            path = self.run_dir / DIAGNOSTICS / SKIPPED_DATA
            entries = json.loads(path.read_text(encoding="utf-8"))["skipped"] if path.exists() else []
            entry = {"step": event.step, "data_step": event.data_step, "rewound_to": rewound_to}
            entries.append({**entry, "report": event.report.name})
            atomic_write_text(path, json.dumps({"skipped": entries}, indent=1) + "\n")
        self.report.warn(
            f"step {event.step}: {event.what}; rewound to the checkpoint of step {rewound_to}; the "
            f"data of step {event.step} (stream step {event.data_step}) is skipped from now on "
            f"({self.run_dir / DIAGNOSTICS / SKIPPED_DATA})"
        )


def skipped_data_steps(run_dir: Path) -> list[int]:
    """The stream steps a run never trains on (its skipped-data.json), for a resume."""
    path = run_dir / DIAGNOSTICS / SKIPPED_DATA
    if not path.exists():
        return []
    return [int(e["data_step"]) for e in json.loads(path.read_text(encoding="utf-8"))["skipped"]]


def scales_of(weights: list[float], global_weight: float) -> list[float]:
    """Each micro-batch's share of the step's loss weights: the replay's loss weighting."""
    return [w / global_weight if global_weight > 0 else 0.0 for w in weights]
