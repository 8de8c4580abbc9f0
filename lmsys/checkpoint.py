"""Atomic, resumable DeepSpeed checkpoints.

Layout inside a run directory:

    checkpoints/
      step_0000100/                    one DeepSpeed tag: model, ZeRO optimizer partitions, ...
        mp_rank_00_model_states.pt     (DeepSpeed's files; client state included)
        zero_pp_rank_0_..._optim_states.pt
        rank_00000.json                each rank's loader position and RNG states
        lmsys_checkpoint.json          the completion marker, written last (see below)
      latest                           the newest complete tag (DeepSpeed's convention)

How a checkpoint becomes visible, so that a kill -9 at any moment never leaves one that resume
would pick up half-written:

1. every rank writes into `checkpoints/.tmp-step_0000100/` (DeepSpeed's save_checkpoint, then
   its own rank_*.json), and all ranks meet at a barrier;
2. rank 0 writes `lmsys_checkpoint.json` (the client state plus the size and sha256 of every
   file) into it, fsyncs, and renames the directory to `step_0000100`;
3. `latest` is replaced atomically (write a temporary file, rename) last; old tags beyond
   trainer.keep_last are deleted.

Resume picks the newest `step_*` whose marker exists and whose files match it; anything else
(no marker, a missing, truncated or altered file, a `.tmp-*` leftover) is skipped with a warning,
falling back to the previous checkpoint.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINTS = "checkpoints"
MARKER = "lmsys_checkpoint.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
FORMAT = "lmsys-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for this run; the message is one line saying why."""


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def step_of(tag: str) -> int | None:
    if not tag.startswith("step_"):
        return None
    try:
        return int(tag[len("step_") :])
    except ValueError:
        return None


# ----------------------------------------------------------------------------- small file helpers


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so a reader sees either the old file or the whole new one."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def save(
    engine: Any,
    run_dir: Path,
    step: int,
    client_state: dict[str, Any],
    rank_state: dict[str, Any],
    rank: int,
    keep_last: int,
) -> Path:
    """Save a checkpoint of `step` atomically (see the module docstring). Every rank calls this.

    client_state: JSON-able, the same on every rank (step, config, tokenizer sha256, ...);
    rank_state: JSON-able, this rank's own (loader position, RNG states).
    Returns the final checkpoint directory.
    """
    root = run_dir / CHECKPOINTS
    tag = tag_for(step)
    tmp_tag = f"{TMP_PREFIX}{tag}"
    tmp_dir, final_dir = root / tmp_tag, root / tag
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp_dir.exists():  # a leftover of a killed save of this same step
            shutil.rmtree(tmp_dir)
    _barrier()
    engine.save_checkpoint(str(root), tag=tmp_tag, client_state={"lmsys": client_state}, save_latest=False)
    atomic_write_text(tmp_dir / f"rank_{rank:05d}.json", json.dumps(rank_state))
    _barrier()
    if rank == 0:
        commit(root, step, client_state, keep_last)
    _barrier()
    return final_dir


def commit(root: Path, step: int, client_state: dict[str, Any], keep_last: int) -> Path:
    """Rank 0, once every rank has written into `.tmp-<tag>`: write the marker (sizes and sha256
    of every file), rename the directory into place, move `latest`, prune old checkpoints."""
    tag = tag_for(step)
    tmp_dir, final_dir = root / f"{TMP_PREFIX}{tag}", root / tag
    files = {}
    for path in sorted(p for p in tmp_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(tmp_dir).as_posix()
        if rel != MARKER:
            files[rel] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    marker = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "state": client_state,
        "files": files,
    }
    atomic_write_text(tmp_dir / MARKER, json.dumps(marker, indent=1))
    if final_dir.exists():  # re-saving a step after falling back past a bad checkpoint
        stale = root / f"{TMP_PREFIX}stale-{tag}"
        if stale.exists():
            shutil.rmtree(stale)
        os.rename(final_dir, stale)
        os.rename(tmp_dir, final_dir)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(tmp_dir, final_dir)
    _fsync_dir(root)
    atomic_write_text(root / LATEST, tag)
    prune(root, keep_last)
    return final_dir


def prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; drop older ones and stale temporaries."""
    complete = [(s, p) for s, p in list_checkpoints(root) if (p / MARKER).is_file()]
    for _, path in complete[keep_last:]:
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(f"{TMP_PREFIX}*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- find / verify


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
    for rel, meta in marker["files"].items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"{path}: {rel} is missing")
        size = file.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"{path}: {rel} has {size} bytes, expected {meta['bytes']} (truncated?)")
        if check_hashes and file_sha256(file) != meta["sha256"]:
            raise CheckpointError(f"{path}: {rel} does not match its sha256 (corrupted)")
    return marker


def find_latest(run_dir: Path, warn: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete, intact checkpoint of a run, or None. Every newer checkpoint that is
    partial or corrupted is reported through `warn` and skipped."""
    for _, path in list_checkpoints(run_dir / CHECKPOINTS):
        try:
            return path, verify(path)
        except CheckpointError as exc:
            warn(f"skipping checkpoint {path.name}: {exc}; falling back to the previous one")
    return None


def load_explicit(path: Path) -> tuple[Path, dict[str, Any]]:
    """trainer.resume=<checkpoint dir>: that directory, which must be complete and intact."""
    if not path.is_dir():
        raise CheckpointError(f"trainer.resume={path} is not a checkpoint directory")
    return path, verify(path)


# ----------------------------------------------------------------------------- compatibility


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


# Model keys that choose an implementation, not the function: changing them on resume is fine.
_RUNTIME_MODEL_KEYS = {"model.kernels"}


def check_compatible(
    state: dict[str, Any], model_dict: dict[str, Any], tokenizer_sha256: str, world_size: int, stage: int
) -> None:
    """Refuse (CheckpointError) a resume whose model function, tokenizer or ZeRO layout differs."""
    saved = {
        k: v for k, v in _flatten({"model": state["config"]["model"]}).items() if k not in _RUNTIME_MODEL_KEYS
    }
    now = {k: v for k, v in _flatten({"model": model_dict}).items() if k not in _RUNTIME_MODEL_KEYS}
    diffs = [
        f"{k}={now.get(k)!r} (checkpoint: {saved.get(k)!r})"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k)
    ]
    if diffs:
        shown = ", ".join(diffs[:4]) + (f" and {len(diffs) - 4} more" if len(diffs) > 4 else "")
        raise CheckpointError(f"cannot resume: the model differs from the checkpoint's: {shown}")
    if state.get("tokenizer_sha256") != tokenizer_sha256:
        raise CheckpointError(
            f"cannot resume: the data's tokenizer (sha256 {tokenizer_sha256[:12]}) differs from the "
            f"checkpoint's ({str(state.get('tokenizer_sha256'))[:12]}); use the data.dir it was trained on"
        )
    saved_stage, saved_world = int(state["zero_stage"]), int(state["world_size"])
    if (saved_stage, saved_world) != (stage, world_size) and not (saved_stage == 0 and stage == 0):
        raise CheckpointError(
            f"cannot resume: the checkpoint holds ZeRO stage {saved_stage} state of {saved_world} ranks, "
            f"this run is stage {stage} on {world_size}; resume with deepspeed.stage={saved_stage} "
            f"on {saved_world} processes"
        )


# ----------------------------------------------------------------------------- load


def load(engine: Any, path: Path) -> None:
    """Load module and optimizer state of a verified checkpoint into the engine (every rank)."""
    load_path, _ = engine.load_checkpoint(
        str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {path}")


def read_rank_state(path: Path, rank: int) -> dict[str, Any]:
    return json.loads((path / f"rank_{rank:05d}.json").read_text(encoding="utf-8"))
