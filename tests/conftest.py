"""Test-wide set-up. Runs before any test module imports triton."""

import os
import shutil
import tempfile

import pytest
import torch

from tests import background
from tests.sharing import xdist_worker

EXPORT_TESTS = "tests/export"  # as node ids name it (relative to the repository)

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


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent when pytest-xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (make test TEST_WORKERS=3), the unit one worker runs whole
    (tests/sharing.py): a test module, so its module fixtures are made once; tests/export as
    one, since its session jobs (the DeepSpeed checkpoint writers, the training runs) start
    with its first test and serve all of its modules."""
    from xdist.scheduler import LoadScopeScheduling  # only where xdist runs the session

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return EXPORT_TESTS if module.startswith(EXPORT_TESTS + "/") else module

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(session, config, items) -> None:
    """Tests that wait for a background job run last, when it has had the whole session to finish
    (in their own order, so module-scoped fixtures are still set up once)."""
    items.sort(key=lambda item: bool(_background_fixtures(item)))  # stable


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
