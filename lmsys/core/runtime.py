"""Where and how a job runs, resolved once: the device, the numeric precision, the batch split.

Every command turns its device / dtype / precision setting into torch objects here, and the
trainer turns `trainer.global_batch_tokens` into its batch arithmetic here, so a setting is read
in one place and the rest of the code receives resolved values.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from lmsys.core.choices import DTYPE_NAMES
from lmsys.core.config import Config, divisors, either, tokens_per_sample, validate_sequence_parallel
from lmsys.core.errors import ConfigError, UsageError

DTYPES: dict[str, torch.dtype] = dict(
    zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16), strict=True)
)
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# ----------------------------------------------------------------------------- device and dtype


def resolve_device(choice: str | None, local_rank: int = 0, key: str = "device") -> torch.device:
    """`auto` (CUDA when available, else the CPU), `cpu`, `cuda` (this process's GPU under
    torchrun: cuda:<local_rank>) or `cuda:N`. `key` names the setting in errors."""
    choice = choice or "auto"
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{key}={choice} but no CUDA device is available; use {key}=auto or cpu")
    if choice == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    try:
        return torch.device(choice)
    except RuntimeError:
        raise ConfigError(f"{key}={choice!r} is not valid; use auto, cpu, cuda or cuda:N") from None


def resolve_dtype(name: str | None) -> torch.dtype:
    """fp32 | bf16 | fp16 (or torch's names float32, bfloat16, float16) as a torch dtype."""
    key = DTYPE_ALIASES.get(str(name), str(name))
    if key not in DTYPES:
        raise UsageError(f"dtype={name!r} is not valid; choose one of: {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def resolve_precision(choice: str, device: torch.device) -> str:
    """deepspeed.precision: auto is bf16 on CUDA and fp32 on the CPU; fp16 needs CUDA."""
    if choice == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if choice == "fp16" and device.type != "cuda":
        raise ConfigError("deepspeed.precision=fp16 needs a CUDA device; use fp32 or bf16 on CPU")
    return choice


def make_deterministic() -> None:
    """trainer.deterministic=true: every op of this process computes the same bits from the same
    inputs. Before CUDA starts: cuBLAS needs a fixed workspace (CUBLAS_WORKSPACE_CONFIG, read
    when its handle is created) to pick one reduction order. torch then uses its deterministic
    kernels and raises at the first op that has none (the error names it); cuDNN stops
    benchmarking algorithms. The Triton attention kernels see the mode and launch one fixed tiling
    instead of the autotuner's fastest (kernels/flash_attention.py); the other kernels have fixed
    tilings, and none uses atomics."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (every rank alike: identical initial weights)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------- ranks


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int


def env_dist_info() -> DistInfo:
    """Rank and world size as torchrun sets them (a plain `python -m lmsys.train` is rank 0 of 1)."""
    return DistInfo(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )


@dataclass(frozen=True)
class Setup:
    """A training process's resolved runtime: decided once, then handed down."""

    device: torch.device
    precision: str  # fp32 | bf16 | fp16 (deepspeed.precision resolved for the device)
    rank: int
    world_size: int
    batch: BatchSplit


# ----------------------------------------------------------------------------- batch arithmetic


@dataclass(frozen=True)
class SequenceShard:
    """Where a rank's part of every sequence lies under sequence parallelism: rank `index` of a
    group of `size` holds positions [index * T / size, (index + 1) * T / size) of each row of T."""

    index: int = 0
    size: int = 1

    def start(self, length: int) -> int:
        """The first position of this rank's part of rows of `length` positions."""
        return self.index * (length // self.size)

    def part(self, rows: torch.Tensor) -> torch.Tensor:  # (B, T, ...) -> (B, T / size, ...)
        """This rank's positions of `rows`."""
        width = rows.shape[1] // self.size
        return rows[:, self.index * width : (self.index + 1) * width]


@dataclass(frozen=True)
class BatchSplit:
    """How one optimizer step's sequences are cut into micro-batches across ranks (and, with
    sequence parallelism, every sequence across the ranks of a group)."""

    seq_len: int  # positions per forward
    tokens_per_sample: int  # tokens the loader cuts per sequence (seq_len + 1 with the usual shift)
    micro_batch_size: int  # sequences per rank per forward
    world_size: int
    grad_accum: int  # micro-batches per rank per optimizer step
    global_batch_sequences: int  # = micro_batch_size * world_size / sequence_parallel * grad_accum
    # ranks per sequence-parallel group (trainer.sequence_parallel): each holds seq_len / it positions
    sequence_parallel: int = 1

    @property
    def data_parallel(self) -> int:
        """Groups that read different sequences: the world size over the sequence-parallel size."""
        return self.world_size // self.sequence_parallel

    @property
    def rank_tokens(self) -> int:
        """Positions one rank holds per forward: its activations' and its FLOPs' count (the
        attention of each still reads the whole sequence's keys)."""
        return self.micro_batch_size * self.seq_len // self.sequence_parallel

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_sequences * self.seq_len

    def shard(self, rank: int) -> SequenceShard:
        """Rank `rank`'s part of every sequence: groups are consecutive ranks (DeepSpeed's layout)."""
        return SequenceShard(rank % self.sequence_parallel, self.sequence_parallel)

    def arithmetic(self) -> str:
        ranks = f"world {self.world_size}"
        if self.sequence_parallel > 1:
            ranks = f"world {self.world_size} / sequence parallel {self.sequence_parallel}"
        return (
            f"{self.tokens_per_step:,} tokens per step = micro {self.micro_batch_size} x seq {self.seq_len} "
            f"x {ranks} x accumulation {self.grad_accum}"
        )


def split_batch(cfg: Config, world_size: int) -> BatchSplit:
    """`trainer.global_batch_tokens / data.seq_len` sequences per optimizer step, split into
    `micro_batch_size` sequences per group of `trainer.sequence_parallel` ranks (one rank without
    sequence parallelism) per forward: gradient accumulation is derived, never configured.
    ConfigError, naming a value that works, when the numbers do not divide."""
    t, seq, p = cfg.trainer, cfg.data.seq_len, cfg.trainer.sequence_parallel
    if world_size % p:
        raise ConfigError(
            f"trainer.sequence_parallel={p} does not divide the world size {world_size}: the ranks form "
            f"groups of {p}; launch a multiple of {p} ranks or use trainer.sequence_parallel="
            f"{either(divisors(world_size))}"
        )
    if t.global_batch_tokens % seq:
        lower, upper = (t.global_batch_tokens // seq) * seq, (t.global_batch_tokens // seq + 1) * seq
        raise ConfigError(
            f"trainer.global_batch_tokens={t.global_batch_tokens} is not a multiple of data.seq_len={seq}; "
            f"use e.g. {lower or upper} or {upper}"
        )
    sequences = t.global_batch_tokens // seq
    per_micro_step = t.micro_batch_size * world_size // p
    if sequences % per_micro_step:
        k = max(1, round(sequences / per_micro_step))
        ranks = f"world_size={world_size}"
        if p > 1:
            ranks = f"world_size={world_size} / trainer.sequence_parallel={p}"
        raise ConfigError(
            f"trainer.global_batch_tokens={t.global_batch_tokens} gives {sequences} sequences per step "
            f"({t.global_batch_tokens} / data.seq_len={seq}), which does not divide by "
            f"trainer.micro_batch_size={t.micro_batch_size} x {ranks} = {per_micro_step}; "
            f"use a multiple of {per_micro_step * seq} tokens, "
            f"e.g. trainer.global_batch_tokens={k * per_micro_step * seq}"
        )
    return BatchSplit(
        seq_len=seq,
        tokens_per_sample=tokens_per_sample(cfg.model, seq),
        micro_batch_size=t.micro_batch_size,
        world_size=world_size,
        grad_accum=sequences // per_micro_step,
        global_batch_sequences=sequences,
        sequence_parallel=p,
    )


def sequence_parallel_sizes(cfg: Config, world_size: int) -> list[int]:
    """The values trainer.sequence_parallel may take for cfg's model, data.seq_len, global batch
    and micro-batch on `world_size` ranks, smallest first (1 among them when the batch splits)."""
    sizes = []
    for p in divisors(world_size):
        try:
            validate_sequence_parallel(p, cfg.model, cfg.data.seq_len)
            split_batch(replace(cfg, trainer=replace(cfg.trainer, sequence_parallel=p)), world_size)
        except ConfigError:
            continue
        sizes.append(p)
    return sizes


def resume_batch_split(cfg: Config, world_size: int, step: int) -> BatchSplit:
    """The batch split of a run resuming the checkpoint of `step` on `world_size` ranks. A resumed
    run keeps its global batch (the loader's saved position counts its sequences), but may change
    the world size, the micro-batch size and the sequence-parallel size: ConfigError naming those
    that fit when they do not."""
    try:
        return split_batch(cfg, world_size)
    except ConfigError:
        if world_size % cfg.trainer.sequence_parallel:
            raise
    t = cfg.trainer
    sequences, micro, p = t.global_batch_tokens // cfg.data.seq_len, t.micro_batch_size, t.sequence_parallel
    groups = world_size // p
    fits = []
    if sequences % micro == 0:
        worlds = either([d * p for d in divisors(sequences // micro)])
        fits.append(f"keep trainer.micro_batch_size={micro} on {worlds} ranks")
    if sequences % groups == 0:
        micros = either(divisors(sequences // groups))
        fits.append(f"use trainer.micro_batch_size={micros} on {world_size} ranks")
    cut = f"micro-batches of {micro} on {world_size} ranks"
    if p > 1:
        cut = f"micro-batches of {micro} on {groups} groups of {p} ranks (trainer.sequence_parallel={p})"
    raise ConfigError(
        f"cannot resume step {step} on {world_size} ranks: its global batch of {sequences} sequences "
        f"(trainer.global_batch_tokens={t.global_batch_tokens} / data.seq_len={cfg.data.seq_len}) "
        f"does not split into {cut}; "
        f"{', or '.join(fits) or 'change the world size'} (a resumed run keeps trainer.global_batch_tokens)"
    )


# ----------------------------------------------------------------------------- CPU oversubscription


def _other_training_processes(ppid: int) -> int:
    """lmsys training processes on this machine outside this job (not this process, not its
    torchrun siblings, which share its parent): Linux's /proc, 0 elsewhere."""
    count = 0
    for entry in Path("/proc").glob("[0-9]*"):
        if int(entry.name) in (os.getpid(), ppid):
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            stat = (entry / "stat").read_text()
        except OSError:  # gone, or not ours to read
            continue
        if b"lmsys.train" not in cmdline and b"lmsys-train" not in cmdline:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # field 4 of /proc/<pid>/stat
        if parent != ppid:
            count += 1
    return count


def oversubscription(device: torch.device) -> str | None:
    """A warning when this machine's cores are oversubscribed on CPU: this job's local processes
    x torch threads, plus other lmsys training processes running here (one thread each at least),
    more than the cores. Two runs that each use every core run many times slower than one."""
    if device.type != "cpu":
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = torch.get_num_threads()
    others = _other_training_processes(os.getppid())
    if local * threads + others <= cores:
        return None
    mine = f"{local} process(es) x {threads} torch threads"
    also = f" beside {others} other lmsys training process(es)" if others else ""
    fix = (
        f"set OMP_NUM_THREADS={max(1, cores // (local + others))}" if local * threads > 1 else "wait for them"
    )
    return f"{mine}{also} on {cores} cores: steps will be many times slower; {fix}"
