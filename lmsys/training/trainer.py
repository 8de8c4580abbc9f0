"""The trainer: one training run on one rank, from the prepared data and the process group to the
last checkpoint; lmsys-train (lmsys/train.py) calls `train(cfg)` on every rank.

Every rank composes the same config; rank 0 picks the run directory (trainer.run_dir, or
runs/<model.name>-<timestamp>) after the process group is up and broadcasts it, so all ranks
share ONE directory (lmsys/engine/rundir.py). A plain run composes its config once, without Hydra's
app; `-m` and Hydra's other flags go through Hydra (which writes nothing: conf/config.yaml has no
output subdir, no log files, run dir ".").

One optimizer step (`Trainer.train_step`): the loader's `grad_accum` micro-batches on every rank
(together the same set of sequences whatever the world size), a forward/backward each through
the engine, one optimizer step. Each micro-batch's loss is weighted by its share of the step's
loss weights, so the gradient is that of the step's global weighted mean loss for any split into
ranks and micro-batches. A step whose loss or gradient norm is non-finite, or whose loss diverges,
is replayed to find where it came from, reported, and skipped, stopped at or rewound from as
trainer.on_nonfinite says (lmsys/training/health.py), at most trainer.max_nan_skips times.
Checkpoints: lmsys/engine/checkpoint.py; trainer.resume=auto continues
from the newest complete one, on any world size and ZeRO stage that splits the global batch
(lmsys/engine/reshard.py). SIGTERM / SIGUSR1 (preemption) and Ctrl-C stop the run after the step under
way, with a checkpoint of it, every rank at the same step (lmsys/training/stopping.py): exit 75 or 130.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from lmsys.core.config import Config, config_to_dict
from lmsys.core.console import Console, StepReport, warn
from lmsys.core.errors import EXIT_INTERRUPTED, EXIT_REQUEUE, Stopped, TrainingError
from lmsys.core.runtime import DTYPES, Setup, batch_plan, env_dist_info, oversubscription, seed_everything
from lmsys.data.loader import Batch, TokenLoader
from lmsys.data.shards import PreparedData
from lmsys.engine import checkpoint as ckpt
from lmsys.engine import rundir
from lmsys.engine import zero as eng
from lmsys.engine.quiet import ops_to_build
from lmsys.engine.run_tokenizer import keep_tokenizer
from lmsys.interop.exports import initial_model
from lmsys.model.compiling import compile_errors, compile_stats, compile_summary, say_compiled
from lmsys.model.selfcheck import check_kernels, settle
from lmsys.model.transformer import Transformer, next_token_pairs
from lmsys.training.faults import Faults
from lmsys.training.health import Event, Health, StepData, scales_of
from lmsys.training.metrics import MetricsLogger, TensorPeak, device_name, device_peak_flops, memory_gb, mfu
from lmsys.training.planning import Plan, measured_peak_bytes, rss_bytes
from lmsys.training.preflight import preflight
from lmsys.training.reporter import Reporter
from lmsys.training.run_plan import (
    RunPlan,
    agree_on_run,
    elastic_ids,
    schedule_horizon,
    start_processes,
)
from lmsys.training.saving import Saves
from lmsys.training.stopping import StopRequest, continue_command
from lmsys.training.watchdog import Watchdog

PROG = "lmsys-train"


# ----------------------------------------------------------------------------- the trainer


@dataclass
class StepResult:
    step: int
    loss: float  # the step's global weighted mean loss
    lr: float
    outcome: eng.StepOutcome
    seconds: float
    stop: str | None = None  # "preempted" | "interrupted": a rank was signalled to stop after this step
    event: Event | None = None  # the step's loss or gradient was non-finite, or its loss diverged


class Trainer:
    """One training run on this rank: the engine, the loader, the train state, what is logged."""

    def __init__(
        self,
        cfg: Config,
        setup: Setup,
        data: PreparedData,
        run: RunPlan,
        console: Console,
        memory: Plan | None = None,  # the preflight's prediction (trainer.plan)
    ):
        t, plan = cfg.trainer, setup.plan
        # torch._dynamo is imported by every torch optimizer (its first param group): imported
        # before the baseline, its ~100 MB of code count as the process's, not as the run's peak
        import torch._dynamo  # noqa: F401

        self.memory, self.baseline_rss = memory, rss_bytes()  # before the model: lmsys.training.planning
        traced = t.trace_memory and setup.device.type == "cpu"
        self.memory_trace = TensorPeak() if traced else None  # until the second applied step
        cfg = replace(cfg, optim=replace(cfg.optim, decay_steps=schedule_horizon(cfg, run.resume)))
        self.cfg, self.setup, self.run_dir, self.console = cfg, setup, run.run_dir, console
        self.report = Reporter(console, cfg.logger.log_interval, cfg.logger.plot)
        self.faults = Faults.of(t, setup.rank, setup.world_size, restarts=elastic_ids()[1])
        seed_everything(t.seed)  # identical initialisation on every rank
        # each Triton kernel the run uses against its torch reference on this device (own RNG)
        self.kernel_check = check_kernels(
            cfg.model, plan.seq_len, setup.device, DTYPES[setup.precision], self.faults.break_kernel
        )
        settle(self.kernel_check, cfg.model.kernels, self.report.warn)
        model = self._first_model(data, run)
        self.n_params = model.num_parameters()
        self.flops_per_token = model.flops_per_token(plan.seq_len)
        self.peak_flops = device_peak_flops(setup.device)  # per device; None on CPU: no MFU
        started = time.perf_counter()
        self.engine, self.engine_info, self.ds_json = eng.initialize(
            model, cfg, plan, setup.device, setup.precision
        )
        self.engine_seconds = time.perf_counter() - started
        self.faults.arm(self.engine.module.model)
        self.health = Health(cfg, setup, run.run_dir, self.report, self.faults)
        self.saves = Saves(  # every rank, here: asynchronous saves form a process group of their own
            t.async_save,
            run.run_dir,
            setup.rank,
            setup.world_size,
            t.keep_last,
            self.report,
            t.dist_timeout_s,
            pin=setup.device.type == "cuda",
            pause_s=self.faults.save_pause_s,
        )
        # dynamo's counters are process-wide (a sweep's jobs share a process): this run counts from here
        self.compile_start = compile_stats() if self.engine_info.compiled else None
        self.loader = TokenLoader(
            data,
            "train",
            tokens_per_sample=plan.tokens_per_sample,
            global_batch_size=plan.global_batch_sequences,
            micro_batch_size=plan.micro_batch_size,
            rank=setup.rank,
            world_size=setup.world_size,
            seed=t.seed,
            mask_doc_boundaries=cfg.data.mask_doc_boundaries,
            document_masking=cfg.data.document_masking,
        )
        self.state = ckpt.TrainState(
            step=0,
            tokens_seen=0,
            nan_skips=0,
            last_loss=None,
            world_size=setup.world_size,
            zero_stage=cfg.deepspeed.stage,
            precision=setup.precision,
            tokenizer_sha256=data.tokenizer_sha256,
            wandb_id=None,
            config=config_to_dict(cfg),
        )
        self.resumed, self.damaged = run.resume, run.damaged
        self.stop = StopRequest()  # train() installs its signal handlers
        if run.resume is not None:
            self._resume(run.resume)
        self.start_step = self.state.step
        self.first_loss: float | None = None  # of this launch
        self.last_val: float | None = None
        self.saved_step = self.start_step if run.resume is not None else -1
        self.stats_written, self.applied_steps = False, 0
        self.watchdog = Watchdog(  # the loop reports where it is; fit() starts the thread
            t.hang_timeout_s,
            setup.rank,
            setup.world_size,
            self.run_dir,
            console.prog,
            self.report.warn,
            self._resume_hint,
        )

    def _resume_hint(self) -> str:
        """For the stuck-rank line: the newest checkpoint on disk, committed (an asynchronous save
        still in flight may never be)."""
        committed = [
            step
            for step, path in ckpt.list_checkpoints(self.run_dir / rundir.CHECKPOINTS)
            if (path / ckpt.MARKER).is_file()
        ]
        if not committed:
            return "; no checkpoint was saved yet"
        return f"; trainer.resume=auto continues from the checkpoint of step {committed[0]}"

    def _first_model(self, data: PreparedData, run: RunPlan) -> Transformer:
        """A new model, or with model.init_from the export's weights (unless the run resumes:
        then the checkpoint's weights win), before the engine wraps it."""
        init_from = self.cfg.model.init_from
        if init_from and run.resume is None:
            self.report.note(f"starting from the weights of model.init_from={init_from}")
            return initial_model(init_from, self.cfg.model, data.tokenizer_sha256)
        if init_from:
            self.report.note(f"resuming {run.resume.tag_dir}: model.init_from={init_from} is ignored")
        return Transformer(self.cfg.model)

    def _load(self, found: ckpt.Checkpoint) -> None:
        """The engine, loader, RNG and train state of a checkpoint (a resume, a rewind)."""
        setup, stage = self.setup, self.cfg.deepspeed.stage
        ckpt.load(self.engine, found, setup.world_size, stage, setup.precision)
        rank_state = ckpt.read_rank_state(found, setup.rank, setup.world_size)
        self.loader.load_state_dict(rank_state["loader"])
        self.loader.skip_steps(self.health.skipped)  # data a rewind left out after this checkpoint
        ckpt.set_rng_state(rank_state["rng"])
        saved = found.state
        self.state = replace(
            self.state,
            step=saved.step,
            tokens_seen=saved.tokens_seen,
            nan_skips=saved.nan_skips,
            last_loss=saved.last_loss,
            wandb_id=saved.wandb_id,
        )

    def _resume(self, found: ckpt.Checkpoint) -> None:
        setup, stage, saved = self.setup, self.cfg.deepspeed.stage, found.state
        self._load(found)
        how = ""
        if not ckpt.same_layout(saved, setup.world_size, stage, setup.precision):
            how = (
                f"; resharded from ZeRO-{saved.zero_stage} on {saved.world_size} rank(s), {saved.precision}, "
                f"to ZeRO-{stage} on {setup.world_size}, {setup.precision}"
            )
        self.report.note(f"resumed from {found.tag_dir} (step {saved.step}{how})")
        if self.health.skipped:
            skipped = len(self.health.skipped)
            self.report.note(f"never training on the data of {skipped} step(s) a rewind skipped")
        self._say_extension(saved)

    def _say_extension(self, saved: ckpt.TrainState) -> None:
        """What a resume continues: the rest of the run, or more steps than it was started with."""
        before = int(saved.config["trainer"]["max_steps"])
        now, horizon = self.cfg.trainer.max_steps, self.cfg.optim.decay_steps
        if now <= saved.step or now == before:
            return
        if now < before:
            self.report.note(f"trainer.max_steps lowered from {before} to {now}")
            return
        if horizon >= now:
            plan = f"its cosine ends at step {horizon} (optim.decay_steps)"
        else:
            floor = self.cfg.optim.lr * self.cfg.optim.min_lr_ratio
            plan = (
                f"the learning rate keeps its schedule: cosine to step {horizon}, then {floor:.2e} to "
                f"the end (optim.decay_steps={now} stretches the cosine over all {now} steps)"
            )
        self.report.note(f"trainer.max_steps extended from {before} to {now}; {plan}")

    def open_run_dir(self) -> None:
        """Only now, with the checkpoint and loader state accepted, does the run directory change
        (a refused resume leaves it as it was): run files, the metrics logger, the banner."""
        cfg, setup = self.cfg, self.setup
        if setup.rank == 0:
            run_id, restarts = elastic_ids()
            launch = {
                "resumed_from": str(self.resumed.tag_dir) if self.resumed else None,
                "init_from": str(Path(cfg.model.init_from).resolve())
                if cfg.model.init_from and not self.resumed
                else None,
                "torchelastic_restart": restarts,
                "world_size": setup.world_size,
                "device": str(setup.device),
            }
            for path in self.damaged:  # found by the resume; kept for inspection, out of every listing
                moved = ckpt.move_aside(path)
                self.report.warn(f"moved the damaged checkpoint {path.name} to {moved}")
            config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
            rundir.record_launch(self.run_dir, config_yaml, launch, run_id)
            keep_tokenizer(self.run_dir, self.loader.data.tokenizer_path, self.state.tokenizer_sha256)
            rundir.write_json(self.run_dir, rundir.DEEPSPEED_FILE, self.ds_json)
            self.report.open(
                lambda warn: MetricsLogger(
                    self.run_dir,
                    cfg.logger,
                    self.state.config,
                    self.run_dir.name,
                    self.state.wandb_id,
                    self.start_step,
                    warn,
                )
            )
            self.state.wandb_id = self.report.wandb_id
        dist.barrier()
        self._banner()

    def _banner(self) -> None:
        cfg, setup, info = self.cfg, self.setup, self.engine_info
        extras = [
            (info.activation_checkpointing, ", activation checkpointing"),
            (info.offload_optimizer, ", offload optimizer"),
            (info.offload_param, ", offload params"),
            (cfg.trainer.deterministic, ", deterministic"),
        ]
        prog = self.console.prog
        self.console.say(
            f"{prog}: model {cfg.model.name}: {self.n_params:,} parameters, "
            f"{self.flops_per_token / 1e6:,.1f} MFLOP per token "
            f"(6N + 12LHdT at T={setup.plan.seq_len})\n"
            f"{prog}: {setup.plan.arithmetic()} ({setup.plan.global_batch_sequences} sequences)\n"
            f"{prog}: ZeRO stage {info.stage}, world size {setup.world_size}, "
            f"device {device_name(setup.device)}, {setup.precision}, {info.optimizer}"
            + "".join(text for on, text in extras if on)
            + f" (ready in {self.engine_seconds:.1f} s)"
            + f"\n{prog}: {self._steps_planned()}, run directory {self.run_dir}"
            + f"\n{prog}: validation every {cfg.trainer.eval_interval} steps on {self.val_coverage()}"
            + ("" if cfg.trainer.eval_batches == 0 else " (trainer.eval_batches=0 for the whole split)")
        )
        if self.kernel_check.passed or self.kernel_check.failed:
            self.console.say(f"{prog}: {self.kernel_check.line()}")
        if self.memory is not None:
            self.report.note(self.memory.startup_line())
        if self.report.wandb_line():
            self.report.note(self.report.wandb_line())

    def _steps_planned(self) -> str:
        first, last = self.start_step + 1, self.cfg.trainer.max_steps
        if first > last:
            return f"no steps to run: the checkpoint is at step {self.start_step} (trainer.max_steps={last})"
        return f"steps {first}..{last}"

    # -- one optimizer step -------------------------------------------------------------------

    def _prediction_weight(self, batch: Batch) -> float:
        """The sum of the loss weights the model's objective uses for this micro-batch."""
        _, _, weights = next_token_pairs(self.cfg.model, batch.tokens, batch.weights, batch.documents)
        assert weights is not None
        return float(weights.sum().item())

    def _global_weight(self, weights: list[float], loader_step: int) -> float:
        """The loss weights of the whole step, over every rank's micro-batches."""
        plan = self.setup.plan
        # When every weight is 1 (no stored weights, no document masking of either kind, not the
        # split's last, partly weighted sample) the total is known without a collective (and its sync).
        if self.loader.uniform_weights(loader_step):
            return float(plan.global_batch_sequences * plan.seq_len)
        total = torch.tensor([sum(weights)], dtype=torch.float64, device=self.setup.device)
        dist.all_reduce(total)
        return total.item()

    def train_step(self, step: int) -> StepResult:
        """Optimizer step `step` (1-based): forward/backward every micro-batch of this rank, each
        scaled by its share of the step's loss weights, then the update (skipped for a non-finite
        loss). Returns the step's global weighted mean loss."""
        start = time.perf_counter()
        engine, plan, device = self.engine, self.setup.plan, self.setup.device
        self.stop.begin_step(step)  # Ctrl-C's acknowledgement names it
        at = self.watchdog.at
        at(step, "start")
        self.faults.before_step(step, before_hang=self.saves.wait)
        lr = eng.lr_at(step, self.cfg.optim, self.cfg.trainer.max_steps)
        eng.set_lr(engine, lr)
        loader_step = self.loader.step
        batches = [self.loader.next_batch() for _ in range(plan.grad_accum)]
        weights = [self._prediction_weight(b) for b in batches]
        global_weight = self._global_weight(weights, loader_step)
        micro_batches = plan.grad_accum * self.setup.world_size
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # (weighted loss, preempt, interrupt)
        for i, batch in enumerate(batches):
            at(step, "forward", i)
            on_device = batch.to(device, non_blocking=True)
            loss = engine(on_device.tokens, on_device.weights, on_device.documents)
            loss = self.faults.poison_loss(step, i, loss)
            totals[0] += loss.detach().double() * weights[i]
            # DeepSpeed averages the micro-batch gradients of all ranks: scaling each by its share
            # of the step's weights times their count makes that average the weighted mean's.
            scale = weights[i] * micro_batches / global_weight if global_weight > 0 else 0.0
            at(step, "backward", i)
            engine.backward(loss if scale == 1.0 else loss * scale)
            if i < plan.grad_accum - 1:
                engine.step()  # not a boundary: DeepSpeed only counts the micro-step
        totals[1], totals[2] = self.stop.flags()  # read as late as possible; summed over the ranks
        at(step, "loss all-reduce")
        dist.all_reduce(totals)
        weighted_loss, preempt, interrupt = totals.tolist()
        step_loss = weighted_loss / global_weight if global_weight > 0 else 0.0
        # A bad step is replayed before its update, on the weights it ran with (health.py).
        seen = StepData(step, loader_step, batches, scales_of(weights, global_weight), step_loss)
        event = self.health.investigate(engine, self.loader, seen, self.health.verdict(step_loss))
        at(step, "optimizer step")
        outcome = eng.optimizer_step(engine, math.isfinite(step_loss))
        if event is None:
            after = self.health.after_update(step_loss, outcome.grad_norm, outcome.applied)
            event = self.health.investigate(engine, self.loader, seen, after, outcome.grad_norm)
        self.faults.after_update(engine.module.model)
        stop = "interrupted" if interrupt else "preempted" if preempt else None
        return StepResult(step, step_loss, lr, outcome, time.perf_counter() - start, stop, event)

    # -- around the step ------------------------------------------------------------------------

    def record(self, result: StepResult, elapsed_s: float) -> None:
        """Account for a finished step: the train state, warnings, engine stats, the metrics."""
        t, plan = self.cfg.trainer, self.setup.plan
        state = self.state
        state.step = result.step
        state.tokens_seen += plan.tokens_per_step
        if result.event is not None:
            state.nan_skips += 1
        elif not result.outcome.applied:
            self.report.warn(f"step {result.step}: gradient overflow; the update was skipped")
        else:
            state.last_loss = result.loss
            self.first_loss = result.loss if self.first_loss is None else self.first_loss
        self.applied_steps += result.outcome.applied
        # the peak of the second applied step: the first runs its forward and backward before
        # the optimizer's state exists, every later one beside it (or the launch's last step)
        measure_now = self.applied_steps == 2 or (self.applied_steps and result.step >= t.max_steps)
        if measure_now and not self.stats_written:
            self._write_engine_stats()
        if self.engine_info.compiled and result.step == self.start_step + 1:
            say_compiled(self.console, compile_stats(self.compile_start), "training", result.seconds)
        tokens_per_s = plan.tokens_per_step / result.seconds
        self.report.step_done(
            StepReport(
                step=result.step,
                max_steps=t.max_steps,
                loss=result.loss,
                lr=result.lr,
                grad_norm=result.outcome.grad_norm,
                tokens_per_s=tokens_per_s,
                mfu=mfu(self.flops_per_token, tokens_per_s, self.peak_flops, plan.world_size),
                elapsed_s=elapsed_s,
                steps_done=result.step - self.start_step,
                step_time_s=result.seconds,
                memory_gb=memory_gb(self.setup.device),
                tokens=state.tokens_seen,
                skipped=not result.outcome.applied,
            )
        )
        if result.event is not None:
            self.health.settle(result.event, result.outcome.applied)  # raises to stop the run

    def _write_engine_stats(self) -> None:
        """What each rank holds and its measured peak (after the second applied step, see record)."""
        self.stats_written = True
        gathered: list[dict[str, int] | None] = [None] * self.setup.world_size
        measured = measured_peak_bytes(self.setup.device, self.baseline_rss, self.memory_trace)
        self.memory_trace = None
        mine = {**eng.shard_stats(self.engine), "measured_peak_bytes": measured.bytes}
        mine["measured_peak_unconfirmed_bytes"] = measured.unconfirmed
        dist.all_gather_object(gathered, mine)
        if self.setup.rank == 0:
            stats = {"engine": self.engine_info.as_dict(), "ranks": gathered}
            rundir.write_json(self.run_dir, rundir.ENGINE_STATS_FILE, stats)
            ranks = [r for r in gathered if r is not None]
            self.report.memory_measured(self.state.step, self.memory, ranks, measured)

    def val_coverage(self) -> str:
        """`all 240 val sequences` or `224 of 240 val sequences`."""
        covered, total = self.loader.val_coverage(self.cfg.trainer.eval_batches)
        return f"all {total} val sequences" if covered == total else f"{covered} of {total} val sequences"

    def evaluate(self) -> float:
        """The weighted mean loss on trainer.eval_batches validation micro-batches of every rank
        (0: the whole validation split)."""
        engine, device = self.engine, self.setup.device
        engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)  # (weighted loss, weight)
        with torch.no_grad():
            for i, batch in enumerate(self.loader.val_batches(self.cfg.trainer.eval_batches)):
                self.watchdog.at(self.state.step, "evaluation", i)
                weight = self._prediction_weight(batch)
                on_device = batch.to(device)
                loss = engine(on_device.tokens, on_device.weights, on_device.documents)  # every rank runs it
                if weight > 0:  # the whole split's last round may hold only weight-0 filler rows
                    total[0] += loss.double() * weight
                    total[1] += weight
        dist.all_reduce(total)
        engine.train()
        return (total[0] / total[1]).item() if total[1].item() > 0 else float("nan")

    def evaluate_and_log(self, step: int, train_loss: float) -> None:
        self.last_val = self.evaluate()
        self.report.eval_done(step, train_loss, self.last_val, self.val_coverage())

    def save(self, announce: bool = True) -> Path:
        """A checkpoint of the step just finished (lmsys/engine/checkpoint.py); every rank calls it."""
        rank_state = {"loader": self.loader.state_dict(), "rng": ckpt.rng_state()}
        self.watchdog.at(self.state.step, "checkpoint save")
        saved = self.saves.save(self.engine, self.state, rank_state, announce)  # trainer.async_save
        self.saved_step = self.state.step
        return saved

    # -- the run ---------------------------------------------------------------------------------

    def fit(self, step_hook: Callable[[int], None] | None = None) -> None:
        """Every step from the checkpoint's to trainer.max_steps, evaluating and saving on their
        intervals and at the end. step_hook(step) runs after each step's logging, evaluation and
        checkpoint (lmsys.bench train interleaves a plain loop's steps with lmsys's through it).
        A stop request (`StopRequest`) ends the run after the step every rank learns of it in:
        `_stop` saves that step and raises Stopped."""
        t = self.cfg.trainer
        started = time.perf_counter()
        self.engine.train()
        self.stop.armed = True
        stop: str | None = None
        if t.hang_timeout_s > 0:
            self.watchdog.start(self.start_step)
        try:
            with self.report.steps(self.start_step + 1, t.max_steps):
                step = self.start_step
                while step < t.max_steps:
                    step += 1
                    result = self._first_step(step) if step == self.start_step + 1 else self.train_step(step)
                    self.record(result, time.perf_counter() - started)
                    self.saves.poll()  # a save in the background: reported once committed
                    if result.event is not None and self.health.policy == "rewind":
                        step = self._rewind(result.event)
                        continue
                    if step % t.eval_interval == 0 or step == t.max_steps:
                        self.evaluate_and_log(step, result.loss)
                    if step % t.save_interval == 0 or step == t.max_steps:
                        self.save()
                    if result.stop is not None and step < t.max_steps:
                        stop = result.stop
                        break
                    if step_hook is not None:
                        step_hook(step)
                    self.faults.after_step(step, self.report.prog, before_exit=self.saves.wait)
            if stop is not None:
                self._stop(stop)  # saves the step (with the bar down) and raises Stopped
            if self.saved_step != t.max_steps and self.start_step < t.max_steps:
                self.save()
            self.saves.wait()
        except BaseException as exc:
            self._settle_save(exc)
            self.report.close(exit_code=exc.exit_code if isinstance(exc, Stopped) else 1)
            raise
        finally:
            self.watchdog.stop()
        self._finish(time.perf_counter() - started)

    def _rewind(self, event: Event) -> int:
        """trainer.on_nonfinite=rewind: back to the last intact checkpoint, never to train on the
        event's data again. Returns the checkpoint's step."""
        self.saves.wait()  # a checkpoint still being written is the one to go back to
        found = ckpt.find_latest(self.run_dir, self.report.warn)
        if found is None:
            raise TrainingError(
                f"step {event.step}: {event.what}; trainer.on_nonfinite=rewind has no checkpoint to go "
                f"back to in {self.run_dir / rundir.CHECKPOINTS} (report: {event.report})"
            )
        self.health.skip_data(event, self.loader, found.state.step)
        self._load(found)
        self.saved_step = found.state.step
        return found.state.step

    def _first_step(self, step: int) -> StepResult:
        """The launch's first step: under trainer.compile=true a compile failure is one error line."""
        if not self.engine_info.compile_strict:
            return self.train_step(step)
        with compile_errors("trainer.compile", "trainer.compile=false trains eager"):
            return self.train_step(step)

    def _settle_save(self, exc: BaseException) -> None:
        """A failing run and its save in flight: after a training error every rank agreed on,
        finish it (it is a good checkpoint); after a second Ctrl-C abandon it (never committed);
        after anything else (a lost rank) give it 30 s, then abandon it."""
        if isinstance(exc, KeyboardInterrupt):  # a second Ctrl-C: out now
            self.saves.abandon()
            return
        try:  # a lost rank: a save whose files were all written still commits, in moments
            self.saves.wait(None if isinstance(exc, (TrainingError, Stopped)) else 30.0)
        except Exception as failed:  # the run's own error is the one to report
            self.report.warn(f"the checkpoint being written was not committed: {failed}")

    def _stop(self, why: str) -> None:
        """Save the step every rank has just finished (unless its periodic save did), say so in
        one line, and raise Stopped with the exit status for the launcher."""
        step = self.state.step
        command = continue_command(self.run_dir, self.cfg.trainer.resume)
        if why == "interrupted":
            head, code, then = "interrupted", EXIT_INTERRUPTED, f"continue with: {command}"
        else:
            head, code = f"preempted ({self.stop.name() or 'a signal to another rank'})", EXIT_REQUEUE
            then = f"exit {EXIT_REQUEUE}: requeue the job, or continue with: {command}"
        self.saves.wait()  # the previous save, reported before the stop line
        self.console.status(f"{self.report.prog}: {head}: saving step {step} ...", end="")
        try:
            path = self.run_dir / rundir.CHECKPOINTS / ckpt.tag_for(step)
            if self.saved_step != step:
                path = self.save(announce=False)  # the stop line says it
            self.saves.wait()
        except BaseException:
            self.console.status(" not saved")
            raise
        self.console.status(f" saved {path}; {then}")
        self.report.close(exit_code=code, run_dir=self.run_dir)
        dist.barrier()  # leave together: a launcher stops the other ranks when the first one exits
        raise Stopped(f"stopped after step {step}", code)

    def _finish(self, elapsed: float) -> None:
        t = self.cfg.trainer
        wandb_line = self.report.wandb_line()
        self.report.summary(
            {"final/loss": self.state.last_loss, "final/val_loss": self.last_val, "final/steps": t.max_steps}
        )
        self.report.close(run_dir=self.run_dir)
        if self.start_step >= t.max_steps:
            self.report.note(f"nothing to do: the checkpoint is already at trainer.max_steps={t.max_steps}")
        else:
            first = f"{self.first_loss:.4f}" if self.first_loss is not None else "n/a"
            last = f"{self.state.last_loss:.4f}" if self.first_loss is not None else "n/a"
            val = ""
            if self.last_val is not None:
                val = f", val loss {self.last_val:.4f} (ppl {math.exp(min(self.last_val, 80.0)):.1f})"
            self.report.note(
                f"done: steps {self.start_step + 1}..{t.max_steps} in {elapsed:.1f} s, "
                f"loss {first} -> {last}{val}"
            )
        if self.engine_info.compiled:
            graphs = "the training step; evaluation, without gradients, has its own"
            self.report.note(compile_summary(compile_stats(self.compile_start), graphs))
        self.report.note(f"run directory: {self.run_dir.resolve()}")
        if wandb_line:
            self.report.note(wandb_line)
        self.saves.close()
        dist.barrier()


