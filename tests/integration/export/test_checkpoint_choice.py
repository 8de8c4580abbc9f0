"""Resume and every tool pick a run's checkpoint by one rule (lmsys.engine.checkpoint): the newest
complete, intact one, with newer damaged ones reported and skipped. Checked on a real
`torchrun -m lmsys.train` run (checkpoints at steps 3 and 6) whose newest checkpoint is cut short.
"""

from __future__ import annotations

import json
import shutil

import pytest

from lmsys.core.errors import CheckpointError
from lmsys.core.rundir import CHECKPOINTS
from lmsys.engine import checkpoint as ckpt
from lmsys.export import main
from lmsys.interop.export_dir import export_checkpoint, load_model
from tests.fixtures.exports import TRAIN_STEPS

pytestmark = pytest.mark.slow


@pytest.fixture
def damaged_run(trained_run, tmp_path):
    """A copy of the trained run whose newest checkpoint has a truncated optimizer partition."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = run / CHECKPOINTS / f"step_{TRAIN_STEPS:07d}"
    victim = next(newest.glob("*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:100])
    return run


def test_resume_and_export_choose_the_same_checkpoint(damaged_run, tmp_path):
    resume_warnings, export_warnings = [], []
    for_resume = ckpt.find_latest(damaged_run, resume_warnings.append)
    chosen = ckpt.resolve(damaged_run, export_warnings.append)
    assert for_resume is not None and for_resume.tag_dir == chosen.tag_dir
    assert chosen.step == 3 and isinstance(chosen.state, ckpt.TrainState)
    for warnings in (resume_warnings, export_warnings):
        assert len(warnings) == 1 and f"step_{TRAIN_STEPS:07d}" in warnings[0] and "truncated" in warnings[0]

    out = export_checkpoint(damaged_run, tmp_path / "export")
    card = (out / "README.md").read_text()  # the model card's source, as a path inside the run
    assert f"`run/checkpoints/{chosen.tag_dir.name}`" in card and str(tmp_path) not in card
    _, _, meta = load_model(damaged_run)  # lmsys-generate's and lmsys-eval's loader
    assert meta["step"] == 3 and meta["source"] == str(chosen.tag_dir)


def test_the_export_cli_reports_the_skipped_checkpoint(damaged_run, tmp_path, capsys):
    assert main([str(damaged_run), f"out={tmp_path / 'e'}"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmsys-export: warning: skipping checkpoint step_0000006")
    assert err[0].endswith("using step_0000003")


def test_a_run_without_a_usable_checkpoint_is_one_error(damaged_run):
    shutil.rmtree(damaged_run / CHECKPOINTS / "step_0000003")
    with pytest.raises(
        CheckpointError, match=r"holds no usable checkpoint: checkpoint step_0000006: .*truncated"
    ):
        ckpt.resolve(damaged_run)


def test_a_marker_without_its_train_state_is_named(trained_run, tmp_path):
    tag = tmp_path / "step_0000003"
    shutil.copytree(trained_run / CHECKPOINTS / "step_0000003", tag)
    marker = json.loads((tag / ckpt.MARKER).read_text())
    del marker["state"]["tokens_seen"]
    (tag / ckpt.MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="has no 'tokens_seen' in its train state"):
        ckpt.resolve(tag)
