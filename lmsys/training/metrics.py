"""Metrics: MFU, memory, metrics.jsonl, Weights & Biases (rank 0 only), the loss plot.

Every record goes to `<run_dir>/metrics.jsonl` (one JSON object per line, `kind` = train | eval)
and, unless logger.wandb=disabled, to W&B with the same keys (`train/loss`, `eval/loss`, ...).
W&B never blocks and never prompts: `online` needs WANDB_API_KEY in the environment and falls
back to `offline` with a warning otherwise (or when the service cannot be reached); its files
live in `<run_dir>/wandb`. The API key is never written anywhere by lmsys.
"""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmsys.core.files import atomic_write_text
from lmsys.engine.rundir import METRICS_FILE, WANDB_DIR, read_jsonl, read_metrics

# Dense bf16 tensor-core peak FLOP/s by device-name fragment, most specific first (docs/DESIGN.md:
# training MFU is measured against the device's dense bf16 peak).
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A6000", 155e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16 tensor cores (no bf16)
    ("T4", 65e12),  # fp16 tensor cores (no bf16)
]


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of one device in FLOP/s, or None (CPU, unknown GPU): MFU is then null."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peak in PEAK_BF16_FLOPS:
        if fragment in name:
            return peak
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads/process)"


def mfu(
    flops_per_token: float, tokens_per_s: float, peak_per_device: float | None, world_size: int
) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak of all devices."""
    if peak_per_device is None or tokens_per_s <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak_per_device * world_size)


def peak_rss_bytes() -> int:
    """This process's peak resident set size: VmHWM of /proc/self/status, the peak of its own
    address space. Not getrusage's ru_maxrss: Linux carries that across exec, so a run started
    by a large process (a notebook, a test session of 3 GB) would report its parent's peak."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no procfs: KiB on Linux


AllocationEvent = tuple[int, int, int, Any]  # (time ns, address, +bytes or -bytes, profiler node)
UnseenFree = tuple[int, int, int | None]  # (address, allocated at, allocated again at or None)


# lmsys's own diagnostics (a bad step replayed on a replica of the model: lmsys.training.health)
# hold memory the training step does not: their span is kept out of the measured peak.
DIAGNOSIS = "lmsys::diagnosis"
_cuda_peak_before_diagnosis: dict[int, int] = {}  # device index -> the peak before the last one
_diagnoses = [0]  # how many ran in this process (a peak RSS cannot leave them out)


@contextmanager
def diagnosis(device: torch.device) -> Iterator[None]:
    """A span the measured peak leaves out. On CUDA the allocator's peak so far is kept and its
    peak statistic reset after the span (cuda_peak_bytes adds them back); on CPU the span is a
    profiler range TensorPeak skips. The process's peak RSS cannot leave it out (diagnoses_run)."""
    _diagnoses[0] += 1
    before = cuda_peak_bytes(device) if device.type == "cuda" else None
    try:
        with torch.profiler.record_function(DIAGNOSIS):
            yield
    finally:
        if before is not None:
            _cuda_peak_before_diagnosis[_cuda_index(device)] = before
            torch.cuda.reset_peak_memory_stats(device)


def diagnoses_run() -> int:
    """How many diagnosis spans this process has entered."""
    return _diagnoses[0]


