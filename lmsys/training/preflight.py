"""A launch before its engine exists: "can it run?" (the preflight), then what it works on (the
device and process group, the run directory and the checkpoint it continues, the schedule's
horizon, the model it starts from).

The preflight answers "can this launch run?" in one function before anything starts.

launch.torchrun calls it before torchrun starts a worker, launch.sweep and `lmsys-train -m` for
every job before the first one runs, and the trainer on every rank before the process group
forms. The checks, in order (each failure is one ConfigError or DataError line naming the key):

1. the batch arithmetic for the world size: trainer.global_batch_tokens cut into micro-batches
   of trainer.micro_batch_size on every rank (a run that would resume a checkpoint keeps its
   global batch, so the advice is the resume's: lmsys.core.runtime.resume_batch_split);
2. the prepared data in data.dir: it exists, its tokenizer has the model's vocabulary, and both
   of its splits hold at least one sequence of data.seq_len;
3. the memory plan (trainer.plan, lmsys/planning/check.py): a launch predicted not to fit its
   device is refused with what would fit (auto: on CUDA; a warning on CPU), before any process,
   engine or model exists.

The config itself is composed and validated by the caller (lmsys.core.config.compose).

Then the trainer's own start (`agree_on_start`): rank 0 settles the run directory and the
checkpoint the launch continues (its `StartingPoint`), and every rank receives the same one or
the same error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from lmsys.core import rundir
from lmsys.core.config import Config, config_to_dict, tokens_per_sample
from lmsys.core.console import Console
from lmsys.core.console import warn as warn_line
from lmsys.core.errors import ConfigError, LmsysError
from lmsys.core.runtime import (
    BatchSplit,
    Setup,
    env_dist_info,
    make_deterministic,
    resolve_device,
    resolve_precision,
    resume_batch_split,
    split_batch,
)
from lmsys.data.loader import TokenLoader
from lmsys.data.shards import PreparedData
from lmsys.engine import checkpoint as ckpt
from lmsys.engine import zero as eng
from lmsys.engine.quiet import ops_to_build
from lmsys.engine.runlock import RunLock, holder_of
from lmsys.interop.export_dir import initial_model
from lmsys.model.ops import prepare_kernels
from lmsys.model.transformer import Transformer
from lmsys.planning.check import Plan, check_plan

DATA_CHECKS = ("required", "if_present", "skip")


@dataclass(frozen=True)
class Preflight:
    """What a launch that passed its checks will work with."""

    batch: BatchSplit | None  # None when the world size is not known yet
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


def check_batch(cfg: Config, world_size: int) -> BatchSplit:
    """The batch split on `world_size` ranks; a batch that does not split is reported as the
    resume's when the launch would resume a checkpoint (a resumed run keeps its global batch)."""
    try:
        return split_batch(cfg, world_size)
    except ConfigError:
        found = resumable_checkpoint(cfg)
        if found is None:
            raise
        return resume_batch_split(cfg, world_size, found.step)


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
    batch = check_batch(cfg, world_size) if world_size is not None else None
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
    return Preflight(batch=batch, data=prepared, memory=memory)


def check_run_dir_free(cfg: Config) -> None:
    """For the launchers, before any worker starts: trainer.run_dir is not held by a running launch
    (lmsys.engine.runlock; the trainer's rank 0 takes the lock itself)."""
    if not cfg.trainer.run_dir:
        return
    holder = holder_of(Path(cfg.trainer.run_dir))
    if holder is not None:
        raise RunLock(Path(cfg.trainer.run_dir)).busy(holder)


# ----------------------------------------------------------------------------- the trainer's start


def elastic_ids() -> tuple[str | None, int]:
    return os.environ.get("TORCHELASTIC_RUN_ID"), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def start_processes(cfg: Config, console: Console) -> tuple[torch.device, str]:
    """Device, kernels and precision, then the process group, announced in one line."""
    t = cfg.trainer
    cuda = torch.cuda.is_available() and t.device != "cpu"
    builds = ops_to_build(torch.device("cuda" if cuda else "cpu"), cfg.deepspeed.offload_optimizer)
    console.note(
        "starting: process group, model, DeepSpeed engine"
        + (" (this first run on the machine builds DeepSpeed's ops: a minute or two)" if builds else "")
    )
    if t.deterministic:
        make_deterministic()  # before CUDA starts (cuBLAS reads its workspace setting then)
    device = resolve_device(t.device, env_dist_info().local_rank, key="trainer.device")
    prepare_kernels(cfg.model.kernels, device)  # before anything imports triton (DeepSpeed does)
    precision = resolve_precision(cfg.deepspeed.precision, device)
    eng.init_distributed(device, t.dist_timeout_s)
    return device, precision


@dataclass
class StartingPoint:
    """Where a launch starts: its run directory and the checkpoint it continues."""

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


def find_starting_point(
    cfg: Config, tokenizer_sha256: str, world_size: int, warn: Callable[[str], None], run_dir: Path
) -> StartingPoint:
    """Rank 0, read-only: what the run in `run_dir` continues. Raises user errors."""
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
        resume_batch_split(cfg, world_size, found.step)
    return StartingPoint(run_dir, found, damaged)


