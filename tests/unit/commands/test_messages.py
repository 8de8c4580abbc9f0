"""Messages that name the key and the way out: a run directory without a checkpoint, an
empty prompts file, a model.init_from of another architecture, a destination one cannot write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmsys.core.errors import ConfigError
from lmsys.interop.export_dir import initial_model
from tests.fixtures.exports import small_config


def _one_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


def test_export_of_a_run_without_a_checkpoint(tmp_path, capsys):
    from lmsys.export import main

    run = tmp_path / "runs" / "main-1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"launches": []}))
    assert main([str(run)]) == 2
    line = _one_error(capsys, "lmsys-export")
    assert f"run directory {run} has no checkpoint yet" in line and "is not a checkpoint" not in line
    assert "trainer.save_interval" in line


def test_an_empty_prompts_file(random_export, tmp_path, capsys):
    from lmsys.generate import main

    empty = tmp_path / "prompts.txt"
    empty.write_text("")
    assert main([str(random_export), f"prompts={empty}"]) == 2
    line = _one_error(capsys, "lmsys-generate")
    assert f"prompts={empty} is empty" in line and "one prompt per line" in line


def test_init_from_another_architecture_names_the_presets(random_export, tokenizer_path):
    from lmsys.core.files import sha256_file

    with pytest.raises(ConfigError) as e:
        initial_model(random_export, small_config("seed_postln"), sha256_file(tokenizer_path))
    message = str(e.value)
    assert "the export is tiny (pre-LN" in message and "the run is seed_postln (post-LN" in message
    assert "more" not in message


def test_an_unwritable_destination_is_named_as_given(random_export, capsys):
    """/sys refuses new entries even to root: the line names out=, not the temporary directory."""
    from lmsys.export import main

    if not Path("/sys").is_dir():
        pytest.skip("no /sys here")
    assert main([f"checkpoint={random_export}", "out=/sys/e"]) == 2
    line = _one_error(capsys, "lmsys-export")
    assert "/sys/e" in line and ".tmp-" not in line and "[Errno" not in line, line
