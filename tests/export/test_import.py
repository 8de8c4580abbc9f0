"""lmsys-import: a transformers GPT-2 directory (GPT2LMHeadModel.save_pretrained, a byte-level BPE
trained with `tokenizers`) becomes an lmsys export with transformers' logits and tokenizer ids;
.bin weights are read without unpickling code; HF -> lmsys -> HF gives back the same weights and
ids; and a user's whole path: import, prepare with its tokenizer, fine-tune with
model.init_from, export format=hf, load in transformers."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from lmsys.data.tokenizer import Tokenizer
from lmsys.interop.export_dir import export_checkpoint, import_checkpoint, load_export
from tests.data.conftest import UNICODE_SAMPLES
from tests.export.conftest import BPE_VOCAB, SEQ, assert_one_line_error, run_clis
from tests.stdlib_text import module_docstrings

TEXTS = [
    *UNICODE_SAMPLES,
    "a<|endoftext|>b",
    "def f(x):\n    return x  # 42\n\n",
    *module_docstrings("heapq"),
]


@pytest.fixture(scope="module")
def transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _ids(n: int = 3) -> torch.Tensor:
    return torch.randint(0, BPE_VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def test_import_gives_transformers_logits_and_ids(hf_gpt2_dir, gpt2_import, transformers):
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_gpt2_dir).eval()
    model, tok, meta = load_export(gpt2_import)
    torch.testing.assert_close(model(_ids()), hf(_ids()).logits, atol=2e-5, rtol=1e-5)
    assert model.cfg.name == "gpt2-test" and model.unembed.weight is model.tok_emb.weight
    assert meta["imported_from"] == hf_gpt2_dir.name  # no local path in a model one may publish
    # the user's own tokenizer, as transformers reads those files (GPT2Tokenizer: <|endoftext|>)
    auto = transformers.AutoTokenizer.from_pretrained(hf_gpt2_dir)
    assert tok.kind == "hf" and tok.sha256 == Tokenizer(hf_gpt2_dir).sha256
    assert (tok.eos_id, tok.bos_id, tok.unk_id, tok.pad_id) == (
        auto.eos_token_id, auto.bos_token_id, auto.unk_token_id, auto.pad_token_id,
    ) == (BPE_VOCAB - 1, BPE_VOCAB - 1, BPE_VOCAB - 1, None)  # fmt: skip
    assert [tok.encode(t) for t in TEXTS] == [auto(t)["input_ids"] for t in TEXTS]
    assert sorted(p.name for p in gpt2_import.iterdir()) == [
        "README.md", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    card = (gpt2_import / "README.md").read_text()
    assert f"imported into lmsys from `{hf_gpt2_dir.name}`" in card and str(hf_gpt2_dir.parent) not in card


def _old_style_bin(source: Path, out: Path, transformers) -> Path:
    """pytorch_model.bin as transformers 4 and OpenAI's GPT-2 files hold it: torch.save of the state
    dict, names without `transformer.`, causal-mask buffers, no lm_head."""
    hf = transformers.GPT2LMHeadModel.from_pretrained(source)
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(hf.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    out.mkdir()
    torch.save(state, out / "pytorch_model.bin")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, out / name)
    return out


@torch.no_grad()
def test_bin_and_sharded_weights(tmp_path, hf_gpt2_dir, transformers):
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_gpt2_dir).eval()
    want = hf(_ids()).logits
    old = _old_style_bin(hf_gpt2_dir, tmp_path / "old", transformers)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (
        sharded / "model.safetensors"
    ).exists()
    shutil.copyfile(hf_gpt2_dir / "tokenizer.json", sharded / "tokenizer.json")
    for source in (old, sharded):
        model, _, _ = load_export(import_checkpoint(source, tmp_path / f"{source.name}-import"))
        torch.testing.assert_close(model(_ids()), want, atol=2e-5, rtol=1e-5)


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


@torch.no_grad()
def test_hf_to_lmsys_to_hf_gives_back_the_same_model_and_ids(
    tmp_path, hf_gpt2_dir, gpt2_import, transformers
):
    back = export_checkpoint(gpt2_import, tmp_path / "back", fmt="hf")  # lmsys-export EXPORT format=hf
    original = transformers.GPT2LMHeadModel.from_pretrained(hf_gpt2_dir).state_dict()
    again = transformers.GPT2LMHeadModel.from_pretrained(back).state_dict()
    assert original.keys() == again.keys() and all(torch.equal(original[k], again[k]) for k in original)
    assert (back / "tokenizer.json").read_bytes() == (hf_gpt2_dir / "tokenizer.json").read_bytes()
    first = transformers.AutoTokenizer.from_pretrained(hf_gpt2_dir)
    second = transformers.AutoTokenizer.from_pretrained(back)
    assert [second(t)["input_ids"] for t in TEXTS] == [first(t)["input_ids"] for t in TEXTS]
    assert (
        second.eos_token_id
        == first.eos_token_id
        == json.loads((back / "config.json").read_text())["eos_token_id"]
    )


@torch.no_grad()
def test_lmsys_to_hf_to_lmsys_keeps_the_sentencepiece_tokenizer(tmp_path, hf_export):
    imported = import_checkpoint(hf_export, tmp_path / "imported")
    (model, tok, _), (want, want_tok, _) = load_export(imported), load_export(hf_export)
    assert tok.kind == "sentencepiece" and tok.sha256 == want_tok.sha256
    ids = torch.randint(0, tok.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids), want(ids)) and model.cfg == want.cfg
    back = export_checkpoint(imported, tmp_path / "back", fmt="hf")
    assert (back / "tokenizer.json").read_bytes() == (hf_export / "tokenizer.json").read_bytes()
