"""A run's measured peak memory beside the plan's prediction (trainer.plan): `PeakMemory`, the
component that takes it, and what it is read from.

What a rank measures:
- CUDA: torch.cuda.max_memory_allocated (what the plan predicts without its allocator margin);
- CPU, trainer.trace_memory=true: the peak of the traced tensors (`TensorPeak`, torch's profiler's
  allocation events: CUDA's measure, on CPU);
- CPU otherwise: the process's peak RSS less its RSS before the model was built (the imports, the
  process group), which includes what glibc keeps of the memory torch freed.
A bad step's replay on a copy of the model (lmsys.training.health) is not the training step's
memory: it runs in a `diagnosis` span, which the CUDA and traced peaks leave out.
"""

from __future__ import annotations

import gc
import os
import resource
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lmsys.core.config import TrainerConfig
from lmsys.core.rundir import MemoryRecord, write_engine_stats
from lmsys.core.runtime import Setup
from lmsys.engine.zero import shard_stats
from lmsys.training.components import Component, Loop, Step
from lmsys.training.planning import Plan, mib
from lmsys.training.reporter import Reporter


class PeakMemory(Component):
    """The run's measured peak, once: after the second applied step (the first runs its forward
    and backward before the optimizer's state exists, every later one beside it), or at the
    launch's last step. Every rank measures its own; rank 0 writes engine_stats.json (what each
    rank holds), the `memory` record and the `memory:` line.

    Built before the model (train()): its baseline RSS is taken then, and its trace starts then."""

    def __init__(self, t: TrainerConfig, setup: Setup, plan: Plan | None, report: Reporter) -> None:
        # torch._dynamo is imported by every torch optimizer (its first param group): imported
        # before the baseline, its ~100 MB of code count as the process's, not as the run's peak
        import torch._dynamo  # noqa: F401

        self.setup, self.plan, self.report, self.max_steps = setup, plan, report, t.max_steps
        self.baseline_rss = rss_bytes()
        self.trace = TensorPeak() if t.trace_memory and setup.device.type == "cpu" else None
        self.applied_steps = 0
        self.loop: Loop | None = None  # until it has measured

    def begin(self, loop: Loop) -> None:
        self.loop = loop
        if self.plan is not None:
            self.report.note(self.plan.startup_line())

    def after_step(self, step: Step) -> None:
        self.applied_steps += step.applied
        due = self.applied_steps == 2 or (self.applied_steps > 0 and step.step >= self.max_steps)
        if self.loop is not None and due:
            self._measure(self.loop, step.step)
            self.loop = None

    def _measure(self, loop: Loop, step: int) -> None:
        measured = measured_peak_bytes(self.setup.device, self.baseline_rss, self.trace)
        self.trace = None
        gathered: list[Any] = [None] * self.setup.world_size  # (what it holds, its peak, of it unconfirmed)
        dist.all_gather_object(gathered, (shard_stats(loop.engine), measured.bytes, measured.unconfirmed))
        if self.setup.rank != 0:
            return
        write_engine_stats(loop.run_dir, loop.engine_info.as_dict(), gathered)
        peaks = [peak for _, peak, _ in gathered]
        largest = peaks.index(max(peaks))
        record = memory_record(step, self.plan, peaks, gathered[largest][2], measured)
        line = None
        if record.predicted_peak_bytes is not None:
            unconfirmed = record.measured_peak_unconfirmed_bytes or 0
            line = memory_line(
                record.predicted_peak_bytes,
                peaks[largest],
                measured.by,
                unconfirmed,
                measured.includes_diagnosis,
            )
        self.report.memory_measured(record, line)


def memory_record(
    step: int, plan: Plan | None, peaks: list[int], largest_unconfirmed: int, measured: Measured
) -> MemoryRecord:
    """Every rank's measured peak beside the prediction; `measured` is rank 0's (how it was taken);
    largest_unconfirmed: of the largest rank's peak, the bytes whose free went unseen (traced)."""
    traced = measured.by == "traced_tensors"
    return MemoryRecord(
        step,
        measured_peak_bytes=max(peaks),
        measured_peak_bytes_per_rank=peaks,
        predicted_peak_bytes=measured.predicted(plan) if plan is not None else None,
        measured_by=measured.by,
        measured_includes_diagnosis=measured.includes_diagnosis,
        measured_peak_unconfirmed_bytes=largest_unconfirmed if traced else None,
        rank0_peak_during=measured.during if traced else None,
        rank0_peak_holders=measured.holders if traced else None,
    )


# ----------------------------------------------------------------------------- what a peak is read from


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


# ----------------------------------------------------------------------------- the measured peak


def rss_bytes() -> int:
    """This process's resident set size now (/proc/self/statm), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def measured_peak_bytes(device: torch.device, baseline_rss: int, trace: TensorPeak | None) -> Measured:
    """The run's measured peak: CUDA max_memory_allocated (what the plan predicts without its
    allocator margin); CPU with trainer.trace_memory the traced tensors' peak (TensorPeak, started
    with the baseline), else the process's peak RSS (peak_rss_bytes) minus its RSS after
    the imports and the process group (taken before the model is built)."""
    if device.type == "cuda":
        return Measured(cuda_peak_bytes(device), "cuda_max_allocated")
    if trace is not None:
        peak = trace.stop()
        return Measured(peak.bytes, "traced_tensors", peak.during, peak.unconfirmed_bytes, peak.holders)
    return Measured(peak_rss_bytes() - baseline_rss, "rss", includes_diagnosis=diagnoses_run() > 0)


@dataclass(frozen=True)
class Measured:
    bytes: int
    by: str  # cuda_max_allocated | traced_tensors | rss: what the prediction is compared with
    during: str = ""  # traced: the ops that made the peak, outermost first
    unconfirmed: int = 0  # traced: bytes of the peak whose free went unseen (TracedPeak)
    holders: dict[str, int] = field(default_factory=dict)  # traced: bytes at the peak by allocating ops
    includes_diagnosis: bool = False  # rss: a bad step's replay ran before it (diagnosis)

    def predicted(self, plan: Plan) -> int:
        """The plan's figure for this measure: the tensors alone, or with the runtime for RSS."""
        return plan.allocated_bytes if self.by == "rss" else plan.tensor_bytes


MEASURED_BY = {
    "cuda_max_allocated": "",
    "traced_tensors": " (tensors, traced)",
    "rss": " (peak RSS, with what glibc keeps; trainer.trace_memory=true counts the tensors)",
}


def memory_line(
    predicted: int,
    measured: int,
    by: str = "cuda_max_allocated",
    unconfirmed: int = 0,
    includes_diagnosis: bool = False,
) -> str:
    diff = (measured - predicted) / predicted if predicted else 0.0
    line = f"memory: predicted {mib(predicted)}, measured {mib(measured)}{MEASURED_BY[by]} ({diff:+.0%})"
    if unconfirmed:  # a traced peak with frees a gloo thread made unseen (TracedPeak)
        line += f"; {mib(unconfirmed)} of it may be blocks a gloo thread had already freed"
    if includes_diagnosis:
        line += (
            "; it includes a bad step's replay on a copy of the model, which the peak RSS cannot leave out"
        )
    return line
