"""format=hf's tokenizer: `AutoTokenizer.from_pretrained(export)` gives exactly lmsys's
SentencePiece ids and text on a broad generated sample, the usual transformers paths (perplexity,
pipeline, the model card's snippet) see lmsys's tokens, and an export is refused rather than
written with a tokenizer that would differ."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import re
import shutil

import pytest
import sentencepiece as spm
import torch

from lmsys.core.errors import ExportError
from lmsys.data.tokenizer import Tokenizer
from lmsys.interop.export_dir import load_export, write_export
from lmsys.interop.hf_tokenizer import check_same_tokens, probe_texts
from lmsys.model.transformer import Transformer
from tests.fixtures.data import UNICODE_SAMPLES
from tests.fixtures.exports import small_config
from tests.stdlib_text import module_docstrings


@pytest.fixture(scope="module")
def auto_tokenizer(transformers, hf_export):
    return transformers.AutoTokenizer.from_pretrained(hf_export)


def broad_sample(tok: Tokenizer) -> list[str]:
    """Text of many kinds, beyond what the export's own check uses (another seed, more of it):
    unseen English, every Unicode plane, emoji, control characters, whitespace and digit runs,
    leading and trailing spaces, text spelling special and byte pieces, the empty string."""
    rng = random.Random(11)
    texts = [*UNICODE_SAMPLES, "".join(UNICODE_SAMPLES), *probe_texts(tok, random_texts=7000, seed=7)]
    for name in ("email", "http", "logging", "unittest", "decimal", "typing", "inspect", "ast"):
        texts += module_docstrings(name)  # not the training corpus's modules
    for _ in range(3000):
        length = rng.randint(0, 40)
        chars = [chr(rng.choice([rng.randrange(0x20, 0x7F), rng.randrange(0x110000), 0x20, 0x0A, 0x09]))
                 for _ in range(length)]  # fmt: skip
        texts.append("".join(c if not "\ud800" <= c <= "\udfff" else " " for c in chars))
    texts += [f"{' ' * a}{'0123456789' * b}{' ' * c}" for a in range(4) for b in range(3) for c in range(4)]
    return texts


def test_autotokenizer_gives_lmsys_ids_and_text(hf_export, auto_tokenizer, tokenizer_path):
    sp = Tokenizer(tokenizer_path)
    assert Tokenizer(hf_export).sha256 == sp.sha256  # lmsys still reads its own tokenizer.model
    assert auto_tokenizer.is_fast
    special = [auto_tokenizer.pad_token_id, auto_tokenizer.bos_token_id, auto_tokenizer.eos_token_id,
               auto_tokenizer.unk_token_id]  # fmt: skip
    assert special == [sp.pad_id, sp.bos_id, sp.eos_id, sp.unk_id] == [0, 1, 2, 3]
    texts = broad_sample(sp)
    assert len(texts) > 10_000
    differ = []
    for text in texts:
        ids = sp.encode(text)
        got = auto_tokenizer(text)["input_ids"]  # the default call: adds no bos/eos, like lmsys
        if got != ids or auto_tokenizer.decode(ids) != sp.decode(ids):
            differ.append(text)
    assert differ == []
    # and that text is the text (SentencePiece's one loss: U+2581, its own space mark, decodes as " ")
    assert [
        t for t in texts if "\u2581" not in t and auto_tokenizer.decode(auto_tokenizer(t)["input_ids"]) != t
    ] == []
    batch = texts[:500]
    assert auto_tokenizer(batch)["input_ids"] == [sp.encode(t) for t in batch]
    # text spelling a special token is text, as in SentencePiece; specials decode to nothing when skipped
    assert auto_tokenizer("a</s>b")["input_ids"] == sp.encode("a</s>b") and 2 not in sp.encode("a</s>b")
    assert auto_tokenizer.decode([*sp.encode("end"), 2], skip_special_tokens=True) == "end"
    config = json.loads((hf_export / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)


@torch.no_grad()
def test_the_usual_hf_perplexity_is_lmsys_perplexity(hf_export, auto_tokenizer, transformers):
    """The issue's symptom: the usual HF path gave perplexity 495 where lmsys gave 243."""
    text = module_docstrings("json")[0][:400]
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_export).eval()
    model, tok, _ = load_export(hf_export)
    hf_ids = auto_tokenizer(text, return_tensors="pt").input_ids[:, :32]  # (1, T)
    ids = torch.tensor([tok.encode(text)[:32]])
    assert torch.equal(hf_ids, ids)
    hf_ppl = math.exp(hf(hf_ids, labels=hf_ids).loss.item())
    logits = model(ids)  # (1, T, V)
    ppl = math.exp(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item())
    assert hf_ppl == pytest.approx(ppl, rel=1e-4)


