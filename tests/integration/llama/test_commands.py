"""lmsys-generate and lmsys-eval on the Llama family (a Qwen3 import: QK-norm, multi-query
attention, a padded vocabulary), with `kernels=` choosing Triton (its interpreter here) or torch:
the same greedy text and the same perplexity either way. The lm_eval model and compiled decoding
in this process: tests/unit/inference/test_family.py."""

from __future__ import annotations

import json
import math

import pytest

from tests.fixtures.exports import run_clis
from tests.unit.inference.test_family import TEXT


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
