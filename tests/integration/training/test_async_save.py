"""Asynchronous checkpoint saves (trainer.async_save, the default; lmsys/engine/async_save.py), with
real 2-rank runs:

- kill -9 of the whole job while a save is being written (debug.save_delay_s holds it
  between its files and its commit): the half-written checkpoint never becomes visible; resumed,
  the run continues from the last committed one with the uninterrupted run's losses, passes over
  a damaged newer checkpoint (moved aside) and keeps trainer.keep_last intact ones;
- SIGTERM while a save is pending: it completes, then the stop's own checkpoint is saved; exit 75;
- what an asynchronous save writes is byte for byte what a synchronous save writes (ZeRO-3, every
  file of every checkpoint), so export and resharding read the same files; the training matrix's
  cached runs, which the resharding and export tests read, were saved asynchronously.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lmsys.core.files import sha256_file
from lmsys.engine import checkpoint as ckpt
from tests.integration.features import TORCHRUN, child_env, kill9_when, run_train, start_job, wait_until

pytestmark = pytest.mark.slow

WAIT_S = 240  # for a save to be in flight: the run starts and saves well within a minute


def checkpoint_rows(run_dir) -> list[dict]:
    from lmsys.core.rundir import read_metrics

    return read_metrics(run_dir, "checkpoint")


def in_flight(run_dir, step: int, world_size: int = 2) -> bool:
    """The save of `step` has written every rank's files and is not committed (the debug pause)."""
    tag = ckpt.tag_for(step)
    tmp = run_dir / ckpt.CHECKPOINTS / f"{ckpt.TMP_PREFIX}{tag}"
    written = all((tmp / f"rank_{r:05d}.json").is_file() for r in range(world_size))
    return written and not (run_dir / ckpt.CHECKPOINTS / tag).exists()


def test_kill9_during_a_save_resumes_from_the_last_committed_one(runs, tmp_path):
    """Steps of 1 s, a save every 2 steps held 1.5 s before its commit: checkpoint 2 commits,
    then the job is killed while checkpoint 4 waits for its commit."""
    reference = runs.get("2proc-zero2").check()
    base = [*runs.overrides("2proc-zero2"), "logger=none"]
    slow = ["debug.step_delay_s=1.0", "debug.save_delay_s=1.5"]
    what = "checkpoint 4 in flight"
    run_dir, _, survivors = kill9_when([*base, *slow], tmp_path, what, lambda d: in_flight(d, 4), WAIT_S)
    assert survivors == []
    root = run_dir / ckpt.CHECKPOINTS
    assert ckpt.find_latest(run_dir, pytest.fail).step == 2  # the partial 4 is not even listed
    assert (root / ".tmp-step_0000004").is_dir() and not (root / "step_0000004").exists()
    # a damaged newer checkpoint (no marker) to pass over; keep the last 2 from now on
    shutil.copytree(root / "step_0000002", root / "step_0000003")
    (root / "step_0000003" / ckpt.MARKER).unlink()
    resumed_overrides = [*base, f"trainer.run_dir={run_dir}", "trainer.keep_last=2"]
    resumed = run_train("resumed", 2, resumed_overrides, run_dir, cwd=tmp_path).check()
    assert "step_0000002 (step 2)" in resumed.stdout, resumed.stdout
    assert resumed.losses() == reference.losses()  # bit for bit
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000004", "step_0000006"]
    assert not list(root.glob(".tmp-*"))
    assert [p.name for p in (root / ckpt.DAMAGED).iterdir()] == ["step_0000003"]
    assert "moved the damaged checkpoint step_0000003" in resumed.stderr
    rows = checkpoint_rows(run_dir)
    assert [r["step"] for r in rows] == [2, 4, 6], rows
    for row in rows:
        assert row["async"] is True and 0 <= row["stall_s"] and 0 < row["write_s"], row
    for tag in ("step_0000004", "step_0000006"):
        assert ckpt.verify(root / tag)["state"]["step"] == int(tag[-7:])


