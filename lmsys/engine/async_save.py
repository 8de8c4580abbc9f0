"""Asynchronous checkpoint saves: the loop stalls only while the state is copied to host memory.

How one save goes (every rank; lmsys/engine/checkpoint.py owns the format and the commit):

1. at the step boundary, `AsyncSaver.start` waits for the previous save if it is still in flight
   (at most one at a time), then runs DeepSpeed's `save_checkpoint` into `.tmp-<tag>` with a
   `SnapshotCheckpointEngine`: DeepSpeed builds its state dicts as always, and each
   `save(state_dict, path)` copies every tensor storage to host memory (pinned on CUDA) instead of
   writing it. The loop goes on;
2. a writer thread `torch.save`s the snapshots and the rank's own JSON (loader, RNG) into the
   temporary directory;
3. the ranks report their files (name, size) to rank 0 over a gloo group of their own (never the
   loop's); rank 0 checks that every file is there at its size, then `checkpoint.commit` hashes
   them into the marker, renames the directory into place, moves `latest` and prunes.

Nothing is visible before step 3 completes: a kill at any moment leaves at most a `.tmp-*`
directory, which no reader lists and the next commit removes. Why this and not DeepSpeed's
decoupled engine or torch DCP's async_save: docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmsys.core.errors import CheckpointError, LmsysError, NoSpaceError
from lmsys.core.files import TMP_PREFIX, atomic_write_text, space_checked
from lmsys.core.rundir import CHECKPOINTS
from lmsys.engine import checkpoint as ckpt
from lmsys.engine.zero import persistent_params_kept, safe_torch_load

# ----------------------------------------------------------------------------- host snapshots


class HostBuffers:
    """Host memory for snapshots, kept from one save to the next (a model's storages have the same
    sizes every time; pinned allocations are slow). On CUDA the buffers are pinned, so the copies
    from the device run asynchronously."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()  # the writer thread gives buffers back

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            pool = self._free.get(nbytes)
            if pool:
                return pool.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)  # (nbytes,) uint8

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        """`buffers` are free again (their save was written)."""
        with self._lock:
            for buf in buffers:
                self._free.setdefault(buf.numel(), []).append(buf)


