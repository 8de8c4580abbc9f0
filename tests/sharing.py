"""What the workers of one test session share when it runs in parallel (pytest-xdist: `make test`):
the session fixtures that cost a launch (a training run, prepared data, DeepSpeed checkpoints)
are made once, under a file lock, in a directory every worker sees. Without xdist the same code
runs in one process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def xdist_worker() -> str | None:
    """This process's pytest-xdist worker id (gw0, gw1, ...), None when not a worker."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """<the session's temporary root>/shared-<name>: the same directory for every worker of the
    session (xdist gives each worker its own base below the session's root)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if xdist_worker() else base
    path = root / f"shared-{name}"
    path.mkdir(exist_ok=True)
    return path


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """shared_dir(name), filled by `make(directory)` in the first process of the session that asks
    for it; the others wait for the lock and read what it made. A `make` that fails leaves nothing
    marked made: the next to ask tries again (and reports its own failure)."""
    path = shared_dir(tmp_path_factory, name)
    with FileLock(path / ".lock"):
        made = path / ".made"
        if not made.is_file():
            make(path)
            made.touch()
    return path