def cuda_peak_bytes(device: torch.device) -> int:
    """torch.cuda.max_memory_allocated outside lmsys's diagnoses (see diagnosis)."""
    held = _cuda_peak_before_diagnosis.get(_cuda_index(device), 0)
    return max(held, int(torch.cuda.max_memory_allocated(device)))


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class TensorPeak:
    """The peak of the CPU tensors allocated since start(): the CPU's equivalent of CUDA's
    max_memory_allocated, which RSS is not (glibc keeps memory torch has freed, by a policy that
    varies run to run: docs/planning.md). It reads the allocation events of torch's profiler
    (profile_memory): c10's CPU allocator reports every allocation, and every free made on a
    thread the profiler follows (this one, and the autograd engine's on its behalf). A tensor a
    gloo worker thread frees last goes unreported. Such a block is known to be gone when its
    address is allocated again (or, at the end, when no tensor holds it): it counts until then,
    which bounds the peak from above. It cannot have been freed before the last op that read it
    (the profiler records each op's inputs): freeing it there bounds the peak from below. The
    result gives both. No peak is taken inside a `diagnosis` span (lmsys's replay of a bad
    step). Costs about 1.5 s to start and the profiler's per-op overhead while it runs, so
    lmsys-train uses it only with trainer.trace_memory=true."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile  # late: only traced runs load it

        self.profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
        self.profile.start()

    def stop(self) -> TracedPeak:
        """The peak since start(), the ops that made its last allocation (outermost first), and
        how much of it may be blocks already freed unseen; stops the profiler."""
        from torch._C._profiler import _EventType  # late: only traced runs load it

        self.profile.stop()
        tree = self.profile.profiler.kineto_results.experimental_event_tree()  # type: ignore[union-attr]
        events: list[AllocationEvent] = []
        ops = []  # their inputs are read only if a free went unseen (a 1-rank run has none)
        skipped: list[tuple[int, int]] = []  # lmsys's diagnoses (diagnosis): no peak is taken there
        pending = list(tree)
        while pending:
            node = pending.pop()
            pending.extend(node.children)
            kind, fields = node.typed
            if kind == _EventType.Allocation and fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.ptr, fields.alloc_size, node))
            elif kind == _EventType.TorchOp:
                ops.append((node.end_time_ns, fields.inputs))
            if node.name == DIAGNOSIS:
                skipped.append((node.start_time_ns, node.end_time_ns))
        events.sort(key=lambda event: event[0])
        upper, upper_index, unseen = _running_peak(events, skipped)
        during = _ops_above(events[upper_index][3] if events else None)
        holders = _holders(events[: upper_index + 1])
        if not unseen:
            return TracedPeak(upper, 0, during, holders)
        # each unseen block freed at its last read (or its allocation) before its address came back
        held_now = _tensor_storages()
        last_read: dict[int, list[int]] = {}  # storage address -> the ends of the ops that read it
        for end, inputs in ops:
            for ptr in _input_storages(inputs):
                last_read.setdefault(ptr, []).append(end)
        early_frees = []
        for ptr, born, gone in unseen:
            if gone is None and ptr in held_now:
                continue  # alive at the end: its free did not go unseen
            ends = [end for end in last_read.get(ptr, ()) if born <= end and (gone is None or end <= gone)]
            early_frees.append((max(ends, default=born), ptr, -1, None))
        # a free and an allocation at one instant: the free first
        in_order = sorted(events + early_frees, key=lambda event: (event[0], event[2] > 0))
        lower = _running_peak(in_order, skipped)[0]
        return TracedPeak(upper, upper - lower, during, holders)


def _running_peak(
    events: list[AllocationEvent], skipped: Sequence[tuple[int, int]] = ()
) -> tuple[int, int, list[UnseenFree]]:
    """The peak of the live blocks over time-ordered allocation events, its index, and the blocks
    whose free no event reported. Within the `skipped` spans (start, end) the blocks are counted
    but no peak is taken."""
    live: dict[int, tuple[int, int]] = {}  # address -> (bytes, allocated at)
    unseen: list[UnseenFree] = []
    total = peak = peak_index = 0
    for index, (time, ptr, size, _) in enumerate(events):
        if ptr in live:
            held, born = live.pop(ptr)
            total -= held
            if size > 0:  # allocated again without a free in between: the free went unseen
                unseen.append((ptr, born, time))
        if size > 0:
            live[ptr] = (size, time)
            total += size
        if total > peak and not any(start <= time <= end for start, end in skipped):
            peak, peak_index = total, index
    unseen += [(ptr, born, None) for ptr, (_, born) in live.items()]
    return peak, peak_index, unseen


def _holders(events: list[AllocationEvent], top: int = 8) -> dict[str, int]:
    """The blocks alive after these events, grouped by the ops that allocated them: the largest
    `top` groups, bytes by op chain (outermost first)."""
    live: dict[int, tuple[int, Any]] = {}
    for _, ptr, size, node in events:
        live.pop(ptr, None)
        if size > 0:
            live[ptr] = (size, node)
    groups: dict[str, int] = {}
    for size, node in live.values():
        chain = _ops_above(node, depth=3) or "(no op)"
        groups[chain] = groups.get(chain, 0) + size
    return dict(sorted(groups.items(), key=lambda item: -item[1])[:top])


def _input_storages(inputs: list[Any]) -> Iterator[int]:
    """The storage addresses of an op's recorded inputs (a tensor, or a list of them)."""
    for value in inputs:
        for tensor in value if isinstance(value, list) else (value,):
            address = getattr(tensor, "storage_data_ptr", None)
            if address:
                yield address


def _ops_above(node: Any, depth: int = 4) -> str:
    """The innermost `depth` ops enclosing a profiler event, outermost first."""
    chain = []
    while node is not None and (node := node.parent) is not None:
        chain.append(node.name)
    return " > ".join(reversed(chain[:depth]))


