"""The trainer: one training run on one rank, from the prepared data and the process group to the
last checkpoint; lmsys-train (lmsys/train.py) calls `train(cfg)` on every rank.

Every rank composes the same config; rank 0 settles the run directory (trainer.run_dir, or
runs/<model.name>-<timestamp>) and the checkpoint it continues, and every rank receives them
(lmsys/training/preflight.py). One optimizer step (`Trainer.train_step`): the loader's `grad_accum`
micro-batches on every rank (together the same sequences whatever the world size), a
forward/backward each through the engine, one optimizer step. Each micro-batch's loss is weighted
by its share of the step's loss weights, so the gradient is that of the step's global weighted
mean loss for any split into ranks and micro-batches. The run's other parts are components that
`train()` registers and the loop calls (lmsys/training/components.py): fault injection, the hang
watchdog, the memory measurement, a bad step's health checks, the checkpoint saves. A signal
(SIGTERM / SIGUSR1, Ctrl-C) stops the run after the step under way, with a checkpoint of it,
every rank at the same step (lmsys/training/stopping.py): exit 75 or 130.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from lmsys.core import rundir
from lmsys.core.config import Config
from lmsys.core.devices import device_peak_flops, mfu
from lmsys.core.errors import Stopped
from lmsys.core.rundir import EvalRecord, TrainRecord
from lmsys.core.runtime import DTYPES, Setup, seed_everything
from lmsys.data.loader import Batch
from lmsys.data.shards import PreparedData
from lmsys.engine import checkpoint as ckpt
from lmsys.engine import zero as eng
from lmsys.engine.run_tokenizer import keep_tokenizer
from lmsys.model.compiling import compile_errors, compile_stats, compile_summary, say_compiled
from lmsys.model.selfcheck import check_kernels, settle
from lmsys.model.transformer import next_token_pairs
from lmsys.training.components import Component, Components, Step
from lmsys.training.peak_memory import memory_gb
from lmsys.training.preflight import (
    StartingPoint,
    elastic_ids,
    first_model,
    new_train_state,
    resume_notes,
    schedule_horizon,
    train_loader,
)
from lmsys.training.reporter import Reporter
from lmsys.training.saving import Saves
from lmsys.training.stopping import StopRequest

PROG = "lmsys-train"


class Trainer:
    """One training run on this rank: the engine, the loader, the train state and the loop, which
    the components registered by `train()` hook into."""

    def __init__(
        self,
        cfg: Config,
        setup: Setup,
        data: PreparedData,
        start: StartingPoint,
        report: Reporter,
        stop: StopRequest,  # its signal handlers installed by train()
    ) -> None:
        t, batch = cfg.trainer, setup.batch
        cfg = replace(cfg, optim=replace(cfg.optim, decay_steps=schedule_horizon(cfg, start.resume)))
        self.cfg, self.setup, self.start, self.run_dir, self.report = cfg, setup, start, start.run_dir, report
        self.stop = stop
        seed_everything(t.seed)  # identical initialisation on every rank
        # each Triton kernel the run uses against its torch reference on this device (own RNG)
        self.kernel_check = check_kernels(
            cfg.model, batch.seq_len, setup.device, DTYPES[setup.precision], cfg.debug.break_kernel
        )
        settle(self.kernel_check, cfg.model.kernels, report.warn)
        model = first_model(cfg, data.tokenizer_sha256, start.resume, report.note)
        self.n_params, self.flops_per_token = model.num_parameters(), model.flops_per_token(batch.seq_len)
        self.peak_flops = device_peak_flops(setup.device)  # per device; None on CPU: no MFU
        started = time.perf_counter()
        self.engine, self.engine_info, self.ds_json = eng.initialize(
            model, cfg, batch, setup.device, setup.precision
        )
        self.engine_seconds = time.perf_counter() - started
        # dynamo's counters are process-wide (a sweep's jobs share a process): this run counts from here
        self.compile_start = compile_stats() if self.engine_info.compiled else None
        self.loader = train_loader(cfg, setup, data)
        self.state = new_train_state(cfg, setup, data.tokenizer_sha256)
        # the stream steps never trained on: those a rewind skipped, in this launch or before it
        self.skipped = set(rundir.skipped_data_steps(self.run_dir))
        if start.resume is not None:
            self.load(start.resume)
            for note in resume_notes(start.resume, cfg, setup, len(self.skipped)):
                report.note(note)
        self.start_step = self.state.step
        self.first_loss: float | None = None  # of this launch
        self.last_val: float | None = None
        self.components = Components()
        self.saves: Saves  # register() gives it

    def register(self, saves: Saves, *components: Component) -> None:
        """The checkpoint saves (the loop saves through them) and the other components; the loop
        calls their hooks in this order, the saves' last."""
        self.saves = saves
        self.components = Components([*components, saves])

    def rewind_to(self, found: ckpt.Checkpoint, data_step: int) -> None:
        """Back to checkpoint `found` (trainer.on_nonfinite=rewind), never to train on stream step
        `data_step` again."""
        self.skipped.add(data_step)
        self.load(found)
        self.saves.saved_step = found.state.step

    def load(self, found: ckpt.Checkpoint) -> None:
        """The engine, loader, RNG and train state of a checkpoint (a resume, a rewind)."""
        setup = self.setup
        ckpt.load(self.engine, found, setup.world_size, self.cfg.deepspeed.stage, setup.precision)
        rank_state = ckpt.read_rank_state(found, setup.rank, setup.world_size)
        self.loader.load_state_dict(rank_state["loader"])
        self.loader.skip_steps(self.skipped)  # data a rewind left out after this checkpoint
        ckpt.set_rng_state(rank_state["rng"])
        saved = found.state
        self.state = replace(
            self.state, step=saved.step, tokens_seen=saved.tokens_seen, nan_skips=saved.nan_skips,
            last_loss=saved.last_loss, wandb_id=saved.wandb_id,
        )  # fmt: skip

    def open_run_dir(self) -> None:
        """Only now, with the checkpoint and loader state accepted, does the run directory change
        (a refused resume leaves it as it was): run files, metrics.jsonl and W&B, the banner; then
        the components begin."""
        cfg, setup, resumed = self.cfg, self.setup, self.start.resume
        if setup.rank == 0:
            for path in self.start.damaged:  # found by the resume; kept for inspection, out of every listing
                self.report.warn(f"moved the damaged checkpoint {path.name} to {ckpt.move_aside(path)}")
            run_id, restarts = elastic_ids()
            init_from = Path(cfg.model.init_from).resolve() if cfg.model.init_from and not resumed else None
            resumed_from = resumed.tag_dir if resumed else None
            launch = rundir.Launch(resumed_from, init_from, restarts, setup.world_size, str(setup.device))
            rundir.record_launch(self.run_dir, OmegaConf.to_yaml(OmegaConf.structured(cfg)), launch, run_id)
            keep_tokenizer(self.run_dir, self.loader.data.tokenizer_path, self.state.tokenizer_sha256)
            rundir.write_json(self.run_dir, rundir.DEEPSPEED_FILE, self.ds_json)
            self.report.open(
                self.run_dir, cfg.logger, self.state.config, self.state.wandb_id, self.start_step
            )
            self.state.wandb_id = self.report.wandb_id
        dist.barrier()
        model, coverage = (self.n_params, self.flops_per_token), self.val_coverage()
        self.report.banner(
            cfg, setup, self.engine_info, model, self.engine_seconds, self.start_step, self.run_dir, coverage
        )
        if self.kernel_check.passed or self.kernel_check.failed:
            self.report.note(self.kernel_check.line())
        self.components.begin(self)
        if self.report.wandb_line():
            self.report.note(self.report.wandb_line())

    # -- one optimizer step -------------------------------------------------------------------

    def _prediction_weight(self, batch: Batch) -> float:
        """The sum of the loss weights of this rank's positions of the micro-batch (its part of them)."""
        _, _, weights = next_token_pairs(self.cfg.model, batch.tokens, batch.weights, batch.documents)
        assert weights is not None
        return float(self.setup.batch.shard(self.setup.rank).part(weights).sum().item())

    def _global_weight(self, weights: list[float], loader_step: int) -> float:
        """The loss weights of the whole step, over every rank's micro-batches."""
        batch = self.setup.batch
        # When every weight is 1 (no stored weights, no document masking of either kind, not the
        # split's last, partly weighted sample) the total is known without a collective (and its sync).
        if self.loader.uniform_weights(loader_step):
            return float(batch.global_batch_sequences * batch.seq_len)
        total = torch.tensor([sum(weights)], dtype=torch.float64, device=self.setup.device)
        dist.all_reduce(total)
        return total.item()

    def train_step(self, n: int) -> Step:
        """Optimizer step `n` (1-based): forward/backward every micro-batch of this rank, each
        scaled by its share of the step's loss weights, then the update (skipped for a non-finite
        loss). The step's loss is its global weighted mean loss."""
        engine, batch, device, hooks = self.engine, self.setup.batch, self.setup.device, self.components
        step = Step(n, eng.lr_at(n, self.cfg.optim, self.cfg.trainer.max_steps), time.perf_counter())
        self.stop.begin_step(n)  # Ctrl-C's acknowledgement names it
        hooks.before_step(n)
        eng.set_lr(engine, step.lr)
        step.data_step = self.loader.step
        step.batches = [self.loader.next_batch() for _ in range(batch.grad_accum)]
        weights = [self._prediction_weight(b) for b in step.batches]
        global_weight = self._global_weight(weights, step.data_step)
        step.scales = [w / global_weight if global_weight > 0 else 0.0 for w in weights]
        micro_batches = batch.grad_accum * self.engine_info.averaged_ranks
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # (weighted loss, preempt, interrupt)
        for i, micro in enumerate(step.batches):
            hooks.at(n, "forward", i)
            on_device = micro.to(device, non_blocking=True)
            loss = engine(on_device.tokens, on_device.weights, on_device.documents)
            loss = hooks.after_forward(n, i, loss)
            totals[0] += loss.detach().double() * weights[i]
            # DeepSpeed averages the micro-batch gradients over EngineInfo.averaged_ranks: scaling each
            # by its share of the step's weights times that count makes the average the weighted mean's.
            scale = weights[i] * micro_batches / global_weight if global_weight > 0 else 0.0
            hooks.at(n, "backward", i)
            engine.backward(loss if scale == 1.0 else loss * scale)
            if i < batch.grad_accum - 1:
                engine.step()  # not a boundary: DeepSpeed only counts the micro-step
        totals[1], totals[2] = self.stop.flags()  # read as late as possible; summed over the ranks
        hooks.at(n, "loss all-reduce")
        dist.all_reduce(totals)
        weighted_loss, preempt, interrupt = totals.tolist()
        step.loss = weighted_loss / global_weight if global_weight > 0 else 0.0
        step.stop = "interrupted" if interrupt else "preempted" if preempt else None
        hooks.after_backward(step)  # health: a bad loss is replayed before its update
        hooks.at(n, "optimizer step")
        step.outcome = eng.optimizer_step(engine, math.isfinite(step.loss))
        hooks.after_update(step)
        step.seconds = time.perf_counter() - step.started
        return step

    def record(self, step: Step, elapsed_s: float) -> None:
        """Account for a finished step: the train state, a warning, its record."""
        batch, state = self.setup.batch, self.state
        assert step.outcome is not None
        state.step = step.step
        state.tokens_seen += batch.tokens_per_step
        if step.event is not None:
            state.nan_skips += 1
        elif not step.applied:
            self.report.warn(f"step {step.step}: gradient overflow; the update was skipped")
        else:
            state.last_loss = step.loss
            self.first_loss = step.loss if self.first_loss is None else self.first_loss
        if self.engine_info.compiled and step.step == self.start_step + 1:
            say_compiled(self.report.console, compile_stats(self.compile_start), "training", step.seconds)
        tokens_per_s = batch.tokens_per_step / step.seconds
        utilisation = mfu(self.flops_per_token, tokens_per_s, self.peak_flops, batch.world_size)
        memory = memory_gb(self.setup.device)
        self.report.step_done(
            TrainRecord(
                step.step, step.loss, step.lr, step.outcome.grad_norm, tokens_per_s, utilisation,
                step.seconds, elapsed_s, memory, state.tokens_seen, skipped=not step.applied,
            )
        )  # fmt: skip

    # -- around the step ------------------------------------------------------------------------

    def val_coverage(self) -> str:
        """`all 240 val sequences` or `224 of 240 val sequences`."""
        covered, total = self.loader.val_coverage(self.cfg.trainer.eval_batches)
        return f"all {total} val sequences" if covered == total else f"{covered} of {total} val sequences"

    def evaluate(self, n: int) -> EvalRecord:
        """The evaluation after step n: the weighted mean loss (kept as last_val) on the validation
        sequences trainer.eval_batches names (N micro-batches' worth, shared among the ranks; 0: the
        whole validation split), and its wall time."""
        engine, device, started = self.engine, self.setup.device, time.perf_counter()
        engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)  # (weighted loss, weight)
        with torch.no_grad():
            for i, batch in enumerate(self.loader.val_batches(self.cfg.trainer.eval_batches)):
                self.components.at(self.state.step, "evaluation", i)
                weight = self._prediction_weight(batch)
                on_device = batch.to(device)
                loss = engine(on_device.tokens, on_device.weights, on_device.documents)  # every rank runs it
                if weight > 0:  # the whole split's last round may hold only weight-0 filler rows
                    total[0] += loss.double() * weight
                    total[1] += weight
        dist.all_reduce(total)
        engine.train()
        self.last_val = (total[0] / total[1]).item() if total[1].item() > 0 else float("nan")
        return EvalRecord.of(n, self.last_val, time.perf_counter() - started)

    def save(self, announce: bool = True) -> Path:
        """A checkpoint of the step just finished (lmsys/engine/checkpoint.py); every rank calls it."""
        rank_state = {"loader": self.loader.state_dict(), "rng": ckpt.rng_state()}
        self.components.at(self.state.step, "checkpoint save")
        return self.saves.save(self.engine, self.state, rank_state, announce)  # trainer.async_save

    # -- the run ---------------------------------------------------------------------------------

    def fit(self, step_hook: Callable[[int], None] | None = None) -> None:
        """Every step from the checkpoint's to trainer.max_steps, evaluating and saving on their
        intervals and at the end. step_hook(step) runs after each step's logging, evaluation and
        checkpoint (tools.bench train interleaves a plain loop's steps with lmsys's through it).
        A stop request (`StopRequest`) ends the run after the step every rank learns of it in:
        `Saves.stop_run` saves that step and raises Stopped."""
        t = self.cfg.trainer
        started = time.perf_counter()
        self.engine.train()
        self.stop.armed = True
        stop: str | None = None
        try:
            with self.report.steps(self.start_step + 1, t.max_steps, t.eval_interval):
                n = self.start_step
                while n < t.max_steps:
                    n += 1
                    step = self._first_step(n) if n == self.start_step + 1 else self.train_step(n)
                    self.record(step, time.perf_counter() - started)
                    self.components.after_step(step)  # health's policy may stop or rewind the run here
                    if self.state.step != n:  # rewound to a checkpoint
                        n = self.state.step
                        continue
                    if n % t.eval_interval == 0 or n == t.max_steps:
                        self.report.eval_done(self.evaluate(n), step.loss, self.val_coverage())
                    if n % t.save_interval == 0 or n == t.max_steps:
                        self.save()
                    if step.stop is not None and n < t.max_steps:
                        stop = step.stop
                        break
                    if step_hook is not None:
                        step_hook(n)
                    self.components.step_finished(n)
            if stop is not None:  # saves the step (with the bar down) and raises Stopped
                self.saves.stop_run(stop, self.stop.name(), t.resume)
            if self.saves.saved_step != t.max_steps and self.start_step < t.max_steps:
                self.save()
            self.saves.wait()
        except BaseException as exc:
            self.saves.settle(exc)
            self.report.close(exit_code=exc.exit_code if isinstance(exc, Stopped) else 1)
            raise
        finally:
            self.components.end()
        self._finish(time.perf_counter() - started)

    def _first_step(self, n: int) -> Step:
        """The launch's first step: under trainer.compile=true a compile failure is one error line."""
        if not self.engine_info.compile_strict:
            return self.train_step(n)
        with compile_errors("trainer.compile", "trainer.compile=false trains eager"):
            return self.train_step(n)

    def _finish(self, elapsed_s: float) -> None:
        compiled = None
        if self.engine_info.compiled:
            graphs = "the training step; evaluation, without gradients, has its own"
            compiled = compile_summary(compile_stats(self.compile_start), graphs)
        losses = (self.first_loss, self.state.last_loss, self.last_val)
        self.report.finish(
            losses, self.start_step, self.cfg.trainer.max_steps, elapsed_s, self.run_dir, compiled
        )
        self.saves.close()
        dist.barrier()
