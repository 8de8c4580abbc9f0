"""Test-wide set-up. Runs before any test module imports triton."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests import background
from tests.sharing import xdist_worker

EXPORT_TESTS = Path(__file__).resolve().parent / "export"

# Without a GPU, Triton kernels run on CPU tensors through the interpreter. It must be chosen
# before `triton` is first imported, which is why it lives here and not in a fixture.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep CPU tests reproducible and fast on small machines.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# torch.compile's inductor cache, private to the session and shared by its subprocesses: every run
# compiles what CI compiles (a warm cache from earlier runs would hide tens of seconds), and the
# tests that build the same graph build it once.
_INDUCTOR_CACHE = None
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="lmsys-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE


def _background_fixtures(item) -> set[str]:
    """The background jobs (tests/background.py) this test waits for."""
    module = getattr(item, "module", None)
    return getattr(module, "BACKGROUND_JOBS", {}).keys() & set(getattr(item, "fixturenames", ()))


def _xdist_group(item) -> str:
    """The unit one parallel worker runs whole (tests/sharing.py): a test module, so its module
    fixtures are made once; tests/export as one, since its session jobs (the DeepSpeed checkpoint
    writers, the training runs) start with its first test and serve all of its modules."""
    path = Path(str(item.path)).resolve()
    if EXPORT_TESTS in path.parents:
        return "tests/export"
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items) -> None:
    """Tests that wait for a background job run last, when it has had the whole session to finish
    (in their own order, so module-scoped fixtures are still set up once). Under pytest-xdist each
    test gets its worker group (_xdist_group)."""
    items.sort(key=lambda item: bool(_background_fixtures(item)))  # stable
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            item.add_marker(pytest.mark.xdist_group(name=_xdist_group(item)))


def pytest_collection_finish(session) -> None:
    """Start the background jobs of the collected tests. Not in a parallel worker: every worker
    collects every test, so each would start them all; there a job starts when a test first
    asks for it (background.result), on the worker that runs its module."""
    if xdist_worker():
        return
    jobs = {}
    for item in session.items:
        for name in _background_fixtures(item):
            jobs[name] = item.module.BACKGROUND_JOBS[name]
    for name in sorted(jobs):
        background.start(name, jobs[name])


def pytest_unconfigure(config) -> None:
    background.stop_all()
    if _INDUCTOR_CACHE is not None:
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)
