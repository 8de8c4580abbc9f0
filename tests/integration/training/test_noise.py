"""What a command prints beside its own lines: a warning when this machine's cores are oversubscribed
by torch threads and lmsys training processes (two real runs at once). The command's prefix on
library warnings: tests/unit/core/test_noise.py; DeepSpeed's noise in a real run's output:
tests/integration/training/test_sweep_failure.py."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from lmsys.core.runtime import oversubscription


def test_two_runs_on_the_cores_get_a_warning():
    """The trial's case: another training process (a real one, named like lmsys.train) beside a
    run whose torch threads take every core."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "lmsys.train"])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        message = oversubscription(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
        other.kill()
        other.wait()
    assert message is not None and "other lmsys training process(es) on " in message, message
    assert "steps will be many times slower; set OMP_NUM_THREADS=" in message
    assert oversubscription(torch.device("meta")) is None  # only CPU threads compete for the cores
