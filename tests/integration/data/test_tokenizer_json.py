"""lmsys-prepare encoding a corpus with a Hugging Face tokenizer.json (data.tokenizer=DIR): every
document as the library encodes it, reused when run again, and a model of another vocabulary size
refused in one line."""

from __future__ import annotations

import json

import numpy as np

from lmsys.core.files import sha256_file
from lmsys.data.corpus import FileCorpus
from lmsys.data.preparation import validation_mask
from lmsys.data.shards import PreparedData, read_manifest
from lmsys.data.tokenizer import Tokenizer
from tests.fixtures.data import BPE_VOCAB, assert_one_line_error, run_prepare


def test_prepare_encodes_with_the_tokenizer_json(bpe_dir, corpus_dir, library, tmp_path):
    out = tmp_path / "prepared-bpe"
    args = [f"data.sources=[{corpus_dir}]", f"data.dir={out}", f"data.tokenizer={bpe_dir}",
            f"model.vocab_size={BPE_VOCAB}", "data.val_fraction=0.2", "data.num_workers=2"]  # fmt: skip
    proc = run_prepare(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"(hf, vocab_size {BPE_VOCAB}, eos id {BPE_VOCAB - 1}" in proc.stdout
    manifest = read_manifest(out)
    section = manifest["tokenizer"]
    assert section["kind"] == "hf" and section["file"] == "tokenizer.json"
    assert section["sha256"] == sha256_file(bpe_dir / "tokenizer.json")  # a byte-for-byte copy
    assert (section["eos_id"], section["pad_id"]) == (BPE_VOCAB - 1, None)
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    # every document, encoded by the library itself, followed by eos, in its split
    data = PreparedData(out)
    assert Tokenizer(data.tokenizer_path).special_ids() == Tokenizer(bpe_dir).special_ids()
    docs = list(FileCorpus.from_sources([str(corpus_dir)]).documents())
    is_val = validation_mask(np.arange(len(docs)), manifest["config"]["data"]["seed"], 0.2)
    eos = BPE_VOCAB - 1
    for split, flags in (("train", ~is_val), ("val", is_val)):
        want = [
            i
            for d, f in zip(docs, flags)
            if f
            for i in [*library.encode(d, add_special_tokens=False).ids, eos]
        ]
        tokens = data.split(split)
        assert tokens.read(0, len(tokens)).tolist() == want, split
    again = run_prepare(*args, cwd=tmp_path)
    assert again.returncode == 0 and "reusing" in again.stdout
    # a model of another vocabulary size is refused, naming the one to use
    wrong = run_prepare(*args[:3], f"data.dir={tmp_path / 'other'}", "model.vocab_size=512", cwd=tmp_path)
    assert_one_line_error(wrong, f"has vocab_size {BPE_VOCAB} but model.vocab_size=512")
