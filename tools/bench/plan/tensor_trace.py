"""The grid bench's probe (tools.bench.plan.grid): one rank's training, with the peak of its CPU tensors
traced through its second step, written to `<OUT>.rank<R>` as {"bytes", "unseen_bytes"}.

    python -m tools.bench.plan.tensor_trace OUT model=tiny trainer.max_steps=3 ...
    torchrun --standalone --nproc_per_node=2 -m tools.bench.plan.tensor_trace OUT ...

`TensorPeak` is CUDA's max_memory_allocated on a CPU, from torch's profiler (profile_memory): c10's
CPU allocator reports every allocation, and every free made on a thread the profiler follows (this
one, the autograd engine's). A block a gloo worker thread frees last goes unseen: it counts until
its address is allocated again (an upper bound), and it cannot have been freed before the last op
that read it (a lower bound): `unseen_bytes` is the difference. lmsys's diagnoses (a bad step
replayed on a copy of the model, lmsys.training.peak_memory.diagnosis) take no peak.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

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
# tensors without data of their own: a plan's fake tensors left alive in the same process
DATALESS = (FakeTensor, FunctionalTensor)
Event = tuple[int, int, int]  # (time ns, address, +bytes allocated or -bytes freed)


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
        skipped: list[tuple[int, int]] = []
        pending = list(self.profile.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
        while pending:
            node = pending.pop()
            pending.extend(node.children)
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
        early = []  # each unseen free at the last read of its block before its address came back
        for ptr, born, gone in unseen:
            if gone is None and ptr in alive:
                continue  # alive at the end: its free was not missed
            ends = [e for e in reads.get(ptr, ()) if born <= e and (gone is None or e <= gone)]
            early.append((max(ends, default=born), ptr, -1))
        lower, _ = running_peak(sorted(events + early, key=lambda e: (e[0], e[2] > 0)), skipped)
        return upper, upper - lower


def running_peak(
    events: list[Event], skipped: list[tuple[int, int]]
) -> tuple[int, list[tuple[int, int, int | None]]]:
    """The peak of the live blocks over time-ordered events (none taken inside `skipped` spans),
    and the blocks whose free no event reported: (address, allocated at, allocated again at)."""
    live: dict[int, tuple[int, int]] = {}  # address -> (bytes, allocated at)
    unseen: list[tuple[int, int, int | None]] = []
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
    return peak, unseen + [(ptr, born, None) for ptr, (_, born) in live.items()]


def _cpu_addresses() -> set[int]:
    """The storage address of every CPU tensor Python holds now (by type: isinstance reads
    __class__, which some objects warn on)."""
    found = set()
    for obj in gc.get_objects():
        kind = type(obj)
        if issubclass(kind, torch.Tensor) and not issubclass(kind, DATALESS) and obj.device.type == "cpu":
            try:
                found.add(obj.untyped_storage().data_ptr())
            except RuntimeError:  # no storage (a sparse tensor, a wrapper subclass)
                pass
    return found


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if not argv:
            raise UsageError(f"usage: python -m {__spec__.name if __spec__ else PROG} OUT [overrides]")
        out, cfg = Path(argv[0]), compose(argv[1:])
        trace: list[Any] = [TensorPeak()]

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
