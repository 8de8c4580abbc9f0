"""What a training launch works on, settled before the engine exists (after its preflight,
lmsys/training/preflight.py): the device and process group, the run directory and the
checkpoint it continues (rank 0 decides, every rank receives the same plan or the same error),
and the learning-rate schedule's horizon.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from lmsys.core.config import Config, config_to_dict
from lmsys.core.console import Console
from lmsys.core.errors import ConfigError, LmsysError
from lmsys.core.runtime import (
    env_dist_info,
    make_deterministic,
    resolve_device,
    resolve_precision,
    resume_batch_plan,
)
from lmsys.engine import checkpoint as ckpt
from lmsys.engine import rundir
from lmsys.engine import zero as eng
from lmsys.engine.runlock import RunLock
from lmsys.model.ops import prepare_kernels


def elastic_ids() -> tuple[str | None, int]:
    return os.environ.get("TORCHELASTIC_RUN_ID"), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def start_processes(cfg: Config) -> tuple[torch.device, str]:
    """Device, kernels and precision, then the process group."""
    t = cfg.trainer
    if t.deterministic:
        make_deterministic()  # before CUDA starts (cuBLAS reads its workspace setting then)
    device = resolve_device(t.device, env_dist_info().local_rank, key="trainer.device")
    prepare_kernels(cfg.model.kernels, device)  # before anything imports triton (DeepSpeed does)
    precision = resolve_precision(cfg.deepspeed.precision, device)
    eng.init_distributed(device, t.dist_timeout_s)
    return device, precision


@dataclass
class RunPlan:
    run_dir: Path
    resume: ckpt.Checkpoint | None  # the checkpoint to continue from
    damaged: list[Path] = field(default_factory=list)  # newer checkpoints the resume passed over
    lock: RunLock | None = field(default=None, compare=False)  # rank 0's, held until the run ends


def choose_run_dir(cfg: Config) -> Path:
    """trainer.run_dir, else (after a torchrun restart) the directory of the job's first attempt,
    else a new runs/<model.name>-<timestamp>."""
    t = cfg.trainer
    if t.run_dir:
        run_dir = Path(t.run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"trainer.run_dir={t.run_dir} exists and is not a directory")
        return run_dir
    run_id, restarts = elastic_ids()
    restarted = rundir.find_restarted_run(cfg.model.name, run_id) if run_id and restarts else None
    return restarted or rundir.new_run_dir(cfg.model.name)


def plan_run(
    cfg: Config, tokenizer_sha256: str, world_size: int, warn: Callable[[str], None], run_dir: Path
) -> RunPlan:
    """Rank 0, read-only: what the run in `run_dir` resumes from. Raises user errors."""
    t = cfg.trainer
    found, damaged = None, []
    if t.resume == "auto":
        found = ckpt.find_latest(run_dir, warn, damaged=damaged) if run_dir.exists() else None
    elif t.resume == "never":
        if ckpt.list_checkpoints(run_dir / rundir.CHECKPOINTS):
            raise ConfigError(
                f"trainer.run_dir={run_dir} already holds checkpoints and trainer.resume=never; "
                "use trainer.resume=auto to continue it or choose another trainer.run_dir"
            )
    elif not Path(t.resume).is_dir():
        raise ConfigError(f"trainer.resume={t.resume} is not a checkpoint directory (nor a run directory)")
    else:
        found = ckpt.resolve(t.resume, warn)  # a checkpoint directory, or a run's newest intact one
    if found is not None:
        model_dict = config_to_dict(cfg)["model"]
        ckpt.check_compatible(found.state, model_dict, tokenizer_sha256, cfg.optim.name)
        resume_batch_plan(cfg, world_size, found.step)
    return RunPlan(run_dir, found, damaged)


def locked_plan(cfg: Config, tokenizer_sha256: str, world_size: int, console: Console) -> RunPlan:
    """Rank 0: the run's plan, with the run directory locked (lmsys.engine.runlock) before anything
    is written there. An existing directory is locked before its checkpoints are read (a second
    launch hears of the first, not of its checkpoints) and named as this launch's once the plan
    holds; a new one is locked only then: a refused launch leaves the directory as it was."""
    run_dir = choose_run_dir(cfg)
    lock = RunLock(run_dir).acquire(announce=False) if run_dir.is_dir() else None
    try:
        plan = plan_run(cfg, tokenizer_sha256, world_size, console.warn, run_dir)
        if lock is None:
            lock = RunLock(run_dir).acquire()
        else:
            lock.announce()
    except BaseException:
        if lock is not None:
            lock.release()  # unannounced: the file as it was
        raise
    if lock.took_over is not None:
        console.warn(f"took over the lock of {run_dir} from {lock.took_over.describe()}: it is gone")
    plan.lock = lock
    return plan


def agree_on_run(cfg: Config, rank: int, world_size: int, tokenizer_sha256: str, console: Console) -> RunPlan:
    """Rank 0 plans the run and every rank receives the same plan, or raises the same error."""
    box: list[RunPlan | LmsysError | None] = [None]
    lock = None
    if rank == 0:
        try:
            plan = locked_plan(cfg, tokenizer_sha256, world_size, console)
            lock, plan.lock = plan.lock, None  # the lock stays with rank 0, out of the broadcast
            box[0] = plan
        except LmsysError as exc:
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], LmsysError):
        raise box[0]
    assert box[0] is not None
    box[0].lock = lock
    return box[0]


def schedule_horizon(cfg: Config, resume: ckpt.Checkpoint | None) -> int:
    """The step where the learning rate's cosine ends: optim.decay_steps when set, else the
    horizon the resumed run was trained with (so raising trainer.max_steps extends the run
    without changing the learning rates it already had), else trainer.max_steps."""
    if cfg.optim.decay_steps:
        return cfg.optim.decay_steps
    if resume is not None:
        saved = resume.state.config
        return int(saved.get("optim", {}).get("decay_steps") or saved["trainer"]["max_steps"])
    return cfg.trainer.max_steps
