"""A model trained at data.seq_len shorter than its model.max_seq_len is read at the length it was
trained at: the export records it, and lmsys-eval and lmsys-generate take it as their window by
default and warn when asked to go past it (positions past it were never trained)."""

from __future__ import annotations

import json

from lmsys.engine.checkpoint import resolve
from lmsys.interop.export_dir import export_provenance
from lmsys.model.weights import read_safetensors
from tests.fixtures.exports import SEQ, SHORT_SEQ


def _loss(capsys, *args: str) -> tuple[float, str, str]:
    """lmsys-eval in this process: (loss, stdout, stderr)."""
    from lmsys.evaluate import main

    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if "loss " in ln)
    return float(line.split("loss ")[1].split()[0]), out, err


def test_the_trained_length_is_the_default_window(short_run, data_dir, tmp_path, capsys):
    from lmsys.export import main as export_main
    from lmsys.generate import main as generate_main

    assert resolve(short_run).state.config["data"]["seq_len"] == SHORT_SEQ < SEQ
    export = tmp_path / "export"
    assert export_main([str(short_run), f"out={export}"]) == 0, capsys.readouterr().err
    assert export_provenance(export)["trained_seq_len"] == SHORT_SEQ
    assert json.loads((export / "config.json").read_text())["max_seq_len"] == SEQ
    # nothing local leaks into what one publishes: the header metadata and the card name the run
    _, header = read_safetensors(export / "model.safetensors")
    local = str(short_run.parent)
    assert all(local not in value for value in header.values()), header
    assert local not in (export / "README.md").read_text()
    meta = export_provenance(export)
    assert "run_dir" not in meta and meta["source"] == "run/checkpoints/step_0000002", meta
    assert export_main([str(short_run), f"out={export}"]) == 0  # the same run's export is replaced
    capsys.readouterr()

    data = [f"data={data_dir}", "max_tokens=600"]
    default, out, err = _loss(capsys, str(export), *data)
    assert f"windows of {SHORT_SEQ} tokens" in out and "warning" not in err
    trained, _, _ = _loss(capsys, str(export), *data, f"seq_len={SHORT_SEQ}")
    longer, _, err = _loss(capsys, str(export), *data, f"seq_len={SEQ}")
    assert default == trained != longer
    assert f"seq_len={SEQ} goes past the length the model was trained at ({SHORT_SEQ} tokens" in err
    from_checkpoint, out, _ = _loss(capsys, str(short_run), *data)  # the checkpoint knows it too
    assert f"windows of {SHORT_SEQ} tokens" in out and from_checkpoint == default

    prompt = ["prompt=The value", "greedy=true", "stream=false", f"max_new_tokens={SEQ}"]
    assert generate_main([str(export), *prompt]) == 0
    err = capsys.readouterr().err
    assert "capped to" in err and f"seq_len={SHORT_SEQ} + 1" in err
    assert generate_main([str(export), *prompt, f"seq_len={SEQ}"]) == 0
    assert f"seq_len={SEQ} goes past the length the model was trained at" in capsys.readouterr().err
