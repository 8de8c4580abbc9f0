"""A run's measured peak memory beside the plan's prediction (trainer.plan): `PeakMemory`, the
component that takes it, and what it is read from. On CUDA, torch.cuda.max_memory_allocated against
the plan's tensors (its peak without the allocator margin): the planner's error. On a CPU, the
process's peak RSS less its RSS before the model was built; RSS also holds memory that is no tensor
and what glibc keeps of what torch freed, by a policy that varies run to run: a bound shown beside the
prediction, not its error (the grid bench measures the CPU's tensors: docs/planning.md). A bad step's
replay on a copy of the model (lmsys.training.health) runs in a `diagnosis` span the CUDA peak leaves out.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lmsys.core.config import TrainerConfig
from lmsys.core.rundir import MemoryRecord, write_engine_stats
from lmsys.core.runtime import Setup
from lmsys.engine.zero import shard_stats
from lmsys.planning.check import Plan, evaluation_warning, mib, startup_line
from lmsys.training.components import Component, Loop, Step
from lmsys.training.reporter import Reporter


class PeakMemory(Component):
    """The run's measured peak, once: after the second applied step (the first runs before the
    optimizer's state exists, every later one beside it), or at the launch's last step. Every rank
    measures its own; rank 0 writes engine_stats.json (what each rank holds), the `memory` record and
    the `memory:` line. Built before the model (train()): its baseline RSS is taken then."""

    def __init__(self, t: TrainerConfig, setup: Setup, plan: Plan | None, report: Reporter) -> None:
        # torch._dynamo is imported by every torch optimizer (its first param group): imported
        # before the baseline, its ~100 MB of code count as the process's, not as the run's peak
        import torch._dynamo  # noqa: F401

        self.setup, self.plan, self.report, self.max_steps = setup, plan, report, t.max_steps
        self.baseline_rss = rss_bytes()
        self.applied_steps = 0
        self.loop: Loop | None = None  # until it has measured

    def begin(self, loop: Loop) -> None:
        self.loop = loop
        if self.plan is not None:
            self.report.note(startup_line(self.plan))
            self.report.expect_evaluations(self.plan.evaluation_s)
            if warning := evaluation_warning(self.plan):
                self.report.warn(warning)

    def after_step(self, step: Step) -> None:
        self.applied_steps += step.applied
        due = self.applied_steps == 2 or (self.applied_steps > 0 and step.step >= self.max_steps)
        if self.loop is not None and due:
            self._measure(self.loop, step.step)
            self.loop = None

    def _measure(self, loop: Loop, step: int) -> None:
        measured = measured_peak_bytes(self.setup.device, self.baseline_rss)
        gathered: list[Any] = [None] * self.setup.world_size  # (what it holds, its peak)
        dist.all_gather_object(gathered, (shard_stats(loop.engine), measured.bytes))
        if self.setup.rank != 0:
            return
        write_engine_stats(loop.run_dir, loop.engine_info.as_dict(), gathered)
        peaks = [peak for _, peak in gathered]
        predicted = self.plan.tensor_bytes if self.plan is not None else None
        record = MemoryRecord(
            step,
            measured_peak_bytes=max(peaks),
            measured_peak_bytes_per_rank=peaks,
            predicted_peak_bytes=predicted,
            measured_by=measured.by,
            measured_includes_diagnosis=measured.includes_diagnosis,
        )
        line = None if predicted is None else memory_line(predicted, max(peaks), measured)
        self.report.memory_measured(record, line)


DIAGNOSIS = "lmsys::diagnosis"  # the profiler range of a diagnosis span
_cuda_peak_before_diagnosis: dict[int, int] = {}  # device index -> the peak before the last one
_diagnoses = [0]  # how many ran in this process (a peak RSS cannot leave them out)


@contextmanager
def diagnosis(device: torch.device) -> Iterator[None]:
    """A span the measured peak leaves out. On CUDA the allocator's peak so far is kept and its peak
    statistic reset after the span (cuda_peak_bytes adds them back); it is a profiler range, which the
    grid bench's CPU tensor trace skips. A peak RSS cannot leave it out (diagnoses_run)."""
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


def peak_rss_bytes() -> int:
    """This process's peak resident set size: VmHWM of /proc/self/status, the peak of its own address
    space. Not getrusage's ru_maxrss: Linux carries that across exec, so a run started by a large
    process (a notebook, a test session of 3 GB) would report its parent's peak."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))  # kB
    except (OSError, ValueError, IndexError, StopIteration):  # no procfs: getrusage's KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident set size now (/proc/self/statm), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process so far: CUDA allocations on GPU, resident set size on CPU."""
    return (cuda_peak_bytes(device) if device.type == "cuda" else peak_rss_bytes()) / 1e9


@dataclass(frozen=True)
class Measured:
    bytes: int
    by: str  # cuda_max_allocated | rss
    includes_diagnosis: bool = False  # rss: a bad step's replay ran before it (diagnosis)


def measured_peak_bytes(device: torch.device, baseline_rss: int) -> Measured:
    """The run's measured peak: CUDA max_memory_allocated; on a CPU the process's peak RSS less
    `baseline_rss` (taken before the model is built)."""
    if device.type == "cuda":
        return Measured(cuda_peak_bytes(device), "cuda_max_allocated")
    return Measured(peak_rss_bytes() - baseline_rss, "rss", includes_diagnosis=diagnoses_run() > 0)


def memory_line(predicted: int, measured: int, how: Measured) -> str:
    """The `memory:` line: on CUDA the measured tensors against the prediction, the planner's error;
    on a CPU the peak RSS beside it, a bound on the tensors (module docstring)."""
    if how.by == "cuda_max_allocated":
        diff = (measured - predicted) / predicted if predicted else 0.0
        measures = f"measured {mib(measured)} (max_memory_allocated, {diff:+.0%})"
        return f"memory: predicted {mib(predicted)}, {measures}"
    replay = "; it includes a bad step's replay on a copy of the model" if how.includes_diagnosis else ""
    return (
        f"memory: predicted {mib(predicted)} of tensors; the process's peak RSS grew by {mib(measured)}, "
        "which also holds what glibc keeps and memory that is no tensor: a bound, not the planner's error "
        f"(python -m tools.bench plan measures the tensors){replay}"
    )
