"""The three CLIs as a user runs them: `python -m lmsys.{export,generate,evaluate}` in fresh
processes. Bad input gets exit status 2 and one stderr line naming the problem; good input gets
the same numbers and text as the library. All calls are made once, side by side (run_clis), by
the `cli` fixture; each test reads its results."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmsys.engine.checkpoint import MARKER
from tests.fixtures.exports import SEQ, assert_one_line_error, run_clis

LONG_PROMPT = " ".join(["Return a new list of the items."] * 12)  # well over 32 tokens
CORRUPT_MESSAGE = ("corrupt", "truncated")


def _other_tokenizer(path: Path, vocab: int) -> Path:
    """A SentencePiece model of the same size trained on other text (another sha256)."""
    from lmsys.data.tokenizer import train_tokenizer
    from tests.unit.inference.test_evaluate import held_out_text

    train_tokenizer([held_out_text()] * 2 + [t[::-1] for t in [held_out_text()] * 2], vocab, path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, random_export, ds_checkpoints, tokenizer_path) -> dict[str, Path]:
    """The broken and good inputs of every call."""
    from lmsys.interop.export_dir import load_export, write_export
    from tests.unit.inference.test_evaluate import held_out_text

    root = tmp_path_factory.mktemp("cli")
    f: dict[str, Path] = {"root": root, "export": random_export}
    # A checkpoint with a truncated ZeRO partition.
    f["corrupt_ckpt"] = root / "corrupt"
    shutil.copytree(ds_checkpoints / "w2" / "zero3", f["corrupt_ckpt"])
    shard = next((f["corrupt_ckpt"] / "checkpoints" / "step_0000002").glob("*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])
    # A checkpoint whose config is not GPT-2's function (format=hf must refuse it up front).
    f["postln_ckpt"] = root / "postln"
    shutil.copytree(ds_checkpoints / "w2" / "zero0", f["postln_ckpt"])
    marker_path = f["postln_ckpt"] / "checkpoints" / "step_0000002" / MARKER
    marker = json.loads(marker_path.read_text())
    marker["state"]["config"]["model"]["block"] = "post"
    marker_path.write_text(json.dumps(marker))
    # An export whose safetensors file does not match its config.json.
    f["mismatch_export"] = root / "mismatch"
    shutil.copytree(random_export, f["mismatch_export"])
    tensors = load_file(str(random_export / "model.safetensors"))
    tensors["blocks.1.ffn.out.weight"] = torch.zeros(32, 65)
    save_file(tensors, str(f["mismatch_export"] / "model.safetensors"))
    # An export with a truncated safetensors file.
    f["truncated_export"] = root / "truncated"
    shutil.copytree(random_export, f["truncated_export"])
    weights = f["truncated_export"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    # Another tokenizer of the same size: swapped into an export, passed for a checkpoint, and
    # (properly exported with it) a model that does not match the prepared data.
    other = _other_tokenizer(root / "other.model", 512)
    f["other_tokenizer"] = other
    f["swapped_export"] = root / "swapped"
    shutil.copytree(random_export, f["swapped_export"])
    shutil.copyfile(other, f["swapped_export"] / "tokenizer.model")
    model, _, _ = load_export(random_export)
    f["other_export"] = write_export(root / "other_export", model.cfg, model.state_dict(), other)
    # Texts.
    f["text"] = root / "held_out.txt"
    f["text"].write_text(held_out_text(), encoding="utf-8")
    f["empty_text"] = root / "empty.txt"
    f["empty_text"].write_text("", encoding="utf-8")
    return f


@pytest.fixture(scope="module")
def cli(files) -> dict:
    """Each bad input of the issue once through a real process (the others of the same kind run
    in process below: same main(), no process start-up), plus the success paths. (A good export
    through the real CLI is test_main_job's.)"""
    f = files
    calls = {
        # lmsys-export
        "export-missing": ["lmsys.export", f"checkpoint={f['root'] / 'nope'}", f"out={f['root'] / 'o1'}"],
        "export-corrupt": ["lmsys.export", str(f["corrupt_ckpt"]), f"out={f['root'] / 'o2'}"],
        "export-hf-refused": ["lmsys.export", str(f["postln_ckpt"]), f"out={f['root'] / 'o3'}", "format=hf"],
        # lmsys-generate
        "generate-stream": ["lmsys.generate", str(f["export"]), "prompt=Return the", "greedy=true",
                            "max_new_tokens=12"],
        "generate-mismatch": ["lmsys.generate", str(f["mismatch_export"]), "prompt=x"],
        "generate-long": ["lmsys.generate", str(f["export"]), f"prompt={LONG_PROMPT}"],
        "generate-empty": ["lmsys.generate", str(f["export"]), "prompt="],
        "generate-tokenizer": ["lmsys.generate", str(f["swapped_export"]), "prompt=x"],
        # lmsys-eval
        "eval-text": ["lmsys.evaluate", str(f["export"]), f"text={f['text']}", "seq_len=24",
                      f"json={f['root'] / 'eval.json'}"],
    }  # fmt: skip
    return run_clis(calls)


def in_process(module: str, args: list[str], capsys) -> subprocess.CompletedProcess:
    """The CLI's main() in this process (what `python -m module` runs), as a CompletedProcess."""
    import importlib

    capsys.readouterr()
    code = importlib.import_module(module).main(args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([module, *args], code, out, err)


# ----------------------------------------------------------------------------- lmsys-export


@pytest.mark.slow
def test_export_bad_inputs(cli, files, ds_checkpoints, capsys):
    assert_one_line_error(cli["export-missing"], "lmsys-export", "does not exist")
    assert_one_line_error(cli["export-corrupt"], "lmsys-export", *CORRUPT_MESSAGE)
    assert_one_line_error(
        cli["export-hf-refused"], "lmsys-export", "format=hf needs GPT-2's function", "model.block=post",
        "(GPT-2: pre)",
    )  # fmt: skip
    zero3, other = ds_checkpoints / "w2" / "zero3", files["other_tokenizer"]
    args = [str(zero3), f"out={files['root'] / 'o4'}", f"tokenizer={other}"]
    proc = in_process("lmsys.export", args, capsys)
    assert_one_line_error(proc, "lmsys-export", "tokenizer does not match the model", "sha256")
    assert not any((files["root"] / o).exists() for o in ("o1", "o2", "o3", "o4"))  # nothing half-written


# ----------------------------------------------------------------------------- lmsys-generate


@pytest.mark.slow
def test_generate_streams_the_greedy_continuation(cli, files):
    from lmsys.inference.generation import generate, prompt_ids
    from lmsys.interop.export_dir import load_export

    proc = cli["generate-stream"]
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    model, tok, _ = load_export(files["export"])
    new = generate(model, [prompt_ids(tok, "Return the")], 12, greedy=True, eos_id=tok.eos_id)[0]
    assert proc.stdout == "Return the" + tok.decode(new) + "\n"


def test_generate_batch_with_a_truncated_prompt(files, capsys):
    from lmsys.inference.generation import Sampling, fit_prompt, generate_one, prompt_ids
    from lmsys.interop.export_dir import load_export

    args = [str(files["export"]), "prompt=Return the", f"prompt={LONG_PROMPT}", "on_long_prompt=truncate",
            "output=jsonl", "temperature=0.9", "top_k=40", "seed=5", "max_new_tokens=8"]  # fmt: skip
    proc = in_process("lmsys.generate", args, capsys)
    assert proc.returncode == 0, proc.stderr
    warnings = proc.stderr.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("lmsys-generate: warning: prompt 2 has"), proc.stderr
    assert f"seq_len={SEQ}" in warnings[0] and "kept its last" in warnings[0]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    model, tok, _ = load_export(files["export"])
    sampling = Sampling(temperature=0.9, top_k=40)
    for row, text in zip(rows, ["Return the", LONG_PROMPT], strict=True):
        ids, n_new = fit_prompt(prompt_ids(tok, text), model.cfg, 8, "truncate", warn=lambda m: None)
        new = generate_one(model, ids, n_new, sampling, tok.eos_id, seed=5)
        assert row == {"prompt": text, "completion": tok.decode(new), "new_tokens": len(new)}


@pytest.mark.slow
def test_generate_bad_inputs(cli, files, capsys):
    assert_one_line_error(
        cli["generate-mismatch"], "lmsys-generate", "'blocks.1.ffn.out.weight' has shape [32, 65]", "[32, 64]"
    )
    assert_one_line_error(
        cli["generate-long"], "lmsys-generate", "the prompt has", f"seq_len={SEQ}",
        "on_long_prompt=truncate",
    )  # fmt: skip
    assert_one_line_error(cli["generate-empty"], "lmsys-generate", "the prompt is empty")
    assert_one_line_error(
        cli["generate-tokenizer"], "lmsys-generate", "tokenizer does not match the model", "sha256"
    )
    for args, fragments in [
        ([str(files["root"] / "nope"), "prompt=x"], ["does not exist"]),
        ([str(files["corrupt_ckpt"]), "prompt=x"], CORRUPT_MESSAGE),
        ([str(files["export"]), "prompt=x", "top_p=0"], ["top_p=0.0 must be in (0, 1]"]),
        ([str(files["export"]), "prompt=x", "prompt="], ["prompt 2 is empty"]),
    ]:
        assert_one_line_error(in_process("lmsys.generate", args, capsys), "lmsys-generate", *fragments)


# ----------------------------------------------------------------------------- lmsys-eval


@pytest.mark.slow
def test_eval_text_file(cli, files):
    from lmsys.inference.evaluation import evaluate_text
    from lmsys.interop.export_dir import load_export

    proc = cli["eval-text"]
    assert proc.returncode == 0, proc.stderr
    model, tok, _ = load_export(files["export"])
    want = evaluate_text(model, tok, files["text"].read_text(encoding="utf-8"), seq_len=24)
    got = json.loads((files["root"] / "eval.json").read_text())
    assert got["tokens"] == want.tokens and got["bytes"] == want.bytes
    assert got["perplexity"] == pytest.approx(want.perplexity, rel=1e-6)
    assert got["bits_per_byte"] == pytest.approx(want.bits_per_byte, rel=1e-6)
    assert f"perplexity {want.perplexity:.3f}" in proc.stdout
    assert f"{want.bits_per_byte:.4f} bits/byte" in proc.stdout


def test_eval_bad_inputs(files, data_dir, capsys):
    f = files
    for args, fragments in [
        ([str(f["export"]), f"text={f['root'] / 'nope.txt'}"], ["nope.txt does not exist"]),
        ([str(f["export"]), f"text={f['empty_text']}"], ["the text is empty"]),
        ([str(f["truncated_export"]), f"text={f['text']}"], ["is not a readable safetensors file"]),
        ([str(f["other_export"]), f"data={data_dir}"], ["tokenizer does not match the model"]),
        ([str(f["export"]), f"data={f['root'] / 'nope'}"], ["does not exist"]),
        ([f"run={f['root']}"], ["holds no checkpoints"]),
    ]:
        assert_one_line_error(in_process("lmsys.evaluate", args, capsys), "lmsys-eval", *fragments)


# ----------------------------------------------------------------------------- in process
