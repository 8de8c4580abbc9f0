"""The grid bench's probe (grid.py): `python -m tools.bench.plan.tensor_trace OUT [overrides]`, one
rank's training (under torchrun, each rank's) with the peak of its CPU tensors through its second
step written to `<OUT>.rank<R>` as {"bytes", "unseen_bytes"}.

`TensorPeak` is CUDA's max_memory_allocated on a CPU, from torch's profiler: c10's CPU allocator
reports every allocation, and every free made on a thread the profiler follows. A block a gloo
worker thread frees goes unseen: it counts until its address is allocated again (an upper bound),
and it was freed no earlier than the last op that read it (a lower bound): `unseen_bytes` is the
difference. lmsys's diagnoses (a bad step replayed: lmsys.training.peak_memory.diagnosis) take no peak.
"""

from __future__ import annotations

import gc
import json
import math
import sys
from contextlib import suppress
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._profiler import _EventType
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.profiler import ProfilerActivity, profile

from lmsys.cli import run_cli
from lmsys.core.config import compose
from lmsys.core.errors import UsageError
from lmsys.training.peak_memory import DIAGNOSIS
from lmsys.training.run import train

PROG = "tools.bench tensor_trace"
DATALESS = (FakeTensor, FunctionalTensor)  # no data of their own: a plan's fake tensors left alive here
Event = tuple[int, int, int]  # (time ns, address, +bytes allocated or -bytes freed)
Unseen = tuple[int, int, float]  # (address, allocated at, allocated again at: inf if never)


class TensorPeak:
    """The peak of the CPU tensors allocated between start and stop() (module docstring)."""

    def __init__(self) -> None:
        self.profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
        self.profile.start()

    def stop(self) -> tuple[int, int]:
        """(the peak in bytes, how much of it may be blocks already freed unseen)."""
        self.profile.stop()
        events: list[Event] = []
        reads: dict[int, list[int]] = {}  # storage address -> the ends of the ops that read it
        skipped: list[tuple[int, int]] = []  # the diagnoses' spans
        nodes = list(self.profile.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
        for node in nodes:  # the list grows by each node's children: every node, once
            nodes.extend(node.children)
            kind, fields = node.typed
            if kind == _EventType.Allocation and fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
            elif kind == _EventType.TorchOp:
                for value in fields.inputs:
                    for tensor in value if isinstance(value, list) else (value,):
                        if getattr(tensor, "storage_data_ptr", None):
                            reads.setdefault(tensor.storage_data_ptr, []).append(node.end_time_ns)
            if node.name == DIAGNOSIS:
                skipped.append((node.start_time_ns, node.end_time_ns))
        events.sort()
        upper, unseen = running_peak(events, skipped)
        alive = _cpu_addresses()
        # each unseen free at the last read of its block before its address came back (a block
        # alive at the end was not freed)
        early = [
            (max((end for end in reads.get(ptr, ()) if born <= end <= gone), default=born), ptr, -1)
            for ptr, born, gone in unseen
            if gone < math.inf or ptr not in alive
        ]
        lower, _ = running_peak(sorted(events + early, key=lambda e: (e[0], e[2] > 0)), skipped)
        return upper, upper - lower


def running_peak(events: list[Event], skipped: list[tuple[int, int]]) -> tuple[int, list[Unseen]]:
    """The peak of the live blocks over time-ordered events (none taken inside `skipped` spans),
    and the blocks whose free no event reported."""
    live: dict[int, tuple[int, int]] = {}  # address -> (bytes, allocated at)
    unseen: list[Unseen] = []
    total = peak = 0
    for time, ptr, size in events:
        if ptr in live:
            held, born = live.pop(ptr)
            total -= held
            if size > 0:  # allocated again without a free in between: the free went unseen
                unseen.append((ptr, born, time))
        if size > 0:
            live[ptr] = (size, time)
            total += size
        if total > peak and not any(start <= time <= end for start, end in skipped):
            peak = total
    return peak, unseen + [(ptr, born, math.inf) for ptr, (_, born) in live.items()]


def _cpu_addresses() -> set[int]:
    """The storage address of every CPU tensor Python holds now."""
    found = set()
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: it reads __class__, which some objects warn on
        if issubclass(kind, torch.Tensor) and not issubclass(kind, DATALESS) and obj.device.type == "cpu":
            with suppress(RuntimeError):  # no storage (a sparse tensor, a wrapper subclass)
                found.add(obj.untyped_storage().data_ptr())
    return found


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if not argv:
            raise UsageError(f"usage: python -m {__spec__.name if __spec__ else PROG} OUT [overrides]")
        out, cfg = Path(argv[0]), compose(argv[1:])
        trace: list[TensorPeak] = [TensorPeak()]

        def after(step: int) -> None:  # the second step: Adam's state exists (PeakMemory's moment)
            if step == 2 and trace:
                peak, unseen = trace.pop().stop()
                text = json.dumps({"bytes": peak, "unseen_bytes": unseen})
                Path(f"{out}.rank{dist.get_rank()}").write_text(text, encoding="utf-8")

        train(cfg, step_hook=after)
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
