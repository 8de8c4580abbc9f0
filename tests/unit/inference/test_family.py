"""The Llama family's inference in this process, on a Qwen3 import (QK-norm, multi-query attention,
a padded vocabulary): the lm_eval model's rolling log-likelihood is lmsys-eval's, and a compiled
static-cache decode gives eager's tokens. The commands themselves:
tests/integration/llama/test_commands.py."""

from __future__ import annotations

import math

import torch
from lm_eval.api.instance import Instance

from lmsys.inference.evaluation import evaluate_text
from lmsys.inference.generation import generate
from lmsys.inference.lm_eval_model import LmsysLM
from lmsys.interop.export_dir import load_export
from tests.fixtures.family import PIECES

TEXT = "Return a new list of the items in the order given. The default value of the argument is None. " * 3


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
