"""How the tests' own torchrun scripts end (tests/integration/training/zero3_save_probe.py,
tests/integration/export/ds_checkpoints.py): after their files are written and the group is left, without the
interpreter's shutdown.

dist.destroy_process_group() waits for the collectives in flight, but does not end gloo's threads
in these processes: DeepSpeed's engine stays referenced (by hooks registered in torch) and holds
the process groups, so each group's pt_gloo_runloop and gloo_tcp_loop threads are still there when
the interpreter shuts down (listed from /proc/self/task after destroy_process_group, engine deleted
and gc run). A gloo thread that needs the GIL during that shutdown aborts the process (SIGABRT):
shown here with a Python callback on an all_reduce's future still running at shutdown; a worker
letting go of its last collective's tensors just after the collective completes is the likely
case, with the message "terminate called without an active exception". CI hit that abort once in
zero3_save_probe.py (2026-11-28); 69 runs of the probe here, 45 of them beside 2 more copies, did
not, so the cause is likely, not proven.
The scripts' results are their files, so skipping the shutdown loses nothing.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave(rank: int) -> NoReturn:
    """Leave the process group and end the process, its output flushed (call it last)."""
    import torch.distributed as dist

    dist.barrier()  # every rank's files are written before any rank leaves
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    sys.stderr.flush()
    os._exit(0)