def _tensor_storages() -> set[int]:
    """The addresses of every CPU tensor's storage that Python objects hold now (by type, not
    isinstance: isinstance reads __class__, which some deprecated objects warn on)."""
    found = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                found.add(obj.untyped_storage().data_ptr())
            except RuntimeError:  # a tensor without storage (sparse, a wrapper subclass)
                pass
    return found


@dataclass(frozen=True)
class TracedPeak:
    bytes: int
    # how much of it may be blocks already freed unseen (a gloo thread dropped them last): the peak
    # with each such free at its last read, so the tensors' true peak lies in
    # [bytes - unconfirmed_bytes, bytes]
    unconfirmed_bytes: int
    during: str  # the ops that made the peak's last allocation, outermost first
    # the blocks alive at the peak by the ops that allocated them (the largest groups), bytes
    holders: dict[str, int] = field(default_factory=dict)


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA allocations on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return cuda_peak_bytes(device) / 1e9
    return peak_rss_bytes() / 1e9


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# ----------------------------------------------------------------------------- the logger


class MetricsLogger:
    """metrics.jsonl + W&B. Create it on rank 0 only."""

    def __init__(
        self,
        run_dir: Path,
        logger_cfg: Any,
        config_dict: dict[str, Any],
        run_name: str,
        wandb_id: str | None,
        resumed_step: int,
        warn: Callable[[str], None],
    ) -> None:
        self.run_dir = run_dir
        self.path = run_dir / METRICS_FILE
        self.warn = warn
        self._truncate_after(resumed_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self.wandb_run = None
        self.wandb_mode = "disabled"
        self.wandb_location: str | None = None  # the online run's URL, the offline run's directory
        mode = logger_cfg.wandb
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            warn("logger.wandb=online but WANDB_API_KEY is not set; logging to W&B offline instead")
            mode = "offline"
        if mode != "disabled":
            self.wandb_run = self._init_wandb(mode, logger_cfg, config_dict, run_name, wandb_id)
        if self.wandb_run is not None and resumed_step > 0:
            self._replay_to_wandb(logger_cfg.log_interval)

    def _truncate_after(self, step: int) -> None:
        """A resumed run recomputes the steps after its checkpoint: drop their old records (and a
        line cut by a kill -9)."""
        if not self.path.exists():
            return
        kept = [r for r in read_jsonl(self.path) if int(r.get("step", 0)) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def _init_wandb(
        self, mode: str, lg: Any, config_dict: dict[str, Any], run_name: str, wandb_id: str | None
    ) -> Any:
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_CONSOLE", "off")
        os.environ.setdefault("WANDB_DISABLE_CODE", "true")
        try:
            import wandb  # about a second to import: only runs that log to W&B pay it
        except ImportError:
            self.warn("wandb is not installed; logging to metrics.jsonl only")
            return None

        def start(m: str) -> Any:
            settings = wandb.Settings(
                console="off",
                silent=True,
                save_code=False,
                x_save_requirements=False,
                init_timeout=60.0,
            )
            return wandb.init(
                project=lg.project,
                entity=lg.entity,
                group=lg.group,
                tags=list(lg.tags) or None,
                name=run_name,
                id=wandb_id,
                resume="allow" if wandb_id else None,
                dir=str(self.run_dir),
                mode=m,
                config=config_dict,
                settings=settings,
            )

        try:
            run = start(mode)
        except Exception as exc:  # no network, bad key, service start failure
            if mode != "online":
                self.warn(f"W&B could not start ({type(exc).__name__}: {exc}); logging to metrics.jsonl only")
                return None
            self.warn(f"W&B online could not start ({type(exc).__name__}); logging to W&B offline instead")
            try:
                run = start("offline")
                mode = "offline"
            except Exception as exc2:
                self.warn(
                    f"W&B could not start ({type(exc2).__name__}: {exc2}); logging to metrics.jsonl only"
                )
                return None
        self.wandb_mode = mode
        self.wandb_location = run.url if mode == "online" else str(run.settings.sync_dir)
        run.define_metric("train/*", step_metric="step")
        run.define_metric("eval/*", step_metric="step")
        return run

    def _replay_to_wandb(self, log_interval: int) -> None:
        """Send the records kept from earlier attempts (steps up to the resumed checkpoint) to the
        resumed W&B run. An offline attempt writes its own file, and one killed with -9 leaves
        only what W&B had flushed (often nothing), so without this the run's W&B history would
        start at the resumed step. Steps the W&B run already holds (below `run.starting_step`:
        what the server has online, nothing offline) are not sent again. Train records follow
        the usual cadence (every `log_interval`-th step and the first); eval records all go."""
        assert self.wandb_run is not None
        held = int(getattr(self.wandb_run, "starting_step", 0) or 0)
        for record in read_metrics(self.run_dir):
            kind, step = record.pop("kind", None), int(record.pop("step", 0))
            if step < held or kind not in ("train", "eval"):
                continue
            if kind == "eval" or step % log_interval == 0 or step == 1:
                self._to_wandb(kind, step, record)

    def _to_wandb(self, kind: str, step: int, values: dict[str, Any]) -> None:
        assert self.wandb_run is not None
        data = {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float)) and v is not None}
        data["step"] = step
        self.wandb_run.log(data, step=step)

    @property
    def wandb_id(self) -> str | None:
        return None if self.wandb_run is None else self.wandb_run.id

    def log(self, kind: str, step: int, values: dict[str, Any], to_wandb: bool = True) -> None:
        """One record: always to metrics.jsonl, to W&B when `to_wandb` (every logger.log_interval)."""
        record = {"kind": kind, "step": step, **{k: _finite_or_none(v) for k, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.wandb_run is not None and to_wandb:
            self._to_wandb(kind, step, values)

    def wandb_line(self) -> str:
        """Where this run's W&B record is, and for an offline run how to upload it."""
        if self.wandb_mode == "online":
            return f"W&B: online run {self.wandb_location}"
        if self.wandb_mode == "offline":
            where = self.wandb_location
            return f"W&B: offline run in {where}; upload it with: wandb sync {where}"
        return f"W&B: off (metrics in {self.path})"

    def summary(self, values: dict[str, Any]) -> None:
        if self.wandb_run is not None:
            for k, v in values.items():
                self.wandb_run.summary[k] = v

    def close(self, exit_code: int = 0) -> None:
        self._file.close()
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish(exit_code=exit_code)
            except Exception as exc:  # never fail a finished training run on logging
                self.warn(f"W&B finish failed: {type(exc).__name__}: {exc}")
            self.wandb_run = None


# ----------------------------------------------------------------------------- W&B run files

# A .wandb file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0) then
# LevelDB-log framing: 32 KiB blocks of records, each with a 7-byte header (crc32c, length,
# type: 1 full, 2 first, 3 middle, 4 last) whose payloads are wandb_internal_pb2.Record protobufs.
_WANDB_HEADER = 7
_BLOCK = 32768
_RECORD_HEADER = 7


def wandb_records(path: str | Path) -> Iterator[Any]:
    """The protobuf Records of an offline run's .wandb file (parsed with W&B's own schema)."""
    from wandb.proto import wandb_internal_pb2  # readers only (tests, checks): not on the training path

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending = _WANDB_HEADER, b""
    while pos + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, rtype = struct.unpack("<IHB", data[pos : pos + _RECORD_HEADER])
        pos += _RECORD_HEADER
        if pos + length > len(data):  # the tail of a run killed mid-write
            break
        payload, pos = data[pos : pos + length], pos + length
        if rtype == 0 and length == 0:  # zero padding
            continue
        if rtype == 1:
            pending = b""
            chunk = payload
        elif rtype == 2:
            pending = payload
            continue
        elif rtype == 3:
            pending += payload
            continue
        elif rtype == 4:
            chunk, pending = pending + payload, b""
        else:
            break
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(chunk)
        except Exception:  # a damaged record: stop reading, as W&B's own reader does
            break
        yield record


def wandb_files(run_dir: str | Path) -> list[Path]:
    """The offline W&B run files under run_dir/wandb, one per attempt, oldest first."""
    return sorted(Path(run_dir, WANDB_DIR).glob("*run-*/run-*.wandb"))


def wandb_history(run_dir: str | Path, attempt: int | None = None) -> list[dict[str, Any]]:
    """Every history row logged to the offline W&B run(s) under run_dir/wandb, oldest first; with
    `attempt`, only those of that file of `wandb_files` (-1: the latest attempt's)."""
    rows = []
    files = wandb_files(run_dir)
    for path in files if attempt is None else [files[attempt]]:
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {}
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    row[key] = json.loads(item.value_json)
                rows.append(row)
    return rows


def wandb_config(run_dir: str | Path) -> dict[str, Any]:
    """The config the offline W&B run(s) recorded (later updates win)."""
    config: dict[str, Any] = {}
    for path in wandb_files(run_dir):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            items = []
            if kind == "run":
                items = record.run.config.update
            elif kind == "config":
                items = record.config.update
            for item in items:
                key = item.key or "/".join(item.nested_key)
                config[key] = json.loads(item.value_json)
    return config
