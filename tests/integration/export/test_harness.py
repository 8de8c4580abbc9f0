"""lm-evaluation-harness runs lmsys models: lm_eval's real command line (subprocesses) on a
random-weight export (format=hf, which both lmsys and transformers load), on three tasks written
here (YAML + jsonl, nothing downloaded): a multiple-choice task, a rolling-perplexity task and a
generation task.

- multiple choice: the accuracy equals the one computed here from the model's log-likelihoods
  (one plain forward per choice, as lm_eval's hf model encodes them), and so does each choice's
  log-likelihood;
- rolling perplexity: the document's log-likelihood, bits per byte, byte and word perplexity equal
  lmsys-eval's on the same text (same windows);
- generation: each answer is lmsys-generate's greedy continuation, cut at the stop strings;
- lm_eval's own hf model on the same directory gives the same numbers and answers (with eos as its
  prefix token, the document start lmsys models are trained with).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.exports import SEQ, run_clis
from tests.integration.export.test_lm_eval_model import PROMPTS, ROLLING_TEXT, TASKS, UNTIL
from tests.unit.inference.test_evaluate import held_out_text


@pytest.fixture(scope="module")
def harness_runs(tmp_path_factory, hf_export, random_export, tokenizer_path):
    """Side by side: lm_eval's CLI with the lmsys model and with its hf model on the three tasks,
    lmsys-eval on the rolling text, and the `lmsys-eval harness=` shortcut on the multiple-choice
    task (with the lmsys-format export)."""
    from lmsys.data.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("harness")
    tasks = write_tasks(root / "tasks")
    text = root / "rolling.txt"
    text.write_text(ROLLING_TEXT, encoding="utf-8")
    common = ["--tasks", ",".join(TASKS), "--include_path", str(tasks), "--log_samples"]
    hf_args = f"pretrained={hf_export},dtype=float32,prefix_token_id={Tokenizer(tokenizer_path).eos_id}"
    # lmsys: batch_size in --model_args, as docs/evaluation.md writes it (and lm_eval passes its
    # --batch_size default beside it)
    calls = {
        "lmsys": ["lmsys.harness", "--model", "lmsys", "--model_args", f"path={hf_export},batch_size=4",
                  *common, "--output_path", str(root / "lmsys")],
        "hf": ["lm_eval", "--model", "hf", "--model_args", hf_args, "--device", "cpu", *common,
               "--batch_size", "4", "--output_path", str(root / "hf")],
        "lmsys_eval": ["lmsys.evaluate", str(hf_export), f"text={text}", f"json={root / 'eval.json'}"],
        "shortcut": ["lmsys.evaluate", str(random_export), "harness=lmsys_test_mc", f"include_path={tasks}",
                     "batch_size=3", f"json={root / 'shortcut.json'}"],
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as env:  # offline, and datasets' cache inside the test's directory
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("HF_DATASETS_CACHE", str(root / "hf_datasets"))
        # four lm_eval runs side by side: minutes each on a loaded 2-core machine
        procs = run_clis(calls, parallel=4, timeout=900)
    for name, proc in procs.items():
        assert proc.returncode == 0, (
            f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return root, procs


def test_multiple_choice_accuracy_equals_the_models_loglikelihoods(harness_runs, hf_export, random_export):
    root, _ = harness_runs
    results, samples = _lm_eval_output(root / "lmsys")
    accuracy, direct = _direct_accuracy(hf_export)
    for sample, choices in zip(samples["lmsys_test_mc"], direct, strict=True):
        logged = [float(resp[0][0]) for resp in sample["resps"]]
        for a, b in zip(logged, choices, strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (sample["doc"], logged, choices)
    assert 0 < accuracy < 1  # a comparison that could fail both ways
    assert results["lmsys_test_mc"]["acc,none"] == accuracy
    (results_file,) = (root / "lmsys").rglob("results_*.json")  # --model_args batch_size=4 was used
    assert json.loads(results_file.read_text(encoding="utf-8"))["config"]["lmsys_batch_size"] == 4
    shortcut = json.loads((root / "shortcut.json").read_text(encoding="utf-8"))
    assert shortcut["results"]["lmsys_test_mc"]["acc,none"] == _direct_accuracy(random_export)[0]


def test_rolling_perplexity_equals_lmsys_eval(harness_runs):
    root, _ = harness_runs
    results, samples = _lm_eval_output(root / "lmsys")
    ours = json.loads((root / "eval.json").read_text(encoding="utf-8"))
    assert ours["tokens"] > 10 * SEQ and ours["tokens"] % SEQ != 0  # many windows and a partial last one
    (sample,) = samples["lmsys_test_rolling"]
    loglikelihood = float(sample["resps"][0][0])
    assert math.isclose(-loglikelihood, ours["nll"], rel_tol=1e-6)
    rolling = results["lmsys_test_rolling"]
    assert math.isclose(rolling["bits_per_byte,none"], ours["bits_per_byte"], rel_tol=1e-6)
    n_bytes, n_words = len(ROLLING_TEXT.encode("utf-8")), len(re.split(r"\s+", ROLLING_TEXT))
    assert math.isclose(rolling["byte_perplexity,none"], math.exp(ours["nll"] / n_bytes), rel_tol=1e-6)
    assert math.isclose(rolling["word_perplexity,none"], math.exp(ours["nll"] / n_words), rel_tol=1e-6)


def test_generation_equals_lmsys_generate(harness_runs, hf_export):
    from lmsys.inference.generation import generate
    from lmsys.interop.export_dir import load_export

    root, _ = harness_runs
    _, samples = _lm_eval_output(root / "lmsys")
    model, tok, _ = load_export(hf_export)
    answers = [sample["resps"][0][0] for sample in samples["lmsys_test_gen"]]
    new = generate(model, [tok.encode(p) for p in PROMPTS], 8, greedy=True, eos_id=tok.eos_id)
    expected = [re.split("|".join(map(re.escape, UNTIL)), tok.decode(ids))[0] for ids in new]
    assert answers == expected
    assert any(answers)


def test_lm_evals_hf_model_gives_the_same_numbers(harness_runs):
    """transformers' GPT2LMHeadModel and AutoTokenizer on the same directory, through lm_eval's hf
    model: every log-likelihood (choices, rolling document) and every generated answer agrees."""
    root, _ = harness_runs
    (ours, our_samples), (theirs, their_samples) = (
        _lm_eval_output(root / "lmsys"),
        _lm_eval_output(root / "hf"),
    )
    for task in TASKS:
        for a, b in zip(our_samples[task], their_samples[task], strict=True):
            if task == "lmsys_test_gen":
                assert a["resps"] == b["resps"]
                continue
            mine = [float(r[0][0] if isinstance(r[0], list) else r[0]) for r in a["resps"]]
            hf = [float(r[0][0] if isinstance(r[0], list) else r[0]) for r in b["resps"]]
            assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(mine, hf, strict=True)), (
                task,
                mine,
                hf,
            )
    assert ours["lmsys_test_mc"]["acc,none"] == theirs["lmsys_test_mc"]["acc,none"]
    bits = [r["lmsys_test_rolling"]["bits_per_byte,none"] for r in (ours, theirs)]
    assert math.isclose(*bits, rel_tol=1e-5)


def test_the_shortcut_prints_lm_evals_table(harness_runs):
    _, procs = harness_runs
    out = procs["shortcut"].stdout
    assert "lm_eval tasks lmsys_test_mc" in out
    assert re.search(r"\|lmsys_test_mc\s*\|.*\|acc\s*\|", out), out


def test_the_lm_eval_executable_finds_lmsys_where_lm_eval_loads_plugins(tmp_path, random_export):
    """`lm_eval --model lmsys` itself: lm_eval 0.4.13 loads no plugins (the entry point waits for a
    release that does), and the installed lmsys must be this checkout's with its entry point."""
    import lm_eval.api.registry as registry

    installed = [ep for ep in importlib.metadata.entry_points(group="lm_eval.models") if ep.name == "lmsys"]
    if not hasattr(registry, "load_plugins") or not installed:
        pytest.skip(f"lm_eval {importlib.metadata.version('lm_eval')} loads no model plugins, or lmsys is "
                    "installed without its lm_eval.models entry point")  # fmt: skip
    import subprocess

    tasks = write_tasks(tmp_path / "tasks")
    executable = str(Path(sys.executable).with_name("lm_eval"))
    args = ["--model", "lmsys", "--model_args", f"path={random_export}", "--tasks", "lmsys_test_mc",
            "--include_path", str(tasks), "--limit", "4"]  # fmt: skip
    proc = subprocess.run([executable, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "lmsys_test_mc" in proc.stdout, proc.stderr[-3000:]


def write_tasks(directory: Path) -> Path:
    """The three tasks of the module docstring: YAML files and their jsonl data."""
    directory.mkdir(parents=True, exist_ok=True)
    data = {
        "mc": _multiple_choice_docs(),
        "rolling": [{"text": ROLLING_TEXT}],
        "gen": [{"prompt": p, "target": " value"} for p in PROMPTS],
    }
    for name, docs in data.items():
        (directory / f"{name}.jsonl").write_text(
            "".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8"
        )
    bodies = {
        "mc": "output_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: choices\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n",
        "rolling": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: text\nmetric_list:\n'
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        "gen": "output_type: generate_until\ndoc_to_text: prompt\ndoc_to_target: target\n"
        f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n",
    }
    for name, body in bodies.items():
        text = _task_yaml(f"lmsys_test_{name}", directory / f"{name}.jsonl", body)
        (directory / f"{name}.yaml").write_text(text, encoding="utf-8")
    return directory


def _lm_eval_output(out: Path) -> tuple[dict, dict[str, list[dict]]]:
    """(results, {task: logged samples in document order}) written by lm_eval's --output_path."""
    (results_file,) = out.rglob("results_*.json")
    samples = {}
    for task in TASKS:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        samples[task] = sorted(rows, key=lambda row: row["doc_id"])
    return json.loads(results_file.read_text(encoding="utf-8"))["results"], samples


def _direct_accuracy(export: Path) -> tuple[float, list[list[float]]]:
    """(accuracy, each question's choice log-likelihoods) computed here from the model."""
    from lmsys.interop.export_dir import load_export

    model, tok, _ = load_export(export)
    scores, correct = [], []
    for doc in _multiple_choice_docs():
        scores.append([_direct_loglikelihood(model, tok, doc["question"], " " + c) for c in doc["choices"]])
        correct.append(max(range(4), key=scores[-1].__getitem__) == doc["answer"])
    return sum(correct) / len(correct), scores


def _multiple_choice_docs() -> list[dict]:
    """20 questions of 4 choices of different lengths, from held-out docstring sentences."""
    words = held_out_text().split()
    docs = []
    for i in range(20):
        start = 37 * i
        choices = [" ".join(words[start + 8 + 3 * k : start + 9 + 3 * k + k % 3]) for k in range(4)]
        docs.append({"question": " ".join(words[start : start + 8]), "choices": choices, "answer": i % 4})
    return docs


def _task_yaml(name: str, data: Path, body: str) -> str:
    head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
    return head + "test_split: test\n" + body


@torch.inference_mode()
def _direct_loglikelihood(model, tok, context: str, continuation: str) -> float:
    """log p(continuation | context) from one forward, encoded as lm_eval's hf model encodes a
    causal pair: the context alone, the continuation as what the whole adds after it, the whole
    cut from the left to the window (SEQ inputs)."""
    context_ids = tok.encode(context)
    continuation_ids = tok.encode(context + continuation)[len(context_ids) :]
    ids = torch.tensor([(context_ids + continuation_ids)[-(SEQ + 1) :]])  # (1, T)
    logp = torch.log_softmax(model(ids[:, :-1])[0].double(), dim=-1)  # (T - 1, V)
    rows = range(ids.shape[1] - 1 - len(continuation_ids), ids.shape[1] - 1)
    return sum(float(logp[r, t]) for r, t in zip(rows, continuation_ids, strict=True))
