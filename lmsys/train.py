"""lmsys-train: train a model of the family on prepared data with DeepSpeed ZeRO.

    python -m lmsys.prepare                                   # once: data/default
    torchrun --standalone --nproc_per_node=2 -m lmsys.train deepspeed=zero2 model=tiny
    lmsys-train model=seed_trax optim.lr=3e-4 trainer.max_steps=2000      # one process
    lmsys-train -m optim.lr=1e-3,3e-4 model=tiny,seed_trax               # a Hydra sweep

Every rank composes the same config; rank 0 picks the run directory (trainer.run_dir, or
runs/<model.name>-<timestamp>) after the process group is up and broadcasts it, so all ranks
share ONE directory: config.yaml (the resolved config), run.json, deepspeed.json (the generated
DeepSpeed config), engine_stats.json (what each rank holds), metrics.jsonl, loss.png,
checkpoints/ and wandb/. Hydra itself writes nothing (conf/config.yaml: no output subdir, no
log files, run dir ".").

One optimizer step: the loader's `grad_accum` micro-batches on every rank (together the same
set of sequences whatever the world size), a forward/backward each through the engine, one
optimizer step. Each micro-batch's loss is weighted by its share of the step's loss weights, so
the gradient is that of the step's global weighted mean loss for any split into ranks and
micro-batches. A step whose loss is NaN/inf is skipped (no update) with a warning, at most
trainer.max_nan_skips times. Checkpoints: lmsys/checkpoint.py; trainer.resume=auto continues from
the newest complete one.

Errors: a bad config, bad data or an incompatible checkpoint prints one line
`lmsys-train: error: ...` and exits 2 before anything is written; a training failure (too many
NaN steps) exits 1.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from lmsys.config import CONF_DIR, Config, ConfigError, compose, config_to_dict, to_config

PROG = "lmsys-train"
RUN_META = "run.json"


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many non-finite losses); one line for the user."""


# ----------------------------------------------------------------------------- messages

_rank = 0
_bar: Any = None


def say(message: str) -> None:
    """A line for the user, from rank 0 (through tqdm while the progress bar is up)."""
    if _rank != 0:
        return
    if _bar is not None:
        _bar.write(message, file=sys.stdout)
    else:
        print(message, flush=True)


def warn(message: str) -> None:
    if _rank != 0:
        return
    line = f"{PROG}: warning: {message}"
    if _bar is not None:
        _bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


def _user_errors() -> tuple[type[BaseException], ...]:
    from lmsys.checkpoint import CheckpointError
    from lmsys.corpus import DataError

    errors: list[type[BaseException]] = [ConfigError, DataError, CheckpointError]
    try:
        from lmsys import data as data_module

        errors.append(data_module.DataError)
    except Exception:
        pass
    return tuple(errors)


# ----------------------------------------------------------------------------- run directory


@dataclass
class RunPlan:
    run_dir: str
    new_dir: bool
    checkpoint: str | None  # directory to resume from
    state: dict[str, Any] | None  # its marker's client state
    error: str | None = None


def _elastic_ids() -> tuple[str | None, int]:
    return os.environ.get("TORCHELASTIC_RUN_ID"), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _default_run_dir(cfg: Config) -> tuple[Path, bool]:
    """runs/<model.name>-<timestamp>; after a torchrun restart, the directory of the first attempt."""
    runs = Path("runs")
    run_id, restarts = _elastic_ids()
    if restarts > 0 and run_id:
        candidates = []
        for meta_path in runs.glob(f"{cfg.model.name}-*/{RUN_META}"):
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if meta.get("torchelastic_run_id") == run_id:
                candidates.append((meta_path.stat().st_mtime, meta_path.parent))
        if candidates:
            return max(candidates)[1], False
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = runs / f"{cfg.model.name}-{stamp}"
    n = 1
    while path.exists():
        path = runs / f"{cfg.model.name}-{stamp}-{n}"
        n += 1
    return path, True