class Snapshot:
    """A copy of state dicts in host memory, with the storage sharing of the originals: views of
    one storage stay views of one copy, so `torch.save` writes the bytes a save of the live
    tensors would have written."""

    def __init__(self, buffers: HostBuffers) -> None:
        self.buffers = buffers
        # keyed like torch.save's own de-duplication: the storage's C++ object
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._tensors: dict[int, torch.Tensor] = {}  # id(original) -> copy
        self._memo: dict[int, Any] = {}  # id(original container) -> copy
        self.alive: list[Any] = []  # the originals, so that their ids stay theirs while copying
        self.lent: list[torch.Tensor] = []  # the buffers, for `HostBuffers.give_back` once written
        self.nbytes = 0
        self.event: Any = None  # a CUDA event after the last device copy

    def _storage(self, t: torch.Tensor) -> torch.UntypedStorage:
        src = t.untyped_storage()
        key = src._cdata
        if key not in self._storages:
            buf = self.buffers.take(src.nbytes())
            self.lent.append(buf)
            source = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src)  # (nbytes,) uint8
            buf.copy_(source, non_blocking=src.device.type == "cuda")
            self._storages[key] = buf.untyped_storage()
            self.nbytes += src.nbytes()
        return self._storages[key]

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self._tensors:
            return self._tensors[id(t)]
        plain = t.detach()
        host = torch.empty(0, dtype=plain.dtype).set_(
            self._storage(plain), plain.storage_offset(), plain.size(), plain.stride()
        )
        if isinstance(t, torch.nn.Parameter):
            host = torch.nn.Parameter(host, requires_grad=t.requires_grad)
        elif t.requires_grad:
            host.requires_grad_(True)  # torch.save records the flag
        if t.__dict__:  # attributes torch.save pickles with the tensor
            host.__dict__.update(self.take(dict(t.__dict__)))
        self._tensors[id(t)] = host
        self._memo[id(t)] = host
        return host

    def take(self, obj: Any) -> Any:
        """`obj` with every tensor replaced by its host copy; other values as they are now. An
        object met twice is copied once (pickle's memo then writes it once, as for the original)."""
        if id(obj) in self._memo:
            return self._memo[id(obj)]
        if torch.is_tensor(obj):
            return self.tensor(obj)
        if obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return obj
        if isinstance(obj, dict):
            copied = type(obj)()
            self._memo[id(obj)] = copied
            for key, value in obj.items():
                copied[key] = self.take(value)
            if type(obj) is not dict and obj.__dict__:  # e.g. a state dict's `_metadata`
                copied.__dict__.update(copy.deepcopy(obj.__dict__))
        elif isinstance(obj, list):
            copied = []
            self._memo[id(obj)] = copied
            copied.extend(self.take(v) for v in obj)
        elif isinstance(obj, tuple):
            items = [self.take(v) for v in obj]
            copied = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # torch.Size too
        else:
            # DeepSpeed's small objects (loss scalers, enums, fragment addresses): their state now,
            # with any tensor inside copied like the others
            copied = copy.deepcopy(obj, dict(self._tensors))
        self._memo[id(obj)] = copied
        return copied

    def fence(self) -> None:
        """On CUDA: an event after the last copy; the writer waits on it, the loop does not."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record()

    def wait_copied(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class SnapshotCheckpointEngine:
    """A DeepSpeed checkpoint engine (the interface of deepspeed.runtime.checkpoint_engine) whose
    `save` snapshots a state dict to host memory instead of writing it; `take_files` hands the
    snapshots of one `save_checkpoint` to the writer. Loading reads weights-only."""

    def __init__(self, buffers: HostBuffers) -> None:
        self.name = "lmsys-snapshot"
        self.buffers = buffers
        self.snapshot = Snapshot(buffers)
        self.files: list[tuple[Any, str]] = []

    # DeepSpeed's CheckpointEngine interface
    def create(self, info: Any) -> None:
        self.snapshot, self.files = Snapshot(self.buffers), []

    def save(self, state_dict: Any, path: str) -> None:
        self.snapshot.alive.append(state_dict)  # ids in the memo stay its objects' until take_files
        self.files.append((self.snapshot.take(state_dict), path))

    def load(self, path: str, map_location: Any = None) -> Any:
        return safe_torch_load(path, map_location=map_location)

    def commit(self, info: Any) -> bool:
        return True

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        Path(path).mkdir(parents=True, exist_ok=exist_ok)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        return True

    def get_commit_info(self) -> None:
        return None

    def set_commit_info(self, info: Any) -> None:
        pass

    def cleanup(self) -> None:
        pass

    def take_files(self) -> tuple[Snapshot, list[tuple[Any, str]]]:
        snapshot, files = self.snapshot, self.files
        snapshot.fence()
        snapshot.alive.clear()
        self.snapshot, self.files = Snapshot(self.buffers), []
        return snapshot, files


@contextlib.contextmanager
def snapshotting(engine: Any, snap_engine: SnapshotCheckpointEngine):
    """DeepSpeed's engine saves through `snap_engine` for the duration."""
    original = engine.checkpoint_engine
    engine.checkpoint_engine = snap_engine
    try:
        yield
    finally:
        engine.checkpoint_engine = original


# ----------------------------------------------------------------------------- one save in flight


@dataclass
class SaveResult:
    """A finished save, for the save line and metrics.jsonl."""

    step: int
    path: Path
    stall_s: float  # the loop stopped this long (waiting for the previous save included)
    write_s: float  # the background write, check and commit
    waited_s: float  # of stall_s: waiting for the previous save
    nbytes: int  # this rank's snapshot
    warnings: list[str] = field(default_factory=list)  # from pruning (rank 0)


