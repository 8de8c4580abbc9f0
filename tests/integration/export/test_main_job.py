"""The end of the main job on a real training run (torchrun -m lmsys.train, 2 processes, ZeRO-2):

    python -m lmsys.export <run dir>                               # latest checkpoint -> <run dir>/export
    python -m lmsys.generate <run dir>/export prompt="Return the"  # a sample

plus generation straight from the checkpoint and lmsys-eval over every checkpoint of the run (the
same main() functions, in this process)."""

from __future__ import annotations

import json
import math

import pytest

from tests.fixtures.exports import SEQ, TRAIN_BATCH, TRAIN_STEPS, run_cli

PROMPT = "Return the"


@pytest.fixture(scope="module")
def main_job(trained_run) -> dict:
    """The two lines the Makefile runs after training, as real processes."""
    exported = run_cli("lmsys.export", str(trained_run))
    assert exported.returncode == 0, exported.stderr
    sample = run_cli("lmsys.generate", str(trained_run / "export"), f"prompt={PROMPT}", "greedy=true",
                     "max_new_tokens=16")  # fmt: skip
    return {"export": exported, "sample": sample}


def in_process(module: str, args: list[str], capsys) -> tuple[int, str, str]:
    import importlib

    capsys.readouterr()
    code = importlib.import_module(module).main(args)
    return (code, *capsys.readouterr())


def _records(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


@pytest.mark.slow
def test_export_of_the_run_directory(main_job, trained_run):
    from lmsys.interop.export_dir import load_export

    out = trained_run / "export"
    assert main_job["export"].stdout.startswith(f"lmsys-export: wrote {out} (lmsys format, fp32")
    assert main_job["export"].stderr == ""
    model, tok, meta = load_export(out)
    assert meta["step"] == TRAIN_STEPS and meta["zero_stage"] == 2 and meta["world_size"] == 2
    assert model.unembed.weight is model.tok_emb.weight  # tiny is tied
    card = (out / "README.md").read_text()
    train, evals = _records(trained_run, "train"), _records(trained_run, "eval")
    assert evals[-1]["step"] == TRAIN_STEPS
    for fragment in (
        "| preset | `tiny` |",
        f"| optimizer steps | {TRAIN_STEPS} |",
        f"| tokens seen | {TRAIN_STEPS * TRAIN_BATCH * SEQ:,} |",
        f"| final train loss | {train[-1]['loss']:.4f} |",
        f"| final validation loss | {evals[-1]['loss']:.4f} (at step {TRAIN_STEPS};",
    ):
        assert fragment in card, card


@pytest.mark.slow
def test_a_sample_from_the_export_and_from_the_checkpoint(main_job, trained_run, capsys):
    sample = main_job["sample"]
    assert sample.returncode == 0, sample.stderr
    assert sample.stderr == ""
    # a continuation (a tiny model's greedy one may well be whitespace), then print's newline
    assert sample.stdout.startswith(PROMPT) and len(sample.stdout.removesuffix("\n")) > len(PROMPT)
    args = [str(trained_run), f"prompt={PROMPT}", "greedy=true", "max_new_tokens=16"]
    code, out, err = in_process("lmsys.generate", args, capsys)  # straight from the checkpoint
    assert code == 0, err
    assert out == sample.stdout  # the export is the checkpoint's model


@pytest.mark.slow
def test_eval_over_every_checkpoint_of_the_run(main_job, trained_run, data_dir, tmp_path, capsys):
    from lmsys.inference.evaluation import evaluate_tokens, split_tokens
    from lmsys.interop.export_dir import load_export

    code, out, err = in_process("lmsys.evaluate", [f"run={trained_run}", f"json={tmp_path / 'eval.json'}",
                                                   "max_tokens=2000"], capsys)  # fmt: skip
    assert code == 0, err
    rows = json.loads((tmp_path / "eval.json").read_text())["rows"]
    assert [r["step"] for r in rows] == [3, TRAIN_STEPS]
    tags = ("step_0000003", "step_0000006")
    table = [line.split() for line in out.splitlines() if line.strip().endswith(tags)]
    assert [int(t[0]) for t in table] == [3, TRAIN_STEPS]
    png = trained_run / "eval.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in out
    # The last row is the exported model's loss on the same tokens.
    model, tok, _ = load_export(trained_run / "export")
    want = evaluate_tokens(model, tok, split_tokens(data_dir, tok, "val")[:2000])
    assert math.isclose(rows[-1]["loss"], want.loss, rel_tol=1e-6)
    assert math.isclose(rows[-1]["bits_per_byte"], want.bits_per_byte, rel_tol=1e-6)
    assert rows[0]["loss"] != rows[-1]["loss"]  # each row is its own checkpoint's weights


@pytest.mark.slow
def test_exporting_again_replaces_the_runs_own_export(main_job, trained_run, capsys):
    """The main job's export line can be re-run (after more training): <run>/export, an earlier
    export of the same run and format, is replaced without overwrite=true."""
    from lmsys.export import main

    before = (trained_run / "export" / "model.safetensors").stat().st_mtime_ns
    assert main([str(trained_run), "verify=false"]) == 0
    assert (trained_run / "export" / "model.safetensors").stat().st_mtime_ns != before
    assert "wrote" in capsys.readouterr().out


@pytest.fixture
def run_copy(main_job, trained_run, tmp_path):
    """A copy of the trained run with its lmsys-format export, to change freely."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    return run


@pytest.mark.slow
def test_an_export_holding_the_users_files_is_never_replaced(run_copy, capsys):
    from lmsys.export import main

    notes = run_copy / "export" / "notes.txt"
    notes.write_text("mine")
    before = {p.name: p.read_bytes() for p in (run_copy / "export").iterdir()}
    for extra in ([], ["overwrite=true"]):
        assert main([str(run_copy), "verify=false", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "holds 'notes.txt'" in err[0] and "did not write" in err[0], err
    assert {p.name: p.read_bytes() for p in (run_copy / "export").iterdir()} == before


@pytest.mark.slow
def test_each_format_has_its_own_default_directory(run_copy, capsys):
    from lmsys.export import main

    lmsys_export = {p.name: p.read_bytes() for p in (run_copy / "export").iterdir()}
    assert main([str(run_copy), "format=hf", "verify=false"]) == 0
    assert (run_copy / "export-hf" / "tokenizer.json").is_file()
    assert {p.name: p.read_bytes() for p in (run_copy / "export").iterdir()} == lmsys_export


@pytest.mark.slow
def test_another_runs_export_needs_overwrite(run_copy, trained_run, tmp_path, capsys):
    """out= holding an export of another run (here: the original run's) is not replaced silently."""
    import os

    from lmsys.export import main

    out = tmp_path / "exported"
    assert main([str(trained_run), f"out={out}", "verify=false"]) == 0
    capsys.readouterr()
    assert main([str(run_copy), f"out={out}", "verify=false"]) == 2
    assert "already exists (a lmsys-format export)" in capsys.readouterr().err
    assert main([str(run_copy), f"out={out}", "verify=false", "overwrite=true"]) == 0
    mask = os.umask(0)
    os.umask(mask)
    for path in out.iterdir():  # the usual permissions, not safetensors' 0600
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask, path
