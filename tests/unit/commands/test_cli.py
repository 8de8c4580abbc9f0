"""The commands' main() in this process, on what needs no run: --help and usage mistakes of
lmsys-export, lmsys-generate and lmsys-evaluate, a directory that is not a checkpoint, an export
with no run around it (no default out=), and compile=true with harness=. The commands as a user
runs them: tests/integration/export/test_cli.py."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("module", ["lmsys.export", "lmsys.generate", "lmsys.evaluate"])
def test_help_and_usage_errors(module, capsys):
    import importlib

    main = importlib.import_module(module).main
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "usage: lmsys-" in text and "Errors print one line" in text
    assert main(["colour=blue"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown option 'colour'" in err[0], err
    assert main(["a", "b"]) == 2  # only the first argument may be a bare value
    assert "argument 'b' is not key=value" in capsys.readouterr().err


def test_export_of_a_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    from lmsys.export import main

    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), f"out={tmp_path / 'o'}"]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err


def test_default_out_needs_a_run(tmp_path, random_export, capsys):
    from lmsys.export import main

    assert main([str(random_export)]) == 2  # an export directory is not inside a run: no default out
    assert "out= is required" in capsys.readouterr().err


def test_harness_runs_refuse_compile_true(random_export, capsys):
    from lmsys.evaluate import main

    assert main([str(random_export), "harness=hellaswag", "compile=true"]) == 2
    assert (
        "compile=true compiles perplexity runs; harness= runs lm_eval's requests eager"
        in capsys.readouterr().err
    )
