"""What a training run reports, in one place. The trainer and its components hand the `Reporter`
typed records (lmsys.core.rundir) once, and the reporter feeds its sinks:

    event                          console (rank 0)                 metrics.jsonl (rank 0)  W&B (rank 0)
    step_done(TrainRecord)         bar, or a line every interval    every step              every log_interval
    eval_done(EvalRecord, ...)     the validation line              always                  always
    checkpoint_saved(Checkpoint-   "saved checkpoint ... (stall;    always                  no
      Record)                      written in the background in)
    memory_measured(MemoryRecord)  the memory line                  always                  no
    note / warn                    the line                         -                       -
    close(exit_code)               -                                closed                  finished; loss.png

No sink spells a record's fields: the console formats the record, metrics.jsonl stores its line
(`Record.line`), W&B shows its numbers as <kind>/<field>. The metrics file and W&B open only once
the run directory is settled (`open`), on rank 0; before that, and on the other ranks, events
reach the console alone (which prints on rank 0 only).

W&B never blocks and never prompts: `online` needs WANDB_API_KEY in the environment and falls
back to `offline` with a warning otherwise (or when the service cannot be reached); its files
live in `<run_dir>/wandb`. The API key is never written anywhere by lmsys.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmsys.core.config import Config, LoggerConfig
from lmsys.core.console import Console
from lmsys.core.devices import device_name
from lmsys.core.rundir import (
    CheckpointRecord,
    EvalRecord,
    MemoryRecord,
    MetricsFile,
    Record,
    TrainRecord,
    read_all_records,
)
from lmsys.core.runtime import Setup
from lmsys.engine.zero import EngineInfo
from lmsys.training.plots import plot_losses


class Reporter:
    """The one place a training run reports through (module docstring)."""

    def __init__(self, console: Console, log_interval: int, plot: bool = True) -> None:
        self.console = console
        self.log_interval = log_interval
        self.plot = plot  # logger.plot: loss.png when the run closes
        self.metrics: MetricsFile | None = None
        self.wandb: WandbRun | None = None
        self.first_step: int | None = None  # of this launch
        self.max_steps = 0
        self.skipped_steps: list[int] = []  # of this launch: updates skipped (non-finite, overflow)

    @property
    def prog(self) -> str:
        return self.console.prog

    # -- sinks --------------------------------------------------------------------------------

    def open(
        self,
        run_dir: Path,
        logger: LoggerConfig,
        config: dict[str, Any],
        wandb_id: str | None,
        resumed_step: int,
    ) -> None:
        """Rank 0, once the run directory is settled: metrics.jsonl and W&B from now on. A resumed
        W&B run is sent the records kept from the attempts before (`WandbRun.replay`)."""
        self.metrics = MetricsFile(run_dir, resumed_step)
        if logger.wandb != "disabled":
            self.wandb = WandbRun.start(run_dir, logger, config, wandb_id, self.console.warn)
        if self.wandb is not None and resumed_step > 0:
            self.wandb.replay(read_all_records(run_dir), logger.log_interval)

    @property
    def wandb_id(self) -> str | None:
        return self.wandb.id if self.wandb is not None else None

    def wandb_line(self) -> str:
        """Where this run's W&B record is, and for an offline run how to upload it."""
        if self.wandb is not None:
            return self.wandb.line()
        return f"W&B: off (metrics in {self.metrics.path})" if self.metrics is not None else ""

    def _write(self, record: Record, to_wandb: bool) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
        if self.wandb is not None and to_wandb:
            self.wandb.log(record)

    # -- events -------------------------------------------------------------------------------

    def note(self, message: str) -> None:
        self.console.note(message)

    def warn(self, message: str) -> None:
        self.console.warn(message)

    def expect_evaluations(self, seconds: float | None) -> None:
        """The plan's time for one evaluation: the ETA's until the first is timed."""
        self.console.evaluation_estimate_s = seconds

    @contextmanager
    def steps(self, first: int, last: int, eval_interval: int | None = None) -> Iterator[None]:
        """The loop over steps first..last, evaluating every eval_interval steps and at the last:
        the progress bar is up while it runs."""
        self.first_step, self.max_steps = first, last
        self.console.eval_interval = eval_interval
        with self.console.progress(total=last, initial=first - 1):
            yield

    def step_done(self, record: TrainRecord) -> None:
        due = record.step % self.log_interval == 0 or record.step in (self.first_step, self.max_steps)
        if record.skipped:
            self.skipped_steps.append(record.step)
        self._write(record, to_wandb=due)
        self.console.step_done(record)

    def eval_done(self, record: EvalRecord, train_loss: float, coverage: str) -> None:
        self._write(record, to_wandb=True)
        self.console.eval_done(record, train_loss, coverage)

    def checkpoint_saved(self, record: CheckpointRecord, announce: bool = True) -> None:
        """A committed checkpoint: its record, and its line unless a stop line says it instead."""
        self._write(record, to_wandb=False)
        if not announce:
            return
        if not record.asynchronous:
            self.note(f"saved checkpoint {record.path} ({record.stall_s:.1f} s)")
            return
        waited = record.waited_s
        of_it = f", {waited:.2f} s of it waiting for the previous save" if waited >= 0.005 else ""
        self.note(
            f"saved checkpoint {record.path} (loop stalled {record.stall_s:.2f} s{of_it}; "
            f"written in the background in {record.write_s:.2f} s)"
        )

    def memory_measured(self, record: MemoryRecord, line: str | None) -> None:
        """Every rank's measured peak beside the prediction (rank 0), and its line when predicted."""
        self._write(record, to_wandb=False)
        if line is not None:
            self.note(line)

    def banner(
        self,
        cfg: Config,
        setup: Setup,
        info: EngineInfo,
        model: tuple[int, float],
        ready_s: float,
        start_step: int,
        run_dir: Path,
        coverage: str,
    ) -> None:
        """The launch's lines before its first step: the model (parameters, FLOPs per token), the
        batch, the engine (ready in `ready_s`), the steps to run and the validation."""
        batch, (n_params, flops_per_token) = setup.batch, model
        extras = [
            (info.activation_checkpointing, ", activation checkpointing"),
            (info.offload_optimizer, ", offload optimizer"),
            (info.offload_param, ", offload params"),
            (cfg.trainer.deterministic, ", deterministic"),
            (info.sequence_parallel > 1, f", Ulysses sequence parallel {info.sequence_parallel}"),
        ]
        first, last = start_step + 1, cfg.trainer.max_steps
        steps = f"steps {first}..{last}"
        if first > last:
            steps = f"no steps to run: the checkpoint is at step {start_step} (trainer.max_steps={last})"
        whole = "" if cfg.trainer.eval_batches == 0 else " (trainer.eval_batches=0 for the whole split)"
        for line in (
            f"model {cfg.model.name}: {n_params:,} parameters, {flops_per_token / 1e6:,.1f} MFLOP per token "
            f"(6N + 12LHdT at T={batch.seq_len})",
            f"{batch.arithmetic()} ({batch.global_batch_sequences} sequences)",
            f"ZeRO stage {info.stage}, world size {setup.world_size}, device {device_name(setup.device)}, "
            f"{setup.precision}, {info.optimizer}{''.join(text for on, text in extras if on)} "
            f"(ready in {ready_s:.1f} s)",
            f"{steps}, run directory {run_dir}",
            f"validation every {cfg.trainer.eval_interval} steps on {coverage}{whole}",
        ):
            self.note(line)

    def finish(
        self,
        losses: tuple[float | None, float | None, float | None],
        start_step: int,
        max_steps: int,
        elapsed_s: float,
        run_dir: Path,
        compiled: str | None,
    ) -> None:
        """The run is done: its final values in W&B's summary, the sinks closed, its last lines.
        losses: this launch's first and last training loss, and the last validation loss."""
        first_loss, last_loss, last_val = losses
        wandb_line = self.wandb_line()
        if self.wandb is not None:
            self.wandb.summary(
                {"final/loss": last_loss, "final/val_loss": last_val, "final/steps": max_steps}
            )
        self.close(run_dir=run_dir)
        if start_step >= max_steps:
            self.note(f"nothing to do: the checkpoint is already at trainer.max_steps={max_steps}")
        else:
            first = f"{first_loss:.4f}" if first_loss is not None else "n/a"
            last = f"{last_loss:.4f}" if first_loss is not None else "n/a"
            val = (
                ""
                if last_val is None
                else f", val loss {last_val:.4f} (ppl {math.exp(min(last_val, 80.0)):.1f})"
            )
            self.note(
                f"done: steps {start_step + 1}..{max_steps} in {elapsed_s:.1f} s"
                f"{skipped_clause(self.skipped_steps)}, loss {first} -> {last}{val}"
            )
        for line in (compiled, f"run directory: {run_dir.resolve()}", wandb_line):
            if line:
                self.note(line)

    def close(self, exit_code: int = 0, run_dir: Path | None = None) -> None:
        """Close metrics.jsonl and W&B (with the run's exit status) and draw loss.png (rank 0,
        logger.plot). Safe to call again: only the first call does anything."""
        if self.metrics is None:
            return
        self.metrics.close()
        self.metrics = None
        if self.wandb is not None:
            self.wandb.finish(exit_code, self.console.warn)
            self.wandb = None
        if run_dir is not None and self.plot:
            plot_losses(run_dir)


