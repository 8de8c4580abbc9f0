"""A run and the data it trains on, with real runs:

- a run outlives its data directory prepared again: lmsys-prepare refuses to replace prepared
  data unasked; once told (data.overwrite=true), the run still exports and generates with the
  copy of its tokenizer it keeps, a resume is refused in one line that says how to go on, and
  going on as it says resumes;
- an id past the vocabulary in data too large to check in full when opened (the limits lowered
  by tests/integration/training/sampled_train.py) stops both ranks of a launch at the same step in one line
  naming the shard and position, never an IndexError.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from lmsys.core.config import compose
from lmsys.core.files import sha256_file
from lmsys.data.preparation import prepare
from lmsys.engine.run_tokenizer import TOKENIZER_DIR
from tests.integration.features import COMMON, REPO_ROOT, SEQ, VOCAB, child_env, run_train
from tests.stdlib_text import write_docstring_files

pytestmark = pytest.mark.slow

# seed_gpt (no norms, tied W_U = W_E), shrunk like every run of these tests
SEED_GPT = ["model=seed_gpt", *COMMON, "trainer.max_steps=4", "trainer.micro_batch_size=8"]


def _prepare(sources, out, *extra: str) -> None:
    overrides = [f"data.sources=[{sources}]", f"data.dir={out}", f"model.vocab_size={VOCAB}",
                 "data.val_fraction=0.1", "data.num_workers=1", *extra]  # fmt: skip
    prepare(compose(overrides))


def test_a_run_outlives_its_data_prepared_again(tmp_path, capsys):
    from lmsys.export import main as export_main
    from lmsys.generate import main as generate_main
    from lmsys.prepare import main as prepare_main

    first, second = tmp_path / "mail", tmp_path / "web"
    write_docstring_files(first, ["email.message", "email.utils", "mailbox", "smtplib", "imaplib"])
    write_docstring_files(second, ["http.client", "urllib.request", "html.parser", "socketserver"])
    data, run_dir = tmp_path / "data", tmp_path / "run"
    _prepare(first, data)
    trained = run_train("seed_gpt", 1, [*SEED_GPT, f"data.dir={data}"], run_dir, cwd=tmp_path).check()
    kept = run_dir / TOKENIZER_DIR / "tokenizer.model"
    assert sha256_file(kept) == sha256_file(data / "tokenizer.model")

    capsys.readouterr()
    again = [f"data.sources=[{second}]", f"data.dir={data}", f"model.vocab_size={VOCAB}"]
    assert prepare_main(again) == 2  # never replaced unasked
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"data.dir={data.resolve()} was prepared from other sources" in line, line
    assert prepare_main([*again, "data.overwrite=true"]) == 0
    assert sha256_file(data / "tokenizer.model") != sha256_file(kept)

    export = tmp_path / "export"
    assert export_main([str(run_dir), f"out={export}"]) == 0
    assert sha256_file(export / "tokenizer.model") == sha256_file(kept)
    capsys.readouterr()
    for model in (export, run_dir):  # the export, and the checkpoint itself
        assert generate_main([str(model), "prompt=The message", "max_new_tokens=5", "stream=false"]) == 0
    assert capsys.readouterr().out.count("The message") == 2

    more = [*SEED_GPT, f"data.dir={data}", "trainer.max_steps=6"]
    refused = run_train("resume", 1, more, run_dir, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("lmsys-train: error: cannot resume: the data's tokenizer"), line
    hint = f"data.tokenizer={run_dir}/{TOKENIZER_DIR}"
    assert hint in line, line

    # as the line says: the run's sources prepared again with the tokenizer it keeps
    _prepare(first, tmp_path / "data-again", hint)
    resumed = run_train("resumed", 1, [*more, f"data.dir={tmp_path / 'data-again'}"], run_dir, cwd=tmp_path)
    assert f"resumed from {run_dir}/checkpoints/step_0000004" in resumed.check().stdout
    assert max(resumed.losses()) == 6 and trained.losses().keys() <= resumed.losses().keys()


def _poison_train_split(data_dir, value: int) -> tuple[str, int]:
    """An id past the vocabulary in the middle of the last train shard: (its file, position)."""
    manifest = json.loads((data_dir / "manifest.json").read_text())
    shard = [s for s in manifest["shards"] if s["split"] == "train"][-1]
    ids = np.fromfile(data_dir / shard["file"], dtype="<u2")
    where = len(ids) // 2 + 3
    ids[where] = value
    ids.tofile(data_dir / shard["file"])
    return shard["file"], where


def test_an_id_past_the_vocabulary_stops_every_rank_in_one_line(tmp_path):
    """Two ranks under launch.torchrun, their data a corpus larger than the (lowered) limits of the
    full check on opening, one id past the vocabulary between the sampled blocks: the run stops
    at the step that would have read it with one line naming the shard and position, then the
    launcher's line; no traceback, no IndexError, no torchrun log line."""
    corpus, data = tmp_path / "corpus", tmp_path / "data"
    write_docstring_files(corpus, ["logging", "argparse", "inspect"])
    _prepare(corpus, data, "data.shard_tokens=20000")
    shard, where = _poison_train_split(data, VOCAB + 40)
    # an epoch in a few dozen steps of 64 sequences: the poisoned one comes before the last step
    overrides = [*SEED_GPT, f"data.dir={data}", "trainer.max_steps=1000", "trainer.micro_batch_size=32",
                 f"trainer.global_batch_tokens={64 * SEQ}", "trainer.eval_interval=1000",
                 f"trainer.run_dir={tmp_path / 'run'}", "trainer.save_interval=1000"]  # fmt: skip
    module = ["--module", "tests.integration.training.sampled_train"]
    command = [sys.executable, "-m", "launch.torchrun", "--nproc", "2", *module, "--", *overrides]
    proc = subprocess.run(
        command, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    # (a loaded machine may add the trainer's warning that other training processes share the cores)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and ": warning: " not in ln]
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith(
        f"lmsys-train: error: corrupt shard {data / shard}: token id {VOCAB + 40} at position {where} is past"
    ), lines
    assert lines[1].startswith("lmsys-launch: error: worker rank "), lines