@torch.no_grad()
def test_pipeline_and_the_model_card_snippet_print_lmsys_text(hf_export, transformers, tokenizer_path):
    from lmsys.inference.generation import Sampling, generate_one

    greedy = Sampling(greedy=True)

    model, tok, _ = load_export(hf_export)
    prompt = tok.encode("The module returns a list of")
    # pipeline(): the text transformers users see; no "▁" and lmsys's own decoding
    pipe = transformers.pipeline("text-generation", model=str(hf_export), device="cpu")
    text = pipe("The module returns a list of", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    new = generate_one(model, prompt, 12, greedy, eos_id=tok.eos_id)
    assert "\u2581" not in text and text == tok.decode(prompt + new)
    # the card's snippet, run as written
    card = (hf_export / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert "AutoTokenizer" in snippet
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(
            snippet.replace("<this directory>", str(hf_export)).replace(
                '"The module"', '"The module returns"'
            ),
            {},
        )
    prompt = tok.encode("The module returns")
    new = generate_one(model, [tok.eos_id, *prompt], 20, greedy, eos_id=tok.eos_id)
    assert printed.getvalue() == tok.decode(prompt + new) + "\n"


def _train_sentencepiece(path, **options) -> None:
    """A model with lmsys's ids and byte fallback, trained with other options."""
    texts = [doc for name in ("json", "re") for doc in module_docstrings(name)]
    lmsys_options = {"normalization_rule_name": "identity", "add_dummy_prefix": False,
                     "remove_extra_whitespaces": False}  # fmt: skip
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(path), model_type="bpe", vocab_size=512,
        byte_fallback=True, pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2, num_threads=1,
        **{**lmsys_options, **options},
    )  # fmt: skip


@pytest.mark.parametrize(
    "options, named",
    [({"add_dummy_prefix": True}, "add_dummy_prefix=True (lmsys-prepare trains with False)"),
     ({"normalization_rule_name": "nmt_nfkc"}, "normalization=nmt_nfkc (lmsys-prepare trains with identity)"),
     ({"user_defined_symbols": ["<tool>"]}, "a user-defined or unused piece '<tool>'")],
)  # fmt: skip
def test_a_sentencepiece_model_it_cannot_express_is_refused(tmp_path, options, named):
    _train_sentencepiece(tmp_path / "other", **options)
    tok_path = tmp_path / "other.model"
    cfg = small_config()
    out = tmp_path / "exports" / "hf"
    with pytest.raises(ExportError, match=re.escape(named)):
        write_export(out, cfg, Transformer(cfg).state_dict(), tok_path, fmt="hf")
    assert not (tmp_path / "exports").exists() or list((tmp_path / "exports").iterdir()) == []
    write_export(out, cfg, Transformer(cfg).state_dict(), tok_path)  # lmsys's own format keeps it


def test_the_check_catches_a_tokenizer_json_that_differs(hf_export, tokenizer_path, tmp_path):
    """The export's guard is not vacuous: with a tenth of the merges missing, it refuses."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(hf_export / name, tmp_path / name)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][::10] + data["model"]["merges"][1::10]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    sp = Tokenizer(tokenizer_path)
    with pytest.raises(ExportError, match="gives other ids than"):
        check_same_tokens(sp, Tokenizer(tmp_path / "tokenizer.json"), probe_texts(sp))