def plan_run(cfg: Config, tokenizer_sha256: str, world_size: int) -> RunPlan:
    """Rank 0, read-only: where the run lives and what it resumes from. Raises user errors."""
    from lmsys import checkpoint as ckpt

    t = cfg.trainer
    if t.run_dir:
        run_dir = Path(t.run_dir)
        new_dir = not run_dir.exists()
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"trainer.run_dir={t.run_dir} exists and is not a directory")
    else:
        run_dir, new_dir = _default_run_dir(cfg)
    found: tuple[Path, dict[str, Any]] | None = None
    if t.resume == "auto":
        found = None if new_dir else ckpt.find_latest(run_dir, warn)
    elif t.resume == "never":
        if not new_dir and ckpt.list_checkpoints(run_dir / ckpt.CHECKPOINTS):
            raise ConfigError(
                f"trainer.run_dir={run_dir} already holds checkpoints and trainer.resume=never; "
                "use trainer.resume=auto to continue it or choose another trainer.run_dir"
            )
    else:
        found = ckpt.load_explicit(Path(t.resume))
    if found is None:
        return RunPlan(str(run_dir), new_dir, None, None)
    path, marker = found
    state = marker["state"]
    ckpt.check_compatible(
        state, config_to_dict(cfg)["model"], tokenizer_sha256, world_size, cfg.deepspeed.stage
    )
    return RunPlan(str(run_dir), new_dir, str(path), state)


def _write_run_files(run_dir: Path, cfg: Config, plan: RunPlan, extra: dict[str, Any]) -> None:
    from lmsys.checkpoint import atomic_write_text

    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    meta_path = run_dir / RUN_META
    meta: dict[str, Any] = {}
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except ValueError:
            meta = {}
    run_id, restarts = _elastic_ids()
    meta.setdefault("created", datetime.now().isoformat(timespec="seconds"))
    meta.setdefault("launches", [])
    meta["launches"].append(
        {
            "at": datetime.now().isoformat(timespec="seconds"),
            "resumed_from": plan.checkpoint,
            "torchelastic_restart": restarts,
            **extra,
        }
    )
    if run_id:
        meta["torchelastic_run_id"] = run_id
    atomic_write_text(meta_path, json.dumps(meta, indent=1))


# ----------------------------------------------------------------------------- helpers


def target_weight_sum(weights: Any, bos_shift: bool) -> float:
    """Sum of the loss weights the model's loss actually uses (weights[:, 0] is unused with the
    usual shift: nothing predicts the first token)."""
    return float((weights if bos_shift else weights[:, 1:]).sum().item())


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------- training