def test_sigterm_while_a_save_is_pending_completes_it_and_exits_75(runs, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*runs.overrides("2proc-zero2"), "logger=none", f"trainer.run_dir={run_dir}"]
    overrides += ["debug.step_delay_s=0.5", "debug.save_delay_s=3"]
    command = [sys.executable, "-m", "launch.torchrun", "--nproc", "2", "--", *overrides]
    proc = start_job(command, tmp_path)
    wait_until(proc, "checkpoint 2 in flight", lambda: in_flight(run_dir, 2), WAIT_S)
    os.killpg(proc.pid, signal.SIGTERM)  # a scheduler's preemption: every process of the job
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, out + err
    assert "Traceback" not in err, err
    stop_lines = [line for line in err.splitlines() if "preempted" in line]
    assert len(stop_lines) == 1, err
    steps = [r["step"] for r in json_lines(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    last = steps[-1]
    assert 2 < last < 6, steps  # the loop went on while checkpoint 2 was written
    assert f"saving step {last} ... saved {run_dir / ckpt.CHECKPOINTS / ckpt.tag_for(last)}" in stop_lines[0]
    # the pending save completed (and was reported before the stop line), then the stop's own
    assert f"saved checkpoint {run_dir / ckpt.CHECKPOINTS / 'step_0000002'} (loop stalled" in out
    root = run_dir / ckpt.CHECKPOINTS
    assert ckpt.verify(root / "step_0000002")["state"]["step"] == 2
    assert ckpt.find_latest(run_dir, pytest.fail).step == last
    assert not list(root.glob(".tmp-*"))


def json_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_async_saves_write_what_sync_saves_write(runs, tmp_path):
    """ZeRO-3 on 2 ranks (partitioned parameters): the cached run saved asynchronously, the same
    run saved synchronously; every file of checkpoints 2, 4, 6 has the same sha256. Export reads it."""
    cached = runs.get("2proc-zero3").check()
    assert {r["async"] for r in checkpoint_rows(cached.run_dir)} == {True}
    sync_dir = tmp_path / "sync"
    overrides = [*runs.overrides("2proc-zero3"), "logger=none", "trainer.async_save=false"]
    sync = run_train("sync", 2, overrides, sync_dir, cwd=tmp_path).check()
    assert {r["async"] for r in checkpoint_rows(sync.run_dir)} == {False}
    assert sync.losses() == cached.losses()
    for step in (2, 4, 6):
        tag = ckpt.tag_for(step)
        saved_async = ckpt.verify(cached.run_dir / ckpt.CHECKPOINTS / tag)["files"]
        saved_sync = ckpt.verify(sync_dir / ckpt.CHECKPOINTS / tag)["files"]
        assert saved_async == saved_sync, tag
    loaded = ckpt.read_checkpoint(cached.run_dir)  # what lmsys-export and lmsys-generate read
    assert loaded.info["step"] == 6 and loaded.info["zero_stage"] == 3


def test_a_zero3_save_puts_persistent_parameters_back_instead_of_gathering_them(tmp_path):
    """lmsys's save (sync and async alike) at ZeRO-3, 2 ranks: the parameters that stay whole on
    every rank are put back from their own storage, not all-gathered again as DeepSpeed's
    save_checkpoint does (one collective each: most of a ZeRO-3 save's loop stall over gloo), and
    the files are byte for byte DeepSpeed's own."""
    script = Path(__file__).with_name("zero3_save_probe.py")
    command = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), str(tmp_path)]
    proc = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["persistent"] > 0 and report["partitioned"] > 0, report  # both kinds in the model
        restored = {"gathers": 0, "whole": True, "same_storage": True, "same_values": True}
        assert report["lmsys"] == restored, report
        # DeepSpeed's own save: gathered again, into new storage (what the probe would see if the
        # restore were lost)
        assert report["deepspeed"] == {**restored, "gathers": 1, "same_storage": False}, report
    ours = tmp_path / "lmsys" / ckpt.CHECKPOINTS / ckpt.tag_for(1)
    theirs = tmp_path / "deepspeed" / ckpt.tag_for(1)
    written = sorted(p.name for p in theirs.glob("*.pt"))
    assert len(written) == 4, written  # model and optimizer states of each rank
    for name in written:
        assert sha256_file(ours / name) == sha256_file(theirs / name), name
