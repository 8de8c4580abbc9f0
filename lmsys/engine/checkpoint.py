"""The checkpoint format: atomic, verified DeepSpeed checkpoints with a typed train state, and the
one rule that picks the checkpoint for resume, export, evaluation and generation alike.

Layout inside a run directory:

    checkpoints/
      step_0000100/                    one DeepSpeed tag: model, ZeRO optimizer partitions, ...
        mp_rank_00_model_states.pt     (DeepSpeed's files)
        zero_pp_rank_0_..._optim_states.pt
        rank_00000.json                each rank's loader position and RNG states
        lmsys_checkpoint.json          the completion marker, written last (see below)
      latest                           the newest saved tag, for DeepSpeed's own tools

The marker holds the format and its version, the tag, the save time, the `TrainState` (step,
tokens, losses, world size, ZeRO stage, precision, tokenizer sha256, W&B id, the resolved
config) and the size and sha256 of every other file of the tag.

How a checkpoint becomes visible, so that a kill -9 at any moment never leaves one that would
be picked up half-written:

1. every rank writes into `checkpoints/.tmp-step_0000100/` (DeepSpeed's save_checkpoint, then
   its own rank_*.json), and all ranks meet at a barrier;
2. rank 0 writes `lmsys_checkpoint.json` into it, fsyncs, and renames the directory to
   `step_0000100`;
3. `latest` is replaced atomically last; then `prune`: the newest trainer.keep_last complete,
   intact tags stay (and the one just written), older ones are deleted, and a damaged one (no
   marker, a missing or truncated file) is moved into `checkpoints/damaged/`, never counted.

A checkpoint never holds a non-finite value: `save` refuses (TrainingError, one line naming the
weight) when any rank's weights hold a NaN or inf, before anything is written.

`save` is the synchronous path (trainer.async_save=false). The asynchronous one
(lmsys/engine/async_save.py, the default) snapshots the state at the step boundary, writes the same
files in the background and commits through the same `commit`, once every rank's files are there.

Which checkpoint (`resolve`, `find_latest`): a checkpoint directory names itself, and must be
complete and intact; a run directory or its checkpoints/ directory means its newest complete,
intact `step_*`, every newer one that is not (no marker, a missing, truncated or altered file)
reported and skipped. `latest` is not consulted: after a fall-back it may name a damaged tag.

Resume (`load`) may change the world size, ZeRO stage and precision (lmsys.engine.reshard), not the
model, the tokenizer or the optimizer (`check_compatible`).
"""

from __future__ import annotations

import base64
import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lmsys.core.config import ModelConfig, flatten_dict, model_config_from_dict
from lmsys.core.errors import CheckpointError, ConfigError, NoSpaceError, TrainingError
from lmsys.core.files import (
    TMP_PREFIX,
    atomic_write_text,
    install_dir,
    sha256_file,
    space_checked,
    tree_bytes,
)
from lmsys.core.rundir import CHECKPOINTS, CONFIG_FILE, RUN_FILE, EvalRecord, read_records, run_dir_of
from lmsys.engine import zero_to_fp32
from lmsys.engine.reshard import load_resharded
from lmsys.engine.run_tokenizer import TOKENIZER_DIR, find_tokenizer
from lmsys.engine.zero import consolidated_state_dict, persistent_params_kept, safe_torch_load
from lmsys.model.weights import model_state_dict

MARKER = "lmsys_checkpoint.json"
RECOVERY_SCRIPT = "zero_to_fp32.py"  # in checkpoints/: lmsys.engine.zero_to_fp32
LATEST = "latest"
DAMAGED = "damaged"  # where pruning and resume move damaged checkpoints
FORMAT = "lmsys-checkpoint"
FORMAT_VERSION = 1


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def step_of(tag: str) -> int | None:
    if not tag.startswith("step_"):
        return None
    try:
        return int(tag[len("step_") :])
    except ValueError:
        return None


# ----------------------------------------------------------------------------- the train state


