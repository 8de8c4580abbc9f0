"""Test-wide set-up. Runs before any test module imports triton."""

import os
import shutil
import tempfile
from collections import Counter

import pytest
import torch

from kernels import runtime
from tests import background
from tests.sharing import xdist_worker

EXPORT_TESTS = "tests/export"  # as node ids name it (relative to the repository)

# The units that take longest under `make test` (3 workers), longest first (seconds of wall time
# per unit, 2026-11-27, docs/performance.md): they start first, so no long unit is left to run alone
# at the end. Units not named follow, the largest (in tests) first, and last the units whose tests
# wait for a background job (tests/tools/test_inspect.py's tools.inspect subset, about 5
# CPU-minutes), which by then has had the session's idle cores.
SLOWEST_SCOPES = (
    EXPORT_TESTS,  # 762
    "tests/launch/test_slurm.py",  # 273
    "tests/train/test_matrix.py",  # 270
    "tests/model/test_compile.py",  # 258
    "tests/launch/test_sweep.py",  # 239
    "tests/launch/test_torchrun.py",  # 222
    "tests/test_docs_commands.py",  # 218
    "tests/kernels/test_flash_attention.py",  # 212
    "tests/llama/test_fine_tune.py",  # 76 alone with -n 0, 195 beside other work (2026-11-28)
    "tests/model/test_properties.py",  # 196
    "tests/train/test_sequence_parallel.py",  # 183 with -n 0 beside other work
    "tests/train/test_reshard.py",  # 184
    "tests/kernels/test_linear_cross_entropy.py",  # 170
    "tests/train/test_resume.py",  # 166
    "tests/train/test_runlock.py",  # 156
    "tests/train/test_compile_train.py",  # 125
)

# Without a GPU, Triton kernels run on CPU tensors through the interpreter. It must be chosen
# before `triton` is first imported, which is why it lives here and not in a fixture.
if not torch.cuda.is_available() and not runtime.interpreter_requested():
    runtime.request_interpreter()

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
    """Under pytest-xdist (make test: 3 workers), the unit one worker runs whole
    (tests/sharing.py): a test module, so its module fixtures are made once; tests/export as
    one, since its session jobs (the DeepSpeed checkpoint writers, the training runs) start
    with its first test and serve all of its modules."""
    from xdist.scheduler import LoadScopeScheduling  # only where xdist runs the session

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_unit(nodeid)

        def schedule(self) -> None:
            # The workers' collection order (pytest_collection_modifyitems: the longest units
            # first) is the order units are sent in; xdist's own (by number of tests) would leave
            # the few long tests of the launch modules to the end. The order must be the workers'
            # own: xdist sends each worker indexes into its collection.
            self.config.option.loadscopereorder = False
            super().schedule()

    return ModuleScheduling(config, log)


def worker_unit(nodeid: str) -> str:
    """What one xdist worker runs whole: a test module, or tests/export."""
    module = nodeid.split("::", 1)[0]
    return EXPORT_TESTS if module.startswith(EXPORT_TESTS + "/") else module


def pytest_configure(config) -> None:
    if not xdist_worker():  # the controlling process, before any worker starts
        background.open_session()


def pytest_collection_modifyitems(session, config, items) -> None:
    """Tests that wait for a background job run last, when it has had the whole session to finish
    (in their own order, so module-scoped fixtures are still set up once). In an xdist worker, the
    units are ordered longest first (SLOWEST_SCOPES, then the largest), then the units with a test
    that waits for a background job, and such tests last within their unit."""
    if not xdist_worker():
        items.sort(key=lambda item: bool(_background_fixtures(item)))  # stable
        return
    sizes = Counter(worker_unit(item.nodeid) for item in items)
    waiting = {worker_unit(item.nodeid) for item in items if _background_fixtures(item)}

    def start_order(item) -> tuple[bool, int, int, str, bool]:
        unit = worker_unit(item.nodeid)
        slow = SLOWEST_SCOPES.index(unit) if unit in SLOWEST_SCOPES else len(SLOWEST_SCOPES)
        return unit in waiting, slow, -sizes[unit], unit, bool(_background_fixtures(item))

    items.sort(key=start_order)


def pytest_collection_finish(session) -> None:
    """Start the background jobs of the collected tests (under xdist every worker collects every
    test; the first to claim a job starts it: tests/background.py)."""
    jobs = {}
    for item in session.items:
        for name in _background_fixtures(item):
            jobs[name] = item.module.BACKGROUND_JOBS[name]
    for name in sorted(jobs):
        background.start(name, jobs[name])


def pytest_unconfigure(config) -> None:
    if not xdist_worker():  # after every worker
        background.close_session()
    if _INDUCTOR_CACHE is not None:
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)