def train(cfg: Config, step_hook: Callable[[int], None] | None = None) -> Path:
    """Train according to `cfg` (validated). Every rank calls this. Returns the run directory.

    step_hook(step), if given, runs at the end of every step, after its logging, evaluation and
    checkpoint (lmsys.bench train interleaves a plain loop's steps with lmsys's through it)."""
    global _rank, _bar
    import torch
    import torch.distributed as dist

    from lmsys import checkpoint as ckpt
    from lmsys import engine as eng
    from lmsys.data import PreparedData, TokenLoader
    from lmsys.metrics import MetricsLogger, device_name, device_peak_flops, memory_gb, mfu, plot_losses
    from lmsys.model import Transformer
    from lmsys.ops import prepare_kernels

    t = cfg.trainer
    info = eng.env_dist_info()
    _rank = info.rank
    plan = eng.batch_plan(cfg, info.world_size)
    device = eng.resolve_device(t.device, info.local_rank)
    prepare_kernels(cfg.model.kernels, device)  # before anything imports triton (DeepSpeed does)
    precision = eng.resolve_precision(cfg.deepspeed.precision, device)

    # Everything a user can get wrong is checked before anything is written.
    data = PreparedData(cfg.data.dir)
    data.check_model(cfg.model)
    data.check_sequences(plan.tokens_per_sample)
    tokenizer_sha = data.tokenizer_sha256

    eng.init_distributed(device, t.dist_timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    _rank = rank
    if world != plan.world_size:  # torchrun env and the process group disagree: trust the group
        plan = eng.batch_plan(cfg, world)

    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = plan_run(cfg, tokenizer_sha, world)
        except _user_errors() as exc:
            box[0] = RunPlan("", False, None, None, error=str(exc))
    dist.broadcast_object_list(box, src=0)
    run_plan: RunPlan = box[0]
    if run_plan.error is not None:
        raise ConfigError(run_plan.error)
    run_dir = Path(run_plan.run_dir)

    # Model and engine: identical initialisation on every rank.
    seed_everything(t.seed)
    model = Transformer(cfg.model)
    n_params = model.num_parameters()
    flops_per_token = model.flops_per_token(plan.seq_len)
    engine, einfo, ds_json = eng.initialize(model, cfg, plan, device)

    loader = TokenLoader(
        data,
        "train",
        tokens_per_sample=plan.tokens_per_sample,
        global_batch_size=plan.global_batch_sequences,
        micro_batch_size=plan.micro_batch_size,
        rank=rank,
        world_size=world,
        seed=t.seed,
        mask_doc_boundaries=cfg.data.mask_doc_boundaries,
    )
    if loader.micro_batches_per_step != plan.grad_accum:
        raise RuntimeError(
            f"loader cuts {loader.micro_batches_per_step} micro-batches per step, "
            f"engine expects {plan.grad_accum}"
        )

    # Resume.
    start_step, nan_skips, tokens_seen = 0, 0, 0
    wandb_id: str | None = None
    if run_plan.checkpoint is not None:
        path = Path(run_plan.checkpoint)
        ckpt.load(engine, path)
        rank_state = ckpt.read_rank_state(path, rank)
        loader.load_state_dict(rank_state["loader"])
        ckpt.set_rng_state(rank_state["rng"])
        state = run_plan.state or {}
        start_step = int(state["step"])
        nan_skips = int(state.get("nan_skips", 0))
        tokens_seen = int(state.get("tokens_seen", 0))
        wandb_id = state.get("wandb_id")
        say(f"{PROG}: resumed from {path} (step {start_step})")

    # Only now, with the checkpoint and loader state accepted, does the run directory change: a
    # refused resume leaves it as it was.
    if rank == 0:
        _write_run_files(run_dir, cfg, run_plan, {"world_size": world, "device": str(device)})
        ckpt.atomic_write_text(run_dir / "deepspeed.json", json.dumps(ds_json, indent=1))
    dist.barrier()

    config_dict = config_to_dict(cfg)
    logger = None
    if rank == 0:
        logger = MetricsLogger(run_dir, cfg.logger, config_dict, run_dir.name, wandb_id, start_step, warn)
        wandb_id = logger.wandb_id

    peak = device_peak_flops(device)
    say(
        f"{PROG}: model {cfg.model.name}: {n_params:,} parameters, "
        f"{flops_per_token / 1e6:,.1f} MFLOP per token "
        f"(6N + 12LHdT at T={plan.seq_len})\n"
        f"{PROG}: {plan.arithmetic()} ({plan.global_batch_sequences} sequences)\n"
        f"{PROG}: ZeRO stage {einfo.stage}, world size {world}, device {device_name(device)}, {precision}, "
        f"{einfo.optimizer}"
        + (", activation checkpointing" if einfo.activation_checkpointing else "")
        + (", offload optimizer" if einfo.offload_optimizer else "")
        + (", offload params" if einfo.offload_param else "")
        + f"\n{PROG}: steps {start_step + 1}..{t.max_steps}, run directory {run_dir}"
    )

    def client_state(step: int, last_loss: float | None) -> dict[str, Any]:
        return {
            "step": step,
            "nan_skips": nan_skips,
            "tokens_seen": tokens_seen,
            "last_loss": last_loss,
            "world_size": world,
            "zero_stage": cfg.deepspeed.stage,
            "precision": precision,
            "tokenizer_sha256": tokenizer_sha,
            "wandb_id": wandb_id,
            "config": config_dict,
        }

    def save(step: int, last_loss: float | None) -> None:
        rank_state = {"loader": loader.state_dict(), "rng": ckpt.rng_state()}
        ckpt.save(engine, run_dir, step, client_state(step, last_loss), rank_state, rank, t.keep_last)

    def evaluate() -> float:
        engine.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)
        with torch.no_grad():
            for batch in loader.val_batches(t.eval_batches):
                w = target_weight_sum(batch.weights, cfg.model.bos_shift)
                loss = engine(batch.tokens.to(device), batch.weights.to(device))
                total[0] += loss.double() * w
                total[1] += w
        dist.all_reduce(total)
        engine.train()
        return (total[0] / total[1]).item() if total[1].item() > 0 else float("nan")

    from tqdm import tqdm

    _bar = tqdm(
        total=t.max_steps,
        initial=start_step,
        desc=PROG,
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        file=sys.stderr,
        disable=rank != 0 or not t.progress,
    )
    n_micro = plan.grad_accum * world
    # Without document-boundary masking every loss weight is 1 (except in the split's last,
    # partly weighted sample), so the step's total is G * seq_len and needs no all-reduce (one
    # collective and sync fewer).
    uniform_weights = not cfg.data.mask_doc_boundaries
    nan_steps = set(t.debug_nan_steps)
    first_loss: float | None = None
    last_loss: float | None = None
    last_val: float | None = None
    saved_step = start_step if run_plan.checkpoint else -1
    train_start = time.perf_counter()
    stats_written = False
    _, restarts = _elastic_ids()
    engine.train()
    try:
        for step in range(start_step + 1, t.max_steps + 1):
            t0 = time.perf_counter()
            lr = eng.lr_at(step, cfg.optim, t.max_steps)
            eng.set_lr(engine, lr)
            loader_step = loader.step
            batches = [loader.next_batch() for _ in range(plan.grad_accum)]
            wsums = [target_weight_sum(b.weights, cfg.model.bos_shift) for b in batches]
            if uniform_weights and not loader.step_has_repeats(loader_step):
                # every prediction weighs 1: the step's total is known, no collective
                global_wsum = float(plan.global_batch_sequences * plan.seq_len)
            else:
                weight_total = torch.tensor([sum(wsums)], dtype=torch.float64, device=device)
                dist.all_reduce(weight_total)
                global_wsum = weight_total.item()
            local = torch.zeros(1, dtype=torch.float64, device=device)
            bad = False
            norm: float | None = None
            for i, batch in enumerate(batches):
                loss = engine(
                    batch.tokens.to(device, non_blocking=True), batch.weights.to(device, non_blocking=True)
                )
                if step in nan_steps and i == 0:
                    loss = loss * float("nan")  # fault injection (trainer.debug_nan_steps)
                local += loss.detach().double() * wsums[i]
                scale = wsums[i] * n_micro / global_wsum if global_wsum > 0 else 0.0
                engine.backward(loss if scale == 1.0 else loss * scale)
                if i < plan.grad_accum - 1:
                    engine.step()  # not a boundary: DeepSpeed only counts the micro-step
                    continue
                dist.all_reduce(local)
                step_loss = local.item() / global_wsum if global_wsum > 0 else 0.0
                bad = not math.isfinite(step_loss)
                if cfg.deepspeed.stage == 0:
                    if bad:  # ZeRO >= 1 discards a step with non-finite gradients by itself
                        with eng.skipped_update(engine):
                            engine.step()
                    else:
                        norm = eng.replicated_grad_norm(engine.module)
                        engine.step()
                else:
                    engine.step()
                    norm = eng.grad_norm(engine)
            applied = engine.was_step_applied() and not bad
            tokens_seen += plan.tokens_per_step
            step_time = time.perf_counter() - t0
            tokens_per_s = plan.tokens_per_step / step_time
            if bad:
                nan_skips += 1
                warn(
                    f"step {step}: loss is {step_loss}; skipped the update "
                    f"({nan_skips} of trainer.max_nan_skips={t.max_nan_skips})"
                )
            elif not applied:
                warn(f"step {step}: gradient overflow; the update was skipped")
            else:
                last_loss = step_loss
                if first_loss is None:
                    first_loss = step_loss
            grad_norm = norm if applied else None
            if not stats_written and applied:
                stats_written = True
                mine = eng.shard_stats(engine)
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, mine)
                if rank == 0:
                    ckpt.atomic_write_text(
                        run_dir / "engine_stats.json",
                        json.dumps({"engine": einfo.as_dict(), "ranks": gathered}, indent=1),
                    )
            if logger is not None:
                record = {
                    "loss": step_loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_s,
                    "mfu": mfu(flops_per_token, tokens_per_s, peak, world),
                    "step_time_s": step_time,
                    # wall time since this launch's first step began, logging of earlier steps
                    # included: differences give the loop's true per-step cost (lmsys.bench train)
                    "elapsed_s": time.perf_counter() - train_start,
                    "memory_gb": memory_gb(device),
                    "tokens": tokens_seen,
                    "skipped": not applied,
                }
                interval = cfg.logger.log_interval
                logger.log(
                    "train",
                    step,
                    record,
                    to_wandb=step % interval == 0 or step in (start_step + 1, t.max_steps),
                )
            if nan_skips > t.max_nan_skips:
                raise TrainingError(
                    f"loss was NaN/inf at {nan_skips} steps, "
                    f"more than trainer.max_nan_skips={t.max_nan_skips}; "
                    f"stopping at step {step} (lower optim.lr or raise optim.warmup_steps; "
                    f"checkpoints in {run_dir / ckpt.CHECKPOINTS})"
                )
            _bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            _bar.update(1)

            if step % t.eval_interval == 0 or step == t.max_steps:
                last_val = evaluate()
                if logger is not None:
                    logger.log("eval", step, {"loss": last_val, "ppl": math.exp(min(last_val, 80.0))})
                say(f"{PROG}: step {step}: train loss {step_loss:.4f}, val loss {last_val:.4f}")
            if step % t.save_interval == 0 or step == t.max_steps:
                save(step, last_loss)
                saved_step = step
            if step_hook is not None:
                step_hook(step)
            if t.debug_step_delay_s > 0:
                time.sleep(t.debug_step_delay_s)
            if t.debug_crash_at_step == step and rank == world - 1 and restarts == 0:
                print(
                    f"{PROG}: debug: rank {rank} exits at step {step} (trainer.debug_crash_at_step)",
                    flush=True,
                )
                os._exit(13)
        if saved_step != t.max_steps and start_step < t.max_steps:
            save(t.max_steps, last_loss)
    except BaseException:
        if logger is not None:
            logger.close(exit_code=1)
            logger = None
        raise
    finally:
        if _bar is not None:
            _bar.close()
            _bar = None

    elapsed = time.perf_counter() - train_start
    if logger is not None:
        logger.summary({"final/loss": last_loss, "final/val_loss": last_val, "final/steps": t.max_steps})
        logger.close()
        plot_losses(run_dir)
    if rank == 0:
        if start_step >= t.max_steps:
            say(f"{PROG}: nothing to do: the checkpoint is already at trainer.max_steps={t.max_steps}")
        else:
            first = f"{first_loss:.4f}" if first_loss is not None else "n/a"
            last = f"{last_loss:.4f}" if last_loss is not None else "n/a"
            val = (
                f", val loss {last_val:.4f} (ppl {math.exp(min(last_val, 80.0)):.1f})"
                if last_val is not None
                else ""
            )
            say(
                f"{PROG}: done: steps {start_step + 1}..{t.max_steps} in {elapsed:.1f} s, "
                f"loss {first} -> {last}{val}"
            )
        say(f"{PROG}: run directory: {run_dir.resolve()}")
    dist.barrier()
    return run_dir