@dataclass
class TrainState:
    """What a checkpoint records beside DeepSpeed's tensors: the same on every rank."""

    step: int  # optimizer steps completed
    tokens_seen: int
    nan_skips: int  # steps skipped for a non-finite loss so far
    last_loss: float | None  # training loss of the last applied step
    world_size: int  # ranks that saved it
    zero_stage: int  # the ZeRO stage of its optimizer partitions
    precision: str  # fp32 | bf16 | fp16
    tokenizer_sha256: str  # of the tokenizer the training data was encoded with
    wandb_id: str | None  # the W&B run a resumed run continues
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config (config_to_dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: Path) -> TrainState:
        """The state of a marker; CheckpointError naming the first missing field."""
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: {MARKER} carries no train state")
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:
            raise CheckpointError(f"{where}: {MARKER} has no {missing[0]!r} in its train state")
        if not isinstance(data["config"], dict) or not isinstance(data["config"].get("model"), dict):
            raise CheckpointError(f"{where}: {MARKER} carries no training config")
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def model_config(self, where: Path) -> ModelConfig:
        try:
            return model_config_from_dict(self.config["model"])
        except ConfigError as exc:
            raise CheckpointError(f"checkpoint {where}: its model config is invalid: {exc}") from exc


# ----------------------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """Every RNG this process uses, JSON-able."""
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in torch.cuda.get_rng_state_all()
        ]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


# ----------------------------------------------------------------------------- save


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def nonfinite_weight(engine: Any) -> str | None:
    """The first weight of this rank's share of the engine (its partition at ZeRO-3) that holds a
    NaN or inf, by its name in the model; None when all are finite. Below ZeRO-3 every rank checks
    every weight: a copy corrupted on one rank only is caught too."""
    named = [(n, getattr(p, "ds_tensor", p)) for n, p in engine.module.named_parameters()]
    named = [(n, t) for n, t in named if t.is_floating_point() and t.numel()]
    if not named:
        return None
    # one fused reduction and one device sync: a norm is non-finite if any element is (or, rarely,
    # if huge finite values overflow it: then the exact check below clears the weight)
    norms = torch.stack(torch._foreach_norm([t for _, t in named]))  # (n_weights,)
    suspects = [nt for nt, ok in zip(named, torch.isfinite(norms).tolist()) if not ok]
    return next((n.removeprefix("model.") for n, t in suspects if not bool(torch.isfinite(t).all())), None)


def refuse_nonfinite(engine: Any, step: int, root: Path) -> None:
    """A checkpoint never holds a non-finite value: TrainingError (every rank alike) when a weight
    on any rank does."""
    mine = nonfinite_weight(engine)
    found = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    bad = [(rank, name) for rank, name in enumerate(found) if name is not None]
    if bad:
        rank, name = bad[0]
        raise TrainingError(
            f"refusing to save the checkpoint of step {step}: weight {name} holds NaN/inf (rank {rank}); "
            f"the last intact checkpoint stays the newest in {root}"
        )


def save(
    engine: Any,
    run_dir: Path,
    state: TrainState,
    rank_state: dict[str, Any],
    rank: int,
    keep_last: int,
    warn: Callable[[str], None] | None = None,
    pause_s: float = 0.0,
) -> Path:
    """Save the checkpoint of `state.step` atomically (see the module docstring). Every rank calls
    this. rank_state: JSON-able, this rank's own (loader position, RNG states). warn: reports
    damaged checkpoints that pruning moves aside. pause_s: fault injection, a sleep while the
    files are written but not committed (debug.save_delay_s). Returns the final
    checkpoint directory."""
    root = run_dir / CHECKPOINTS
    refuse_nonfinite(engine, state.step, root)
    tag = tag_for(state.step)
    tmp_tag = f"{TMP_PREFIX}{tag}"
    tmp_dir, final_dir = root / tmp_tag, root / tag
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp_dir.exists():  # a leftover of a killed save of this same step
            shutil.rmtree(tmp_dir)
    _barrier()
    needed, then = space_needed(root, engine, tag)
    failure = None
    try:
        with space_checked(root, needed, None, then), persistent_params_kept(engine):
            engine.save_checkpoint(str(root), tag=tmp_tag, client_state={}, save_latest=False)
            atomic_write_text(tmp_dir / f"rank_{rank:05d}.json", json.dumps(rank_state))
    except NoSpaceError as exc:
        failure = exc
    if pause_s > 0:
        time.sleep(pause_s)
    _agree_or_raise(failure, tmp_dir, rank)  # every rank raises the same error, the partial removed
    if rank == 0:
        try:
            with space_checked(root, needed, None, then):
                commit(root, state.step, state, keep_last, warn)
        except NoSpaceError as exc:
            failure = exc
    _agree_or_raise(failure, tmp_dir, rank)
    return final_dir


