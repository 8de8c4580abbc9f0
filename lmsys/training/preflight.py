"""Preflight: "can this launch run?", answered by one function before anything starts.

launch.torchrun calls it before torchrun starts a worker, launch.sweep and `lmsys-train -m` for
every job before the first one runs, and the trainer on every rank before the process group
forms. The checks, in order (each failure is one ConfigError or DataError line naming the key):

1. the batch arithmetic for the world size: trainer.global_batch_tokens cut into micro-batches
   of trainer.micro_batch_size on every rank (a run that would resume a checkpoint keeps its
   global batch, so the advice is the resume's: lmsys.core.runtime.resume_batch_plan);
2. the prepared data in data.dir: it exists, its tokenizer has the model's vocabulary, and both
   of its splits hold at least one sequence of data.seq_len;
3. the memory plan (trainer.plan, lmsys/training/planning.py): a launch predicted not to fit its
   device is refused with what would fit (auto: on CUDA; a warning on CPU), before any process,
   engine or model exists.

The config itself is composed and validated by the caller (lmsys.core.config.compose).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lmsys.core.config import Config, tokens_per_sample
from lmsys.core.console import warn as warn_line
from lmsys.core.errors import ConfigError, LmsysError
from lmsys.core.runtime import BatchPlan, batch_plan, resume_batch_plan
from lmsys.data.shards import PreparedData
from lmsys.engine import checkpoint as ckpt
from lmsys.engine.runlock import RunLock, holder_of
from lmsys.training.planning import Plan, check_plan

DATA_CHECKS = ("required", "if_present", "skip")


@dataclass(frozen=True)
class Preflight:
    """What a launch that passed its checks will work with."""

    plan: BatchPlan | None  # None when the world size is not known yet
    data: PreparedData | None  # None when the data was not checked (data="skip" or not here)
    memory: Plan | None = None  # None when the world size is not known or trainer.plan=off


def open_data(cfg: Config) -> PreparedData:
    """The prepared data, refused (DataError) when it does not fit the model or the sequence length."""
    data = PreparedData(cfg.data.dir)
    data.check_model(cfg.model)
    data.check_sequences(tokens_per_sample(cfg.model, cfg.data.seq_len))
    return data


def resumable_checkpoint(cfg: Config) -> ckpt.Checkpoint | None:
    """The checkpoint a launch of `cfg` would continue, read without hashing its files (the trainer
    verifies them); None when it starts afresh or there is nothing readable to continue."""
    t = cfg.trainer
    target = t.run_dir if t.resume == "auto" else None if t.resume == "never" else t.resume
    if not target or not Path(target).is_dir():
        return None
    try:
        return ckpt.resolve(target, check_hashes=False)
    except LmsysError:  # nothing to resume there: the run starts afresh (or the trainer says why)
        return None


def check_batch(cfg: Config, world_size: int) -> BatchPlan:
    """The batch plan on `world_size` ranks; a batch that does not split is reported as the
    resume's when the launch would resume a checkpoint (a resumed run keeps its global batch)."""
    try:
        return batch_plan(cfg, world_size)
    except ConfigError:
        found = resumable_checkpoint(cfg)
        if found is None:
            raise
        return resume_batch_plan(cfg, world_size, found.step)


def preflight(
    cfg: Config,
    world_size: int | None,
    data: str = "required",
    opened: dict[str, PreparedData] | None = None,
    warn: Callable[[str], None] | None = None,
) -> Preflight:
    """Check that a launch of `cfg` on `world_size` ranks can run (module docstring); world_size
    None (not known before the job starts) skips the batch check.

    data: "required" (the trainer and local launches), "if_present" (jobs that run on other
    machines, e.g. SLURM: a data.dir missing here is left for the job to find) or "skip".
    opened: a cache of data directories already opened, for the jobs of a sweep.
    warn: where a plan that does not fit is reported under trainer.plan=warn (default: stderr)."""
    if data not in DATA_CHECKS:
        raise ValueError(f"data={data!r}: one of {DATA_CHECKS}")
    plan = check_batch(cfg, world_size) if world_size is not None else None
    prepared = None
    if data == "required" or (data == "if_present" and Path(cfg.data.dir).exists()):
        if opened is not None and cfg.data.dir in opened:
            prepared = opened[cfg.data.dir]
            prepared.check_model(cfg.model)
            prepared.check_sequences(tokens_per_sample(cfg.model, cfg.data.seq_len))
        else:
            prepared = open_data(cfg)
            if opened is not None:
                opened[cfg.data.dir] = prepared
    memory = None
    if world_size is not None:
        memory = check_plan(cfg, world_size, warn or (lambda message: warn_line("lmsys", message)))
    return Preflight(plan=plan, data=prepared, memory=memory)


def check_run_dir_free(cfg: Config) -> None:
    """For the launchers, before any worker starts: trainer.run_dir is not held by a running launch
    (lmsys.engine.runlock; the trainer's rank 0 takes the lock itself)."""
    if not cfg.trainer.run_dir:
        return
    holder = holder_of(Path(cfg.trainer.run_dir))
    if holder is not None:
        raise RunLock(Path(cfg.trainer.run_dir)).busy(holder)