# ----------------------------------------------------------------------------- entry points


def _in_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:
        return False


def _fail(exc: BaseException, code: int) -> None:
    """One line on stderr (rank 0) and exit `code`. In a Hydra sweep the job fails instead, so
    the other jobs still run (Hydra reports the failure at the end)."""
    if _rank == 0:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if _in_multirun():
        raise exc
    sys.exit(code)


# An absolute config path: the task may run as `lmsys.train` (the lmsys-train console script,
# submitit workers), where a relative one would be looked up as a Python package.
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_task(dcfg: DictConfig) -> None:
    from lmsys.sweep import multirun_defaults

    multirun_defaults(dcfg)  # `-m`: run_dir <sweep dir>/<job number>, W&B group = the sweep's name
    try:
        cfg = to_config(dcfg)
    except ConfigError as exc:
        _fail(exc, 2)
    try:
        train(cfg)
    except _user_errors() as exc:
        _fail(exc, 2)
    except TrainingError as exc:
        _fail(exc, 1)


def die_with_launcher() -> None:
    """Under torchrun, make this worker die with its launcher.

    torchrun starts each worker in a session of its own, so a `kill -9` of torchrun (or of the
    job's process group) would leave the workers training on as orphans, writing checkpoints
    that race with the resumed job. PR_SET_PDEATHSIG has the kernel SIGKILL us when the parent
    dies; checkpoints are atomic, so dying at any moment is safe. Linux only; a no-op elsewhere.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


def _is_plain_run(argv: list[str]) -> bool:
    """Only overrides (no Hydra flags such as -m, --cfg, --help)."""
    return not any(arg.startswith("-") for arg in argv)


def main(argv: list[str] | None = None) -> int:
    global _rank
    argv = list(sys.argv[1:] if argv is None else argv)
    _rank = int(os.environ.get("RANK", "0"))
    die_with_launcher()
    if _is_plain_run(argv):
        # Compose once up front so a typo or a bad value is one line, not Hydra's report.
        try:
            compose(argv)
        except ConfigError as exc:
            _fail(exc, 2)
    elif "-m" in argv or "--multirun" in argv:
        # Every job of the sweep composed up front: a misspelled key is one line before any job runs.
        from lmsys.sweep import check_multirun, shared_sweep_dir

        try:
            check_multirun(argv)
        except ConfigError as exc:
            _fail(exc, 2)
        argv = shared_sweep_dir(argv)  # under torchrun: one sweep directory for all ranks
    sys.argv = [sys.argv[0] if sys.argv else PROG, *argv]
    _hydra_task()
    return 0


if __name__ == "__main__":
    # Run the copy imported as `lmsys.train`, not `__main__`: launchers that pickle the task
    # (hydra/launcher=slurm, submitit) must find its classes by an importable name on the worker.
    from lmsys.train import main as _main

    sys.exit(_main())