def space_needed(root: Path, engine: Any, tag: str) -> tuple[int, str]:
    """What a save of `tag` needs on disk (about) and, should the disk fill up, what its one line
    says after "no space left ...": what is kept and what to do."""
    newest = _newest_name(root)
    kept = f"{newest} stays the newest checkpoint" if newest else "no checkpoint kept"
    then = (
        f"checkpoint {tag} not saved (its partial files removed), {kept}; free space, then "
        "trainer.resume=auto continues"
    )
    return save_size(root, engine), then


def save_size(root: Path, engine: Any) -> int:
    """About how many bytes a checkpoint of this run takes: the newest one's size, else 16 bytes a
    parameter (fp32 weights, master weights and Adam's two moments)."""
    newest = _newest_name(root)
    if newest is not None:
        return tree_bytes(root / newest)
    return 16 * sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())


def _newest_name(root: Path) -> str | None:
    tags = sorted(
        (p.name for p in root.glob("step_*") if (p / MARKER).is_file()), key=lambda t: step_of(t) or -1
    )
    return tags[-1] if tags else None


def _agree_or_raise(failure: NoSpaceError | None, tmp_dir: Path, rank: int) -> None:
    """A barrier at which every rank learns whether any rank failed to write: then all of them
    raise the first failure (rank 0, the one that reports, included) once rank 0 removed the
    partial checkpoint, so no rank waits for another that left."""
    messages: list[str | None] = [str(failure) if failure is not None else None]
    if dist.is_initialized():
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, str(failure) if failure is not None else None)
    first = next((m for m in messages if m is not None), None)
    if first is None:
        return
    if rank == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    _barrier()
    raise NoSpaceError(first) from failure


def commit(
    root: Path, step: int, state: TrainState, keep_last: int, warn: Callable[[str], None] | None = None
) -> Path:
    """Rank 0, once every rank has written into `.tmp-<tag>`: write the marker (sizes and sha256
    of every file), rename the directory into place, move `latest`, prune old checkpoints."""
    tag = tag_for(step)
    tmp_dir, final_dir = root / f"{TMP_PREFIX}{tag}", root / tag
    files = {}
    for path in sorted(p for p in tmp_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(tmp_dir).as_posix()
        if rel != MARKER:
            files[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    marker = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "state": state.to_dict(),
        "files": files,
    }
    atomic_write_text(tmp_dir / MARKER, json.dumps(marker, indent=1))
    install_dir(tmp_dir, final_dir)  # replaces a damaged checkpoint of this step after a fall-back
    atomic_write_text(root / LATEST, tag)
    if (root / RECOVERY_SCRIPT).is_file():  # DeepSpeed's, written by every ZeRO save: lmsys's instead
        atomic_write_text(root / RECOVERY_SCRIPT, Path(zero_to_fp32.__file__).read_text(encoding="utf-8"))
        (root / RECOVERY_SCRIPT).chmod((root / RECOVERY_SCRIPT).stat().st_mode | 0o111)  # as DeepSpeed's
    prune(root, keep_last, keep=(final_dir,), warn=warn)
    return final_dir


def prune(
    root: Path, keep_last: int, keep: tuple[Path, ...] = (), warn: Callable[[str], None] | None = None
) -> None:
    """Keep the newest `keep_last` complete, intact checkpoints, and those in `keep` (the one just
    committed); delete the older ones. A damaged one (no marker, a missing or truncated file)
    counts for nothing and is moved aside into `damaged/`, reported through `warn`, never deleted.
    Stale temporaries are dropped.

    Pruning runs only after a newer checkpoint was committed, so the one a run resumed from stays
    until a newer one is complete. It checks markers and sizes, not hashes: every file's sha256
    was checked when it was written, and again by `find_latest` when a run resumes from it."""
    kept = 0
    for _, path in list_checkpoints(root):
        try:
            verify(path, check_hashes=False)
        except CheckpointError as exc:
            moved = move_aside(path)
            if warn is not None:
                warn(
                    f"checkpoint {path.name} is damaged ({exc}); "
                    f"moved it to {moved}, not counted in keep_last"
                )
            continue
        if path in keep or kept < keep_last:
            kept += 1
        else:
            shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(f"{TMP_PREFIX}*"):  # what a killed writer left: a tag or `latest` half-written
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def move_aside(path: Path) -> Path:
    """Move a damaged checkpoint tag into `damaged/` next to it (a free name), out of every
    listing; returns where it went. For the user to inspect and delete."""
    damaged = path.parent / DAMAGED
    damaged.mkdir(exist_ok=True)
    dest = damaged / path.name
    n = 1
    while dest.exists():
        dest, n = damaged / f"{path.name}.{n}", n + 1
    path.rename(dest)
    return dest


# ----------------------------------------------------------------------------- which checkpoint


@dataclass
class Checkpoint:
    """One complete, verified checkpoint tag."""

    tag_dir: Path
    state: TrainState
    run_dir: Path | None  # the run it belongs to (None for a tag copied elsewhere)

    @property
    def step(self) -> int:
        return self.state.step


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every `step_*` directory, newest first (complete or not)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        step = step_of(path.name)
        if step is not None and path.is_dir():
            found.append((step, path))
    return sorted(found, reverse=True)


def newest_saved(run_dir: Path, save_interval: int) -> str:
    """Where a stopped run's latest checkpoint is, for its last line (none may exist yet)."""
    saved = list_checkpoints(run_dir / CHECKPOINTS)
    if not saved:
        return f"no checkpoint was saved (trainer.save_interval={save_interval})"
    return f"the newest checkpoint is {saved[0][1]}"


def verify(path: Path, check_hashes: bool = True) -> dict[str, Any]:
    """Return the checkpoint's marker if every file it lists is present and intact; else raise
    CheckpointError saying what is wrong."""
    marker_path = path / MARKER
    if not marker_path.is_file():
        raise CheckpointError(f"{path} has no {MARKER} (the save did not finish)")
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{marker_path} is unreadable: {exc}") from exc
    if marker.get("format") != FORMAT or not isinstance(marker.get("files"), dict):
        raise CheckpointError(f"{marker_path} is not an lmsys checkpoint marker")
    if int(marker.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{marker_path} has format version {marker['format_version']}, newer than this lmsys reads "
            f"({FORMAT_VERSION}); update lmsys"
        )
    for rel, meta in marker["files"].items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"{path}: {rel} is missing")
        size = file.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"{path}: {rel} has {size} bytes, expected {meta['bytes']} (truncated?)")
        if check_hashes and sha256_file(file) != meta["sha256"]:
            raise CheckpointError(f"{path}: {rel} does not match its sha256 (corrupted)")
    return marker


