"""One launch per run directory (lmsys/engine/runlock.py): a requeued SLURM job (the holder's
SLURM_JOB_ID) takes the lock over from its earlier run; any other job is refused. With real
launches: tests/integration/training/test_runlock.py."""

from __future__ import annotations

import pytest

from lmsys.core.errors import ConfigError
from lmsys.engine.runlock import RunLock, holder_of


def test_a_requeued_slurm_job_takes_the_lock_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    earlier = RunLock(tmp_path / "run").acquire()  # the job's first run, its flock still held
    requeued = RunLock(tmp_path / "run").acquire()
    try:
        assert requeued.took_over is not None and requeued.took_over.slurm_job_id == "4242"
        monkeypatch.setenv("SLURM_JOB_ID", "4243")  # another job
        assert holder_of(tmp_path / "run") is not None
        with pytest.raises(ConfigError, match=r"is in use by another launch: pid \d+ on .*SLURM job 4242"):
            RunLock(tmp_path / "run").acquire()
    finally:
        requeued.release()
        earlier.release()