# ----------------------------------------------------------------------------- the W&B sink


class WandbRun:
    """A run's W&B record (rank 0). It shows the train and eval records, each number as
    <kind>/<field> against `step`."""

    SHOWN = (TrainRecord, EvalRecord)

    def __init__(self, run: Any, mode: str) -> None:
        self.run, self.mode = run, mode
        self.location = run.url if mode == "online" else str(run.settings.sync_dir)

    @classmethod
    def start(
        cls,
        run_dir: Path,
        lg: LoggerConfig,
        config: dict[str, Any],
        wandb_id: str | None,
        warn: Callable[[str], None],
    ) -> WandbRun | None:
        """A W&B run in run_dir/wandb, online or offline as logger.wandb says (offline when online
        cannot start), or None (with a warning) when W&B cannot start at all."""
        mode = lg.wandb
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            warn("logger.wandb=online but WANDB_API_KEY is not set; logging to W&B offline instead")
            mode = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_CONSOLE", "off")
        os.environ.setdefault("WANDB_DISABLE_CODE", "true")
        try:
            import wandb  # about a second to import: only runs that log to W&B pay it
        except ImportError:
            warn("wandb is not installed; logging to metrics.jsonl only")
            return None

        def init(m: str) -> Any:
            settings = wandb.Settings(
                console="off", silent=True, save_code=False, x_save_requirements=False, init_timeout=60.0
            )
            return wandb.init(
                project=lg.project,
                entity=lg.entity,
                group=lg.group,
                tags=list(lg.tags) or None,
                name=run_dir.name,
                id=wandb_id,
                resume="allow" if wandb_id else None,
                dir=str(run_dir),
                mode=m,
                config=config,
                settings=settings,
            )

        try:
            run = init(mode)
        except Exception as exc:  # no network, bad key, service start failure
            if mode != "online":
                warn(f"W&B could not start ({type(exc).__name__}: {exc}); logging to metrics.jsonl only")
                return None
            warn(f"W&B online could not start ({type(exc).__name__}); logging to W&B offline instead")
            try:
                run, mode = init("offline"), "offline"
            except Exception as exc2:
                warn(f"W&B could not start ({type(exc2).__name__}: {exc2}); logging to metrics.jsonl only")
                return None
        for kind in cls.SHOWN:
            run.define_metric(f"{kind.KIND}/*", step_metric="step")
        return cls(run, mode)

    @property
    def id(self) -> str:
        return self.run.id

    def log(self, record: Record) -> None:
        data = {f"{record.KIND}/{k}": v for k, v in record.fields().items() if isinstance(v, (int, float))}
        data["step"] = record.step
        self.run.log(data, step=record.step)

    def replay(self, records: Sequence[Record], log_interval: int) -> None:
        """Send the records kept from earlier attempts (steps up to the resumed checkpoint) to the
        resumed W&B run. An offline attempt writes its own file, and one killed with -9 leaves
        only what W&B had flushed (often nothing), so without this the run's W&B history would
        start at the resumed step. Steps the W&B run already holds (below `run.starting_step`:
        what the server has online, nothing offline) are not sent again. Train records follow
        the usual cadence (every `log_interval`-th step and the first); eval records all go."""
        held = int(getattr(self.run, "starting_step", 0) or 0)
        for record in records:
            if record.step < held or not isinstance(record, self.SHOWN):
                continue
            if isinstance(record, EvalRecord) or record.step % log_interval == 0 or record.step == 1:
                self.log(record)

    def line(self) -> str:
        if self.mode == "online":
            return f"W&B: online run {self.location}"
        return f"W&B: offline run in {self.location}; upload it with: wandb sync {self.location}"

    def summary(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            self.run.summary[k] = v

    def finish(self, exit_code: int, warn: Callable[[str], None]) -> None:
        try:
            self.run.finish(exit_code=exit_code)
        except Exception as exc:  # never fail a finished training run on logging
            warn(f"W&B finish failed: {type(exc).__name__}: {exc}")


def skipped_clause(steps: list[int], shown: int = 5) -> str:
    """`, 2 updates skipped (steps 4, 9)` for the done line; nothing when none was."""
    if not steps:
        return ""
    named = ", ".join(map(str, steps[:shown])) + (", ..." if len(steps) > shown else "")
    plural = "s" if len(steps) > 1 else ""
    return f", {len(steps)} update{plural} skipped (step{plural} {named})"