def _is_tag_dir(path: Path) -> bool:
    return (path / MARKER).is_file() or any(path.glob("*model_states.pt"))


def _open(tag_dir: Path, check_hashes: bool) -> Checkpoint:
    marker = verify(tag_dir, check_hashes=check_hashes)
    return Checkpoint(tag_dir, TrainState.from_dict(marker.get("state"), tag_dir), run_dir_of(tag_dir))


def _newest_intact(run: Path, check_hashes: bool) -> tuple[Checkpoint | None, list[tuple[Path, str]]]:
    """The newest complete, intact checkpoint under a run (or its checkpoints/ directory), and
    each newer one that was passed over, with why."""
    root = run / CHECKPOINTS if (run / CHECKPOINTS).is_dir() else run
    passed_over: list[tuple[Path, str]] = []
    for _, path in list_checkpoints(root):
        try:
            return _open(path, check_hashes), passed_over
        except CheckpointError as exc:
            passed_over.append((path, f"checkpoint {path.name}: {exc}"))
    return None, passed_over


def find_latest(
    run: Path, warn: Callable[[str], None], check_hashes: bool = True, damaged: list[Path] | None = None
) -> Checkpoint | None:
    """The newest complete, intact checkpoint of a run directory (or of its checkpoints/
    directory), or None when it has none. Every newer checkpoint that is partial or damaged is
    reported through `warn`, skipped, and appended to `damaged` (for `move_aside`)."""
    found, passed_over = _newest_intact(run, check_hashes)
    for path, reason in passed_over:
        warn(f"skipping {reason}; falling back to the previous one")
        if damaged is not None:
            damaged.append(path)
    return found


