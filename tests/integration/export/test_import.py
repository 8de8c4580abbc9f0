"""lmsys-import as a command: it writes an export and prints where, and every mistake (a missing
directory, another model type, no weights, weights that would run code when unpickled, a tokenizer
of another size, an existing destination, no out=) is one error line and writes nothing."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from tests.fixtures.exports import assert_one_line_error, run_clis


class _RunsCode:
    """A pickle that would run a shell command when unpickled (what weights_only refuses)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def cli(tmp_path_factory, hf_gpt2_dir, gpt2_import, tokenizer_path) -> dict:
    root = tmp_path_factory.mktemp("import_cli")
    gemma = root / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({"model_type": "gemma", "hidden_size": 8}))
    no_weights = root / "no_weights"
    no_weights.mkdir()
    shutil.copyfile(hf_gpt2_dir / "config.json", no_weights / "config.json")
    unsafe = root / "unsafe"
    shutil.copytree(no_weights, unsafe)
    marker = root / "code-ran"
    (unsafe / "pytorch_model.bin").write_bytes(pickle.dumps({"wte.weight": _RunsCode(marker)}))
    results = run_clis(
        {
            "ok": ["lmsys.hf_import", str(hf_gpt2_dir), f"out={root / 'imported'}"],
            "help": ["lmsys.hf_import", "--help"],
            "missing": ["lmsys.hf_import", str(root / "nope"), f"out={root / 'o1'}"],
            "gemma": ["lmsys.hf_import", str(gemma), f"out={root / 'o2'}"],
            "no-weights": ["lmsys.hf_import", str(no_weights), f"out={root / 'o3'}"],
            "unsafe": ["lmsys.hf_import", str(unsafe), f"out={root / 'o4'}"],
            "tokenizer-size": [
                "lmsys.hf_import",
                str(hf_gpt2_dir),
                f"out={root / 'o5'}",
                f"tokenizer={tokenizer_path}",
            ],
            "exists": ["lmsys.hf_import", str(hf_gpt2_dir), f"out={gpt2_import}"],
            "no-out": ["lmsys.hf_import", str(hf_gpt2_dir)],
        }
    )
    return {"root": root, "marker": marker, **results}


def test_the_command(cli):
    ok = cli["ok"]
    assert ok.returncode == 0, ok.stderr
    assert (
        ok.stdout.startswith(f"lmsys-import: wrote {cli['root'] / 'imported'} (lmsys format, fp32")
        and ok.stderr == ""
    )
    assert cli["help"].returncode == 0 and "GPT2LMHeadModel.save_pretrained" in cli["help"].stdout


@pytest.mark.parametrize(
    "case, fragments",
    [("missing", ["is not a directory"]),
     ("gemma", ["has model_type 'gemma'; lmsys reads checkpoints of model_type gpt2, llama, qwen2"]),
     ("no-weights", ["holds no weights (looked for model.safetensors"]),
     ("unsafe", ["cannot be read safely: torch.load(weights_only=True) refused it", "never code"]),
     ("tokenizer-size", ["has 512 pieces, model.vocab_size=384"]),
     ("exists", ["already exists"]),
     ("no-out", ["out= is required"])],
)  # fmt: skip
def test_mistakes_are_one_line_and_write_nothing(cli, case, fragments):
    assert_one_line_error(cli[case], "lmsys-import", *fragments)
    assert not cli["marker"].exists()  # the pickle's code never ran
    assert not list(cli["root"].glob("o[0-9]*")) and not list(cli["root"].glob(".tmp-*"))
