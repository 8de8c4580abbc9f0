"""A full disk while saving a checkpoint or exporting, on a real small filesystem (a tmpfs, which
needs root: CI runs as root; elsewhere the test is skipped with the reason):

- the run whose run directory fills up at its third checkpoint stops with one line
  "no space left on <filesystem>: needed about N MB", exit 2, no traceback; the partial
  `.tmp-step_*` directory is gone and the previous checkpoint stays the newest (and `latest`);
- lmsys-export into the same full filesystem: one line, nothing left behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmsys.engine import checkpoint as ckpt
from tests.integration.features import REPO_ROOT, child_env, run_train

pytestmark = pytest.mark.slow

# Each checkpoint of the test model is about 0.6 MB: two fit beside the run's files, a third does not.
TMPFS_SIZE = "1400k"


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(runs, small_disk, tmp_path):
    run_dir = small_disk / "run"
    overrides = [*runs.overrides("1proc"), "logger=none", "trainer.keep_last=3"]
    run = run_train("disk-full", 1, overrides, run_dir, cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, run.stderr
    fs = f"{small_disk} (tmpfs)"
    assert errors[0].startswith(f"lmsys-train: error: no space left on {fs}: needed about 0.6 MB, "), errors
    assert (
        "checkpoint step_0000006 not saved (its partial files removed), step_0000004 stays the newest"
        in errors[0]
    )
    assert not list((run_dir / "checkpoints").glob(".tmp-*")), list((run_dir / "checkpoints").iterdir())
    found = ckpt.find_latest(run_dir, pytest.fail)
    assert found.step == 4 and ckpt.verify(found.tag_dir)["state"]["step"] == 4
    assert (run_dir / "checkpoints" / ckpt.LATEST).read_text().strip() == "step_0000004"

    # the export (about 0.2 MB) into what is left: 64 KB
    (small_disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - 64 * 1024))
    out = small_disk / "export"
    proc = subprocess.run(
        [sys.executable, "-m", "lmsys.export", str(run_dir), f"out={out}"],
        cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"lmsys-export: error: no space left on {fs}: needed about"
    ), lines
    assert sorted(p.name for p in small_disk.iterdir()) == [
        "filler",
        "run",
    ]  # no export, no temporary directory
    assert Path(run_dir / "checkpoints" / "step_0000004").is_dir()
