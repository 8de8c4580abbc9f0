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


def pytest_collection_finish(session) -> None:
    """Start the background jobs (tests/background.py) of the collected tests' modules."""
    modules = {item.module.__name__: item.module for item in session.items if getattr(item, "module", None)}
    for module_name in sorted(modules):
        jobs = getattr(modules[module_name], "BACKGROUND_JOBS", {})
        used = {
            name
            for item in session.items
            if getattr(item, "module", None) is modules[module_name]
            for name in getattr(item, "fixturenames", ())
        }
        for name in sorted(jobs.keys() & used):
            background.start(name, jobs[name])


def pytest_unconfigure(config) -> None:
    background.stop_all()
    if _INDUCTOR_CACHE is not None:
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)