@dataclass
class _Job:
    step: int
    path: Path
    stall_s: float = 0.0
    waited_s: float = 0.0
    nbytes: int = 0
    write_s: float = 0.0
    error: LmsysError | None = None  # raised where the save is reported (poll / wait)
    warnings: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: threading.Event = field(default_factory=threading.Event)


class AsyncSaver:
    """This rank's side of asynchronous saves: at most one in flight. Every rank constructs it at
    the same point (it forms a gloo group of its own when there are several ranks)."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, pin: bool) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.buffers = HostBuffers(pin)
        self.snap_engine = SnapshotCheckpointEngine(self.buffers)
        self.group = None
        if world_size > 1:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.job: _Job | None = None

    def start(
        self,
        engine: Any,
        run_dir: Path,
        state: ckpt.TrainState,
        rank_state: dict[str, Any],
        keep_last: int,
        pause_s: float = 0.0,
        on_wait: Callable[[int], None] | None = None,
    ) -> SaveResult | None:
        """Begin the save of `state.step` (every rank); returns the previous save if this call had
        to finish it. on_wait(step): told when the previous save is still in flight."""
        started = time.perf_counter()
        previous = None
        if self.job is not None and not self.job.done.is_set() and on_wait is not None:
            on_wait(self.job.step)
        if self.job is not None:
            previous = self.wait()
        waited = time.perf_counter() - started
        root = run_dir / CHECKPOINTS
        tag = ckpt.tag_for(state.step)
        tmp_tag = f"{TMP_PREFIX}{tag}"
        tmp_dir = root / tmp_tag
        ckpt.refuse_nonfinite(engine, state.step, root)  # before anything is written
        if self.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if tmp_dir.exists():  # a leftover of a killed save of this same step
                shutil.rmtree(tmp_dir)
        space = ckpt.space_needed(root, engine, tag)  # (bytes, what a full disk's line says then)
        with snapshotting(engine, self.snap_engine), persistent_params_kept(engine):
            engine.save_checkpoint(str(root), tag=tmp_tag, client_state={}, save_latest=False)
        snapshot, files = self.snap_engine.take_files()
        job = _Job(state.step, root / tag, waited_s=waited, nbytes=snapshot.nbytes)
        state_now = replace(state, config=dict(state.config))
        rank_json = json.dumps(rank_state)
        job.stall_s = time.perf_counter() - started
        self.job = job
        thread = threading.Thread(
            target=self._write,
            args=(job, snapshot, files, tmp_dir, rank_json, state_now, keep_last, pause_s, space),
            name=f"lmsys-save-{tag}",
            daemon=True,  # an abandoned save must not keep the process alive
        )
        thread.start()
        return previous

    def _write(
        self,
        job: _Job,
        snapshot: Snapshot,
        files: list[tuple[Any, str]],
        tmp_dir: Path,
        rank_json: str,
        state: ckpt.TrainState,
        keep_last: int,
        pause_s: float,
        space: tuple[int, str],
    ) -> None:
        """The writer thread: this rank's files, then the ranks' reports, then (rank 0) the commit.
        A full disk on any rank is one NoSpaceError line (the partial directory removed)."""
        started = time.perf_counter()
        written: dict[str, int] = {}
        error: str | None = None
        no_space = False
        needed, then = space
        try:
            with space_checked(tmp_dir.parent, needed, None, then):
                self._write_files(job, snapshot, files, tmp_dir, rank_json, written)
            if pause_s > 0 and job.abandoned.wait(pause_s):  # fault injection: files written, not committed
                return
        except NoSpaceError as exc:
            error, no_space = str(exc), True
        except Exception as exc:  # a permission, an I/O error: reported, never committed
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        finally:
            del files  # the snapshot's tensors; its buffers go back below, once nothing reads them
        if job.abandoned.is_set():
            return
        try:
            own = {"files": written, "error": error, "no_space": no_space}
            reports = self._gather(own)
            failed = [r for r in reports if r["error"]]
            if failed:
                if self.rank == 0:
                    shutil.rmtree(tmp_dir, ignore_errors=True)
                if any(r["no_space"] for r in failed):
                    raise NoSpaceError(next(r["error"] for r in failed if r["no_space"]))
                raise CheckpointError(f"checkpoint {job.path.name} was not written: {failed[0]['error']}")
            if self.rank == 0:
                check_complete(tmp_dir, reports)
                # every rank's files are complete: committing is safe even if abandoned now
                with space_checked(tmp_dir.parent, needed, tmp_dir, then):
                    ckpt.commit(tmp_dir.parent, state.step, state, keep_last, job.warnings.append)
        except LmsysError as exc:
            job.error = exc
        except Exception as exc:
            job.error = CheckpointError(f"{type(exc).__name__}: {exc}")
        finally:
            self.buffers.give_back(snapshot.lent)
            job.write_s = time.perf_counter() - started
            job.done.set()

    def _write_files(
        self,
        job: _Job,
        snapshot: Snapshot,
        files: list[tuple[Any, str]],
        tmp_dir: Path,
        rank_json: str,
        written: dict[str, int],
    ) -> None:
        """This rank's files of the checkpoint (names and sizes into `written`)."""
        snapshot.wait_copied()
        for obj, path in files:
            if job.abandoned.is_set():
                return
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(obj, path)
            written[Path(path).relative_to(tmp_dir).as_posix()] = Path(path).stat().st_size
        rank_file = tmp_dir / f"rank_{self.rank:05d}.json"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(rank_file, rank_json)
        written[rank_file.name] = rank_file.stat().st_size

    def _gather(self, report: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's report on every rank (over this saver's own gloo group): a failure on one
        rank fails the save on all of them, as a synchronous save's barrier does."""
        if self.group is None:
            return [report]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, report, group=self.group)
        return gathered

    def poll(self) -> SaveResult | None:
        """The save in flight, if it has finished (raises CheckpointError if it failed)."""
        if self.job is None or not self.job.done.is_set():
            return None
        return self._finish()

    def wait(self, timeout_s: float | None = None) -> SaveResult | None:
        """Wait for the save in flight (in short slices, so that signals reach the main thread);
        None if there is none, or if it is not done after timeout_s (when given)."""
        if self.job is None:
            return None
        give_up = None if timeout_s is None else time.monotonic() + timeout_s
        deadline = time.monotonic() + self.timeout_s + 60
        while not self.job.done.wait(0.05):
            if give_up is not None and time.monotonic() > give_up:
                return None
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint {self.job.path.name} is still being written after "
                    f"{self.timeout_s + 60:.0f} s (trainer.dist_timeout_s); a rank may be gone"
                )
        return self._finish()

    def abandon(self) -> None:
        """Stop caring for the save in flight: its writer stops at its next file and never
        commits; the temporary directory is removed by the next save's pruning."""
        if self.job is not None:
            self.job.abandoned.set()
            self.job = None

    def _finish(self) -> SaveResult:
        job, self.job = self.job, None
        assert job is not None
        if job.error is not None:
            raise job.error
        return SaveResult(
            job.step, job.path, job.stall_s, job.write_s, job.waited_s, job.nbytes, job.warnings
        )

    def close(self) -> None:
        if self.group is not None and self.job is None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
            self.group = None


def check_complete(tmp_dir: Path, reports: list[dict[str, Any]]) -> None:
    """Every file every rank reported is in the temporary directory at the size it wrote."""
    for rank, report in enumerate(reports):
        for rel, size in report["files"].items():
            path = tmp_dir / rel
            if not path.is_file():
                raise CheckpointError(f"checkpoint {tmp_dir.name}: rank {rank}'s {rel} is missing")
            if path.stat().st_size != size:
                raise CheckpointError(
                    f"checkpoint {tmp_dir.name}: rank {rank}'s {rel} has {path.stat().st_size} bytes, "
                    f"it wrote {size}"
                )
