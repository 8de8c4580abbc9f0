"""Test-wide set-up. Runs before any test module imports triton.

The suite has two tiers: tests/unit (in-process, fast: `make test-fast`) and tests/integration
(real launches, the commands end to end, the docs' commands: `make test` runs both). Under
pytest-xdist (`make test`) each test module runs whole on one worker (`--dist loadscope`,
pyproject.toml), so its module fixtures are made once; the session fixtures that cost a launch are
made once for all workers (tests/sharing.py).
"""

import os
import shutil
import tempfile

# One thread per process for the OpenMP and BLAS pools of this process (numpy's, imported later)
# and of the commands the tests start without an environment of their own (below: torch's).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402 (after the thread setting above)

from kernels import runtime

# The fixtures that both tiers use: made once per session (per worker under xdist; the expensive
# ones once for all workers, tests/sharing.py), visible to every test.
pytest_plugins = ["tests.fixtures.data", "tests.fixtures.exports", "tests.fixtures.family"]

# Without a GPU, Triton kernels run on CPU tensors through the interpreter. It must be chosen
# before `triton` is first imported, which is why it lives here and not in a fixture.
if not torch.cuda.is_available() and not runtime.interpreter_requested():
    runtime.request_interpreter()

# One intra-op thread per test process. The suite runs more processes than cores (pytest-xdist's
# workers, their subprocesses, other work on the machine), where a second thread mostly spins
# waiting for the first: 200 steps of a tiny model took 34 CPU-s with 2 threads on a loaded 2-core
# machine, 1.0 with one.
torch.set_num_threads(1)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# torch.compile's inductor cache, private to the session and shared by its subprocesses: every run
# compiles what CI compiles (a warm cache from earlier runs would hide tens of seconds), and the
# tests that build the same graph build it once.
_INDUCTOR_CACHE = None
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="lmsys-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE


def pytest_unconfigure(config) -> None:
    if _INDUCTOR_CACHE is not None:
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)
