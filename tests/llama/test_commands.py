"""lmsys-generate, lmsys-eval and the lm_eval model on the Llama family (a Qwen3 import: QK-norm,
multi-query attention, a padded vocabulary), with `kernels=` choosing Triton (its interpreter here)
or torch: the same greedy text and the same perplexity either way; the lm_eval model's rolling
log-likelihood is lmsys-eval's; a compiled static-cache decode gives eager's tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch
from lm_eval.api.instance import Instance

from lmsys.inference.evaluation import evaluate_text
from lmsys.inference.generation import generate
from lmsys.inference.lm_eval_model import LmsysLM
from lmsys.interop.export_dir import load_export
from tests.export.conftest import run_clis
from tests.llama.conftest import PIECES

TEXT = "Return a new list of the items in the order given. The default value of the argument is None. " * 3


@pytest.fixture(scope="module")
def cli(tmp_path_factory, family_imports) -> dict:
    root = tmp_path_factory.mktemp("family_cli")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    model = str(family_imports["qwen3"])
    generate_args = ["prompt=The default value", "greedy=true", "max_new_tokens=8", "output=jsonl"]
    calls = {
        f"{command}-{kernels}": [module, model, *args, f"kernels={kernels}"]
        for kernels in ("torch", "triton")
        for command, module, args in (
            ("generate", "lmsys.generate", generate_args),
            (
                "eval",
                "lmsys.evaluate",
                [f"text={root / 'text.txt'}", f"json={root / f'eval-{kernels}.json'}"],
            ),
        )
    }
    results = run_clis(calls, parallel=4)
    for name, proc in results.items():
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (name, proc.stderr[-3000:])
    return {"root": root, **results}


def test_generate_and_eval_take_kernels(cli):
    texts = {
        k: json.loads(cli[f"generate-{k}"].stdout.splitlines()[-1])["completion"] for k in ("torch", "triton")
    }
    assert texts["torch"] == texts["triton"] and texts["torch"], texts
    assert "Triton kernels in their CPU interpreter" in cli["generate-triton"].stderr  # triton ran there
    evals = {k: json.loads((cli["root"] / f"eval-{k}.json").read_text()) for k in ("torch", "triton")}
    assert math.isclose(evals["torch"]["loss"], evals["triton"]["loss"], rel_tol=1e-5), evals


def test_the_lm_eval_model_scores_the_family_like_lmsys_eval(family_imports):
    lm = LmsysLM(path=str(family_imports["qwen3"]), device="cpu", batch_size=2, kernels="torch")
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (TEXT,), 0)])
    assert math.isclose(-total, evaluate_text(lm.model, lm.tok, TEXT).nll, rel_tol=1e-6)


@torch.inference_mode()
def test_compiled_static_cache_decoding_gives_eager_tokens(family_imports):
    """What lmsys-generate compile=true runs (aot_eager here: dynamo and AOTAutograd, what
    inductor is handed): a prompt graph and a decode graph through a StaticKVCache."""
    model = load_export(family_imports["qwen3"])[0]
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, PIECES - 1, (n,), generator=gen).tolist() for n in (6, 11)]
    eager = generate(model, prompts, 10, greedy=True, batch_size=2)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    assert generate(compiled, prompts, 10, greedy=True, batch_size=2, static_cache=True) == eager
