"""What the workers of one test session share when it runs in parallel (pytest-xdist:
`make test`, 3 workers): the expensive session fixtures are made once, under a file lock, in a
directory every worker sees; each test module runs whole on one worker (tests/conftest.py's
scheduler), so module fixtures are made once too. Without xdist the same code runs in one process.

Why in parallel at all: most of a test's time is a subprocess starting (torch, DeepSpeed) or
waiting (a rank's step delay, a rendezvous, a SLURM requeue); one at a time, the suite left about
a third of two cores idle.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def xdist_worker() -> str | None:
    """This process's pytest-xdist worker id (gw0, gw1, ...), None when not a worker."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """<the session's temporary root>/<name>: the same directory for every worker of the session
    (xdist gives each worker its own base below the session's root)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if xdist_worker() else base
    path = root / f"shared-{name}"
    path.mkdir(exist_ok=True)
    return path
