"""lm-evaluation-harness's model `lmsys` (lmsys/inference/harness.py), in this process, on a
random-weight export: bos-shift models roll like lmsys-eval, sampled generation is seeded per
prompt, bad model arguments and requests are one-line errors, `lmsys` is lm_eval's registered
model, lm_eval's argument mistakes are one line, and the results table has lm_eval's headers.
lm_eval's real command line on three tasks: tests/integration/export/test_harness.py."""

from __future__ import annotations

import importlib.metadata
import math

import pytest
import tomllib
import torch
from lm_eval.api.instance import Instance

from lmsys.inference.lm_eval_model import HarnessError, LmsysLM
from tests.fixtures.exports import REPO_ROOT, small_config
from tests.unit.inference.test_evaluate import held_out_text

TASKS = ["lmsys_test_mc", "lmsys_test_rolling", "lmsys_test_gen"]
UNTIL = ["\n", "."]


ROLLING_TEXT = held_out_text()[:2500].strip()
PROMPTS = ["Return the", "The default value of the argument", "A fraction", "If the"]


# ----------------------------------------------------------------------------- in process


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def test_bos_shift_models_roll_like_lmsys_eval(tmp_path, tokenizer_path):
    """seed_trax (bos_shift): every window starts with bos_shift_id, as in lmsys-eval."""
    from lmsys.inference.evaluation import evaluate_text
    from lmsys.interop.export_dir import write_export
    from lmsys.model.transformer import Transformer

    cfg = small_config("seed_trax")
    torch.manual_seed(6)
    export = write_export(tmp_path / "trax", cfg, Transformer(cfg).state_dict(), tokenizer_path, {"step": 0})
    lm = LmsysLM(path=str(export), device="cpu", batch_size=5)
    texts = [ROLLING_TEXT[:700], "Short.", ROLLING_TEXT[700:1000]]
    totals = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(t,) for t in texts]))
    for text, total in zip(texts, totals, strict=True):
        assert math.isclose(-total, evaluate_text(lm.model, lm.tok, text).nll, rel_tol=1e-6)


def test_sampled_generation_is_seeded_per_prompt(random_export):
    lm = LmsysLM(path=str(random_export), device="cpu", batch_size=3, seed=11)
    settings = {"until": ["\n"], "max_gen_toks": 6, "do_sample": True, "temperature": 0.8, "top_k": 40}
    answers = lm.generate_until(_requests("generate_until", [(p, settings) for p in PROMPTS]))
    alone = [lm.generate_until(_requests("generate_until", [(p, settings)]))[0] for p in PROMPTS]
    assert answers == alone and len(set(answers)) > 1


def test_bad_model_args_and_requests_are_one_line_errors(random_export, tmp_path, capsys):
    from lmsys.evaluate import main

    with pytest.raises(HarnessError, match=r"path=\S+nope does not exist \(expected an lmsys export"):
        LmsysLM(path=str(tmp_path / "nope"))
    with pytest.raises(HarnessError, match="model_args path= is required"):
        LmsysLM()
    with pytest.raises(HarnessError, match=r"unknown model_args pretrained; valid: path"):
        LmsysLM(path=str(random_export), pretrained="gpt2")
    with pytest.raises(HarnessError, match="batch_size='auto' is not valid"):
        LmsysLM(path=str(random_export), batch_size="auto")
    lm = LmsysLM(path=str(random_export), device="cpu")
    with pytest.raises(HarnessError, match="num_beams are not supported"):
        lm.generate_until(_requests("generate_until", [("Return", {"until": ["\n"], "num_beams": 4})]))
    with pytest.raises(HarnessError, match="continuation of 40 tokens does not fit"):
        lm._fit([5], list(range(4, 44)))
    assert main([str(random_export), "harness=no_such_task"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lmsys-eval: error: lm_eval has no task no_such_task; give include_path=DIR for tasks "
                   "of your own YAML files"]  # fmt: skip


def test_lmsys_is_lm_evals_model_lmsys():
    """Importing lmsys.harness registers `lmsys` (and keeps lm_eval's own models findable); the
    entry point pyproject.toml declares for lm_eval's plugin group names the same class."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import get_model, model_registry

    assert get_model("lmsys") is LmsysLM and issubclass(LmsysLM, TemplateLM)
    assert "hf" in model_registry  # registered before lmsys: get_model fills only an empty registry
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (value,) = project["entry-points"]["lm_eval.models"].values()
    assert list(project["entry-points"]["lm_eval.models"]) == ["lmsys"]
    module, _, name = value.partition(":")
    assert getattr(importlib.import_module(module), name) is LmsysLM
    assert "lmsys[eval]" in project["optional-dependencies"]["dev"]


def test_lm_evals_argument_mistakes_are_one_line(random_export, capfd):
    """An unknown task given to lm_eval's own command line: one line with the names' hint, exit 2,
    never lm_eval's traceback; its other argument errors (an unknown model) alike."""
    from lmsys.harness import lm_eval_error, main

    assert main(["--model", "lmsys", "--model_args", f"path={random_export}", "--tasks", "no_such_task"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [
        "lmsys-harness: error: lm_eval: Tasks not found: no_such_task; `python -m lmsys.harness ls tasks` "
        "lists them, and --include_path DIR adds the tasks of your own YAML files"
    ], err
    found = "Attempted to load model 'lmsys2', but no model for this name found!"
    unknown = ValueError(f"{found} Supported model names: anthropic-chat,\n dummy, hf, lmsys")
    assert lm_eval_error(unknown) == (
        "lm_eval: Attempted to load model 'lmsys2', but no model for this name found; lmsys exports and "
        "checkpoints run as --model lmsys"
    )


def test_the_results_table_has_lm_evals_headers():
    """lm_eval's results table as both commands print it: its own column names (pytablewriter
    0.38 printed `| A | B | C |...` instead)."""
    from lmsys.inference.lm_eval_model import results_table

    results = {
        "results": {"my_task": {"alias": "my_task", "acc,none": 0.5, "acc_stderr,none": 0.1}},
        "versions": {"my_task": 1.0},
        "n-shot": {"my_task": 0},
        "higher_is_better": {"my_task": {"acc": True}},
    }
    header, rule, row = results_table(results).strip().splitlines()
    assert [cell.strip() for cell in header.strip("|").split("|")] == [
        "Tasks", "Version", "Filter", "n-shot", "Metric", "", "Value", "", "Stderr"
    ]  # fmt: skip
    assert [cell.strip() for cell in row.strip("|").split("|")] == [
        "my_task", "1", "none", "0", "acc", "↑", "0.5", "±", "0.1"
    ]  # fmt: skip