def resolve(
    path: str | Path, warn: Callable[[str], None] | None = None, check_hashes: bool = True
) -> Checkpoint:
    """The checkpoint `path` names (see the module docstring); CheckpointError when there is
    none, saying why. Damaged checkpoints newer than the one chosen are reported through `warn`."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} {'is not a directory' if p.exists() else 'does not exist'}")
    if _is_tag_dir(p):
        return _open(p, check_hashes)
    found, passed_over = _newest_intact(p, check_hashes)
    if found is None and passed_over:
        raise CheckpointError(f"{p} holds no usable checkpoint: {passed_over[0][1]}")
    if found is None and any((p / name).exists() for name in (RUN_FILE, CONFIG_FILE, CHECKPOINTS)):
        raise CheckpointError(
            f"run directory {p} has no checkpoint yet (a run saves one every trainer.save_interval "
            "steps and when it ends or is stopped); train it further, or name a checkpoint directory"
        )
    if found is None:
        raise CheckpointError(
            f"{p} is not a checkpoint: expected a run directory, its {CHECKPOINTS}/ directory, or a "
            f"checkpoint directory holding {MARKER}"
        )
    for _, reason in passed_over:
        if warn is not None:
            warn(f"skipping {reason}; using {found.tag_dir.name}")
    return found


# ----------------------------------------------------------------------------- resume


# Model keys that choose an implementation, or the weights a run started from, not the
# function: changing them on resume is fine.
_RUNTIME_MODEL_KEYS = frozenset({"model.kernels", "model.loss_impl", "model.init_from"})


def model_differences(
    saved: dict[str, Any] | None, now: dict[str, Any], label: str, ignore: frozenset[str] = frozenset()
) -> str | None:
    """How two model config dicts differ in function (beyond _RUNTIME_MODEL_KEYS and `ignore`),
    as `model.key=now (label: saved)`, at most four and a count; None when they do not."""
    skip = _RUNTIME_MODEL_KEYS | ignore
    saved_flat = {k: v for k, v in flatten_dict({"model": saved}).items() if k not in skip}
    now_flat = {k: v for k, v in flatten_dict({"model": now}).items() if k not in skip}
    diffs = [
        f"{k}={now_flat.get(k)!r} ({label}: {saved_flat.get(k)!r})"
        for k in sorted(set(saved_flat) | set(now_flat))
        if saved_flat.get(k) != now_flat.get(k)
    ]
    if not diffs:
        return None
    return ", ".join(diffs[:4]) + (f" and {len(diffs) - 4} more" if len(diffs) > 4 else "")


def check_compatible(
    state: TrainState, model_dict: dict[str, Any], tokenizer_sha256: str, optimizer: str | None = None
) -> None:
    """Refuse (CheckpointError) a resume whose model function, tokenizer or optimizer (optim.name)
    differs. The world size, ZeRO stage, precision and micro-batch size may change (`load`
    reshards); the global batch may not (the batch plan and the loader refuse it)."""
    shown = model_differences(state.config.get("model"), model_dict, "checkpoint")
    if shown:
        raise CheckpointError(f"cannot resume: the model differs from the checkpoint's: {shown}")
    saved_optimizer = (state.config.get("optim") or {}).get("name")
    if optimizer is not None and saved_optimizer is not None and saved_optimizer != optimizer:
        # AdamW's moments and Muon's momentum are different state: neither can continue the other
        raise CheckpointError(
            f"cannot resume: the checkpoint was trained with optim={saved_optimizer}, this run asks for "
            f"optim={optimizer}, and one optimizer's state cannot continue the other's; resume with "
            f"optim={saved_optimizer}, or export the checkpoint and start a new run from its weights "
            f"with optim={optimizer} model.init_from=<the export>"
        )
    if state.tokenizer_sha256 != tokenizer_sha256:
        data_dir = (state.config.get("data") or {}).get("dir")
        run_dir = (state.config.get("trainer") or {}).get("run_dir") or "<the run directory>"
        raise CheckpointError(
            f"cannot resume: the data's tokenizer (sha256 {tokenizer_sha256[:12]}) differs from the "
            f"checkpoint's ({state.tokenizer_sha256[:12]}): the data was prepared again, or is another "
            f"corpus (the run trained on data.dir={data_dir}); prepare the run's sources into a new "
            f"data.dir with data.tokenizer={run_dir}/{TOKENIZER_DIR} (the copy of its tokenizer the "
            "run keeps) and resume with that data.dir"
        )


def same_layout(state: TrainState, world_size: int, stage: int, precision: str) -> bool:
    """Whether this run's engine partitions the state exactly as the checkpoint's did."""
    return (state.zero_stage, state.world_size, state.precision) == (stage, world_size, precision)


def load(engine: Any, found: Checkpoint, world_size: int, stage: int, precision: str) -> None:
    """Load module and optimizer state of a verified checkpoint into the engine (every rank).

    The same ZeRO stage, world size and precision: DeepSpeed's own loader, each rank reading its
    partition. Anything else: lmsys.engine.reshard assembles each parameter's fp32 master weights and
    Adam state from the saved partitions and copies this rank's slice into the engine. Both read
    weights-only: a checkpoint never runs code."""
    saved = found.state
    if not same_layout(saved, world_size, stage, precision):
        load_resharded(engine, found.tag_dir, saved.zero_stage, saved.world_size)
        return
    checkpoint_engine = engine.checkpoint_engine
    checkpoint_engine.load = lambda path, map_location=None: safe_torch_load(path, map_location=map_location)
    try:
        load_path, _ = engine.load_checkpoint(
            str(found.tag_dir.parent),
            tag=found.tag_dir.name,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
    finally:
        del checkpoint_engine.load  # the instance attribute shadowed DeepSpeed's unpickling loader
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {found.tag_dir}")


def read_rank_state(found: Checkpoint, rank: int, world_size: int) -> dict[str, Any]:
    """The loader position and RNG states rank `rank` of `world_size` continues from: its own on
    the same world size; rank 0's on another (checkpoints are taken between optimizer steps, where
    every rank's loader holds the same stream position; the ranks' RNGs are seeded alike)."""
    source = rank if world_size == found.state.world_size else 0
    return json.loads((found.tag_dir / f"rank_{source:05d}.json").read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------- reading one back


@dataclass
class LoadedCheckpoint:
    """What the tools need of a checkpoint: its model, weights, tokenizer and provenance."""

    cfg: ModelConfig
    state: dict[str, torch.Tensor]  # Transformer keys, tied embedding once, fp32
    tokenizer_path: Path
    info: dict[str, Any] = field(default_factory=dict)  # provenance, for a model card
    train_config: dict[str, Any] = field(default_factory=dict)  # the run's resolved config


def read_checkpoint(path: str | Path | Checkpoint, tokenizer: str | Path | None = None) -> LoadedCheckpoint:
    """A checkpoint's model config, consolidated weights (any ZeRO stage and world size),
    tokenizer and provenance; nothing is written."""
    ckpt = path if isinstance(path, Checkpoint) else resolve(path)
    cfg = ckpt.state.model_config(ckpt.tag_dir)
    data = ckpt.state.config.get("data") or {}
    tokenizer_path = find_tokenizer(ckpt.state.tokenizer_sha256, data, ckpt.tag_dir, ckpt.run_dir, tokenizer)
    weights = model_state_dict(consolidated_state_dict(ckpt.tag_dir, ckpt.state.zero_stage), cfg)
    return LoadedCheckpoint(cfg, weights, tokenizer_path, provenance(ckpt), ckpt.state.config)


def provenance(ckpt: Checkpoint) -> dict[str, Any]:
    """Where a checkpoint's weights came from, for an export's model card: steps, tokens, the
    final training and validation losses (from the run's metrics up to its step)."""
    state = ckpt.state
    info: dict[str, Any] = {
        "step": state.step,
        "tokens_seen": state.tokens_seen,
        "trained_seq_len": (state.config.get("data") or {}).get("seq_len"),  # lmsys.inference.lengths
        "train_loss": state.last_loss,
        "val_loss": None,
        "val_step": None,
        "zero_stage": state.zero_stage,
        "world_size": state.world_size,
        "precision": state.precision,
        "tokenizer_sha256": state.tokenizer_sha256,
        "source": str(ckpt.tag_dir),
        "run": ckpt.run_dir.name if ckpt.run_dir is not None else None,
        "run_dir": str(ckpt.run_dir.resolve()) if ckpt.run_dir is not None else None,
    }
    if ckpt.run_dir is not None:
        evals = [
            r
            for r in read_records(ckpt.run_dir, EvalRecord)
            if isinstance(r.loss, (int, float)) and r.step <= state.step
        ]
        if evals:
            info["val_loss"], info["val_step"] = evals[-1].loss, evals[-1].step
    return info
