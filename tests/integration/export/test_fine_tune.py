"""A user's whole path with a transformers GPT-2: lmsys-import it, lmsys-prepare a corpus with its
tokenizer (data.tokenizer=HF_DIR), train a few steps from its weights (model.init_from, one
process, real DeepSpeed), lmsys-export format=hf, load the result in transformers. And the
refusals of model.init_from: another model, another tokenizer, not an export."""

from __future__ import annotations

import json

import pytest
import torch

from lmsys.data.tokenizer import Tokenizer
from lmsys.interop.export_dir import load_export
from tests.fixtures.data import UNICODE_SAMPLES
from tests.fixtures.exports import BPE_VOCAB, SEQ, run_cli, run_clis
from tests.stdlib_text import module_docstrings, write_docstring_files

LR = 1e-3
STEPS = 2
# the model of hf_gpt2_dir, as a user writes it on the command line (n_inner unset: 4 * n_embd)
MODEL = ["model=tiny", f"model.vocab_size={BPE_VOCAB}", "model.d_model=32", "model.n_layers=2",
         "model.n_heads=2", f"model.max_seq_len={SEQ}", "model.ffn.d_ff=null"]  # fmt: skip


def _train_args(data, run, init_from, steps: int = STEPS, model: list[str] = MODEL) -> list[str]:
    return [*model, f"model.init_from={init_from}", "deepspeed=zero2", f"data.dir={data}",
            f"trainer.max_steps={steps}", f"trainer.global_batch_tokens={4 * SEQ}",
            "trainer.micro_batch_size=2", "trainer.eval_interval=2", "trainer.eval_batches=1",
            "trainer.save_interval=2", "trainer.progress=false", f"optim.lr={LR}", "optim.warmup_steps=0",
            "logger=none", "logger.plot=false", f"trainer.run_dir={run}"]  # fmt: skip


def _last_error(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[-1].startswith("lmsys-train: error: "), proc.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("fine_tune")
    write_docstring_files(root / "corpus", ["textwrap", "string", "heapq", "bisect"])
    return root


@pytest.mark.slow
@torch.no_grad()
def test_import_prepare_fine_tune_export_load_in_transformers(corpus, hf_gpt2_dir, gpt2_import):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    root, data, run = corpus, corpus / "data", corpus / "run"
    prep = run_cli("lmsys.prepare", f"data.sources=[{root / 'corpus'}]", f"data.dir={data}",
                   f"data.tokenizer={hf_gpt2_dir}", f"model.vocab_size={BPE_VOCAB}", "data.val_fraction=0.2",
                   "data.num_workers=1")  # fmt: skip
    assert prep.returncode == 0, prep.stderr
    train = run_cli("lmsys.train", *_train_args(data, run, gpt2_import), timeout=300)
    assert train.returncode == 0, train.stdout + train.stderr
    assert f"starting from the weights of model.init_from={gpt2_import}" in train.stdout
    launch = json.loads((run / "run.json").read_text())["launches"][-1]
    assert launch["init_from"] == str(gpt2_import)
    out = root / "hf"
    export = run_cli("lmsys.export", str(run), f"out={out}", "format=hf")
    assert export.returncode == 0, export.stderr
    # transformers reads the fine-tuned model and its tokenizer: lmsys's logits and ids
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    model, tok, _ = load_export(out)
    ids = torch.randint(0, BPE_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(hf(ids).logits, model(ids), atol=2e-5, rtol=1e-5)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    texts = [*UNICODE_SAMPLES, "a<|endoftext|>b", *module_docstrings("bisect")]
    data_tok = Tokenizer(data)
    assert tok.sha256 == data_tok.sha256 == Tokenizer(hf_gpt2_dir).sha256
    assert [auto(t)["input_ids"] for t in texts] == [data_tok.encode(t) for t in texts]
    assert auto.eos_token_id == tok.eos_id == BPE_VOCAB - 1 == hf.generation_config.eos_token_id
    assert f"fine-tuned from | `{gpt2_import.name}`" in (out / "README.md").read_text()  # no local path
    # it trained from the import's weights: every weight moved, by at most a few Adam steps of LR
    start = load_export(gpt2_import)[0].state_dict()
    moved = max((model.state_dict()[k] - v).abs().max().item() for k, v in start.items())
    assert 0 < moved <= 3 * STEPS * LR
    # resuming the run: its checkpoint's weights win, and it says so
    again = run_cli("lmsys.train", *_train_args(data, run, gpt2_import, steps=STEPS + 1), timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"model.init_from={gpt2_import} is ignored" in again.stdout and "resumed from" in again.stdout
    assert json.loads((run / "run.json").read_text())["launches"][-1]["init_from"] is None


@pytest.mark.slow
def test_init_from_refusals(corpus, gpt2_import, hf_gpt2_dir):
    sp_data = corpus / "sp-data"  # the same corpus, encoded with a SentencePiece model of the same size
    prep = run_cli("lmsys.prepare", f"data.sources=[{corpus / 'corpus'}]", f"data.dir={sp_data}",
                   f"model.vocab_size={BPE_VOCAB}", "data.val_fraction=0.2",
                   "data.num_workers=1")  # fmt: skip
    assert prep.returncode == 0, prep.stderr
    wide = [*MODEL, "model.d_model=64"]
    results = run_clis(
        {
            "model": ["lmsys.train", *_train_args(sp_data, corpus / "r1", gpt2_import, model=wide)],
            "tokenizer": ["lmsys.train", *_train_args(sp_data, corpus / "r2", gpt2_import)],
            "not-export": ["lmsys.train", *_train_args(sp_data, corpus / "r3", hf_gpt2_dir.parent)],
        },
        parallel=3,
    )
    refused = _last_error(results["model"])
    assert f"model.init_from={gpt2_import}: the run's model differs from the export's: " in refused
    assert "model.d_model=64 (export: 32), model.ffn.d_ff=None (export: 128)" in refused  # None: 4 * 64
    assert "was trained with tokenizer" in _last_error(results["tokenizer"])
    assert "prepare it with data.tokenizer=" in _last_error(results["tokenizer"])
    assert "is not an export directory" in _last_error(results["not-export"])
    assert not any((corpus / r).exists() for r in ("r1", "r2", "r3"))  # nothing written
