"""Test-wide set-up. Runs before any test module imports triton."""

import os
import shutil
import tempfile

import torch

from tests import background

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


def pytest_collection_modifyitems(session, config, items) -> None:
    """Tests that wait for a background job run last, when it has had the whole session to finish
    (in their own order, so module-scoped fixtures are still set up once)."""
    items.sort(key=lambda item: bool(_background_fixtures(item)))  # stable


def pytest_collection_finish(session) -> None:
    """Start the background jobs of the collected tests."""
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