def lock_starting_point(
    cfg: Config, tokenizer_sha256: str, world_size: int, console: Console
) -> StartingPoint:
    """Rank 0: the run's starting point, with the run directory locked (lmsys.engine.runlock) before
    anything is written there. An existing directory is locked before its checkpoints are read (a
    second launch hears of the first, not of its checkpoints) and named as this launch's once the
    starting point holds; a new one is locked only then: a refused launch leaves the directory as
    it was."""
    run_dir = choose_run_dir(cfg)
    lock = RunLock(run_dir).acquire(announce=False) if run_dir.is_dir() else None
    try:
        start = find_starting_point(cfg, tokenizer_sha256, world_size, console.warn, run_dir)
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
    start.lock = lock
    return start


def agree_on_start(
    cfg: Config, rank: int, world_size: int, tokenizer_sha256: str, console: Console
) -> StartingPoint:
    """Rank 0 settles where the run starts and every rank receives the same, or raises the same error."""
    box: list[StartingPoint | LmsysError | None] = [None]
    lock = None
    if rank == 0:
        try:
            start = lock_starting_point(cfg, tokenizer_sha256, world_size, console)
            lock, start.lock = start.lock, None  # the lock stays with rank 0, out of the broadcast
            box[0] = start
        except LmsysError as exc:
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], LmsysError):
        raise box[0]
    assert box[0] is not None
    box[0].lock = lock
    return box[0]


def train_loader(cfg: Config, setup: Setup, data: PreparedData) -> TokenLoader:
    """This rank's share of the training split, cut as the batch split says: under sequence
    parallelism its group's (the groups are the loader's ranks; each rank's part of every sequence
    is the engine's to cut: lmsys.engine.sequence_parallel)."""
    batch = setup.batch
    return TokenLoader(
        data,
        "train",
        tokens_per_sample=batch.tokens_per_sample,
        global_batch_size=batch.global_batch_sequences,
        micro_batch_size=batch.micro_batch_size,
        rank=setup.rank // batch.sequence_parallel,
        world_size=batch.data_parallel,
        seed=cfg.trainer.seed,
        mask_doc_boundaries=cfg.data.mask_doc_boundaries,
        document_masking=cfg.data.document_masking,
    )


def new_train_state(cfg: Config, setup: Setup, tokenizer_sha256: str) -> ckpt.TrainState:
    """The train state of a run before its first step (a resume takes its counters from the checkpoint)."""
    return ckpt.TrainState(
        step=0,
        tokens_seen=0,
        nan_skips=0,
        last_loss=None,
        world_size=setup.world_size,
        zero_stage=cfg.deepspeed.stage,
        precision=setup.precision,
        tokenizer_sha256=tokenizer_sha256,
        wandb_id=None,
        config=config_to_dict(cfg),
    )


def first_model(
    cfg: Config, tokenizer_sha256: str, resume: ckpt.Checkpoint | None, note: Callable[[str], None]
) -> Transformer:
    """A new model, or with model.init_from the export's weights (unless the run resumes: then the
    checkpoint's weights win), before the engine wraps it."""
    init_from = cfg.model.init_from
    if init_from and resume is None:
        note(f"starting from the weights of model.init_from={init_from}")
        return initial_model(init_from, cfg.model, tokenizer_sha256)
    if init_from and resume is not None:
        note(f"resuming {resume.tag_dir}: model.init_from={init_from} is ignored")
    return Transformer(cfg.model)


def resume_notes(found: ckpt.Checkpoint, cfg: Config, setup: Setup, skipped: int) -> list[str]:
    """What a resume says: the checkpoint (and how it was resharded), the steps of data a rewind
    skipped, and what it continues (`cfg` with its schedule's horizon)."""
    saved, stage = found.state, cfg.deepspeed.stage
    how = ""
    if not ckpt.same_layout(saved, setup.world_size, stage, setup.precision):
        how = (
            f"; resharded from ZeRO-{saved.zero_stage} on {saved.world_size} rank(s), {saved.precision}, "
            f"to ZeRO-{stage} on {setup.world_size}, {setup.precision}"
        )
    notes = [f"resumed from {found.tag_dir} (step {saved.step}{how})"]
    if skipped:
        notes.append(f"never training on the data of {skipped} step(s) a rewind skipped")
    before = int(saved.config["trainer"]["max_steps"])
    now, horizon = cfg.trainer.max_steps, cfg.optim.decay_steps
    if now <= saved.step or now == before:
        return notes
    if now < before:
        return [*notes, f"trainer.max_steps lowered from {before} to {now}"]
    if horizon >= now:
        schedule = f"its cosine ends at step {horizon} (optim.decay_steps)"
    else:
        floor = cfg.optim.lr * cfg.optim.min_lr_ratio
        schedule = (
            f"the learning rate keeps its schedule: cosine to step {horizon}, then {floor:.2e} to "
            f"the end (optim.decay_steps={now} stretches the cosine over all {now} steps)"
        )
    return [*notes, f"trainer.max_steps extended from {before} to {now}; {schedule}"]


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