def train(cfg: Config, step_hook: Callable[[int], None] | None = None) -> Path:
    """Train according to `cfg` (validated). Every rank calls this. Returns the run directory.

    step_hook(step), if given, runs at the end of every step (see `Trainer.fit`)."""
    stop = StopRequest()  # from now on SIGTERM / SIGUSR1 stop the run after a step, with a checkpoint
    stop.install()
    run: RunPlan | None = None
    try:
        # every mistake in the batch or the data is reported before the process group forms
        checked = preflight(cfg, env_dist_info().world_size, warn=lambda message: warn(PROG, message))
        data = checked.data
        assert data is not None
        rank = int(os.environ.get("RANK", "0"))  # torchrun's; the process group forms below
        console = Console(PROG, rank, cfg.trainer.progress, cfg.logger.console_interval)
        cuda = torch.cuda.is_available() and cfg.trainer.device != "cpu"
        builds = " (this first run on the machine builds DeepSpeed's ops: a minute or two)"
        console.say(
            f"{PROG}: starting: process group, model, DeepSpeed engine"
            + (
                builds
                if ops_to_build(torch.device("cuda" if cuda else "cpu"), cfg.deepspeed.offload_optimizer)
                else ""
            )
        )
        device, precision = start_processes(cfg)
        rank, world = dist.get_rank(), dist.get_world_size()
        run = agree_on_run(cfg, rank, world, data.tokenizer_sha256, console)  # a resume's batch check first
        crowded = oversubscription(device)
        if crowded:
            console.warn(crowded)
        setup = Setup(device, precision, rank, world, batch_plan(cfg, world))
        try:
            trainer = Trainer(cfg, setup, data, run, console, checked.memory)
        except BaseException:
            if run.lock is not None:  # refused before writing (e.g. model.init_from): no trace left
                run.lock.release_untouched()
            raise
        trainer.stop = stop
        trainer.open_run_dir()
        trainer.fit(step_hook)
    finally:
        stop.restore()
        if run is not None and run.lock is not None:
            run.lock.release()  # a sweep's next job in this process may need it
    return run.run_dir
