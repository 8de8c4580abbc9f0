"""The parallel schedule of `make test` (tests/conftest.py's hooks under pytest-xdist), run for
real: `pytest -n 3` on a synthetic tree of test modules named like the suite's, with this suite's
scheduler and ordering hooks. Each unit (a module, or all of tests/export) must run whole on one
worker, every test exactly once, and the units must start longest first (SLOWEST_SCOPES, then
the largest), with a unit that waits for a background job (tests/background.py) sent last. A
scheduler that sorts another process's copy of the collection breaks the first two: xdist sends
each worker indexes into its own collection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import SLOWEST_SCOPES, worker_unit

REPO_ROOT = Path(__file__).resolve().parents[1]

TEST_BODY = """
import json, os


def _record(request):
    with open(os.environ["SCHEDULE_LOG"], "a") as log:
        row = {"worker": os.environ["PYTEST_XDIST_WORKER"], "test": request.node.nodeid}
        log.write(json.dumps(row) + "\\n")
"""

# The root conftest of the synthetic tree: the suite's hooks, the scheduler's sends logged in order.
HOOKS = """
import json, os
from tests.conftest import pytest_collection_modifyitems
from tests.conftest import pytest_xdist_make_scheduler as suite_scheduler


def pytest_xdist_make_scheduler(config, log):
    scheduler = suite_scheduler(config, log)
    assign = scheduler._assign_work_unit

    def logged(node):
        unit = next(iter(scheduler.workqueue))  # the unit it sends: the queue's first
        assign(node)
        with open(os.environ["DISPATCH_LOG"], "a") as dispatch_log:
            dispatch_log.write(json.dumps(unit) + "\\n")

    scheduler._assign_work_unit = logged
    return scheduler
"""

# {module path: number of tests}: three named units (one of them tests/export, in two modules),
# three that are not named, of different sizes, and one whose tests wait for a background job.
WAITING_UNIT = "tests/kernels/test_waits.py"
TREE = {
    "tests/export/test_one.py": 2,
    "tests/export/test_two.py": 3,
    SLOWEST_SCOPES[1]: 1,
    SLOWEST_SCOPES[2]: 2,
    "tests/unnamed/test_large.py": 5,
    "tests/unnamed/test_medium.py": 3,
    "tests/unnamed/test_small.py": 1,
    WAITING_UNIT: 6,
}
# the waiting unit's module: a background job (never started here: only the ordering hooks run)
# and a fixture of its name
WAITING_HEADER = """
import pytest

BACKGROUND_JOBS = {"job": None}


@pytest.fixture
def job():
    return None
"""


def start_order(units: dict[str, int]) -> list[str]:
    """The order the hooks must start units in: SLOWEST_SCOPES first, the rest by size, the unit
    that waits for a background job last."""
    named = [u for u in SLOWEST_SCOPES if u in units]
    rest = sorted(
        (u for u in units if u not in SLOWEST_SCOPES and u != WAITING_UNIT), key=lambda u: (-units[u], u)
    )
    return named + rest + [WAITING_UNIT]


def test_three_workers_run_each_unit_whole_longest_first(tmp_path):
    assert "tests/export" == SLOWEST_SCOPES[0], "TREE names SLOWEST_SCOPES[0] as tests/export's modules"
    for module, n in TREE.items():
        path = tmp_path / module
        path.parent.mkdir(parents=True, exist_ok=True)
        waits = module == WAITING_UNIT
        fixtures = "request, job" if waits else "request"
        tests = "".join(f"\n\ndef test_{i}({fixtures}):\n    _record(request)\n" for i in range(n))
        path.write_text((WAITING_HEADER if waits else "") + TEST_BODY + tests)
    # the suite's own hooks, imported from this checkout (a conftest at the synthetic root)
    (tmp_path / "conftest.py").write_text(HOOKS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    log, dispatch_log = tmp_path / "schedule.jsonl", tmp_path / "dispatch.jsonl"
    env = {
        **os.environ,
        "SCHEDULE_LOG": str(log),
        "DISPATCH_LOG": str(dispatch_log),
        "PYTHONPATH": str(REPO_ROOT),
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "3", "-p", "no:cacheprovider"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in log.read_text().splitlines()]

    expected = {f"{module}::test_{i}" for module, n in TREE.items() for i in range(n)}
    ran = [row["test"] for row in rows]
    assert sorted(ran) == sorted(expected)  # every test, once

    units: dict[str, int] = defaultdict(int)
    for module, n in TREE.items():
        units[worker_unit(module)] += n
    order = start_order(units)
    workers_of: dict[str, set[str]] = defaultdict(set)
    runs_by_worker: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        unit = worker_unit(row["test"])
        workers_of[unit].add(row["worker"])
        if not runs_by_worker[row["worker"]] or runs_by_worker[row["worker"]][-1] != unit:
            runs_by_worker[row["worker"]].append(unit)
    assert all(len(w) == 1 for w in workers_of.values()), dict(workers_of)  # each unit whole
    for worker, sequence in runs_by_worker.items():
        # a worker runs its units one after another, in the start order
        assert len(sequence) == len(set(sequence)), (worker, sequence)
        assert sequence == sorted(sequence, key=order.index), (worker, sequence, order)
    # The units are sent in the start order, the one that waits for a background job last. (When
    # it starts is not the scheduler's to decide: xdist sends a worker its next unit while it still
    # has two tests to run, so a fast worker may start it before a slow one starts a unit it was
    # sent earlier. The suite's units take minutes; here they take milliseconds.)
    dispatched = [json.loads(line) for line in dispatch_log.read_text().splitlines()]
    assert dispatched == order, (dispatched, order)
    # the three longest units are the first each worker starts with
    assert sorted(seq[0] for seq in runs_by_worker.values()) == sorted(order[:3]), (runs_by_worker, order)
