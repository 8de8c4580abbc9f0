"""docs/huggingface.md's journey, "continue pretraining Qwen3-0.6B on your corpus on 8 GPUs", run
command by command on a tiny stand-in, and what the training from an import must give:

- every command of the journey's bash block and its Python snippet runs as written, but for the
  values STAND_IN changes (each with why): a random Qwen3 of the same function (QK-norm, a head
  width other than d_model / n_heads, multi-query attention, a vocabulary padded past the
  tokenizer's) stands in for Qwen's download, 2 CPU processes for 8 GPUs, 4 steps for 2000;
- its training run (model.init_from alone: the export's model, 2 ranks, ZeRO-3) gives the losses
  of one process (1e-5 relative); the same run compiled (trainer.compile=true: inductor) gives the
  eager losses; optim=muon trains the family's matrices with Muon (gate, up, down, the fused
  q/k/v and the output projection of every block) and the rest with AdamW;
- the export is a Qwen3ForCausalLM that transformers runs with lmsys's logits and ids, and
  lm-evaluation-harness's own hf model scores it.

Everything is one stage after the other, the commands of a stage side by side; the reference
runs (one process, eager and compiled, and Muon) train beside the journey's."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lmsys.core.rundir import read_metrics
from lmsys.engine import checkpoint as ckpt
from tests.fixtures.exports import REPO_ROOT, TORCHRUN, child_env
from tests.fixtures.family import PIECES
from tests.stdlib_text import write_docstring_files
from tests.unit.model.test_llama_family import MUON_MATRICES

pytestmark = pytest.mark.slow

DOC = REPO_ROOT / "docs" / "huggingface.md"
SECTION = "## Continue pretraining Qwen3-0.6B on your corpus on 8 GPUs"
STEPS = 4
# The journey's text -> (what runs instead, why). Anything not named here runs as written.
STAND_IN = {
    "torchrun --nproc_per_node=8": (f"{TORCHRUN} --standalone --nproc_per_node=2",
                                    "2 CPU processes for 8 GPUs, a rendezvous on a free port"),
    "data.seq_len=4096": ("data.seq_len=32", "the stand-in's context is 64 positions"),
    "trainer.global_batch_tokens=1048576": ("trainer.global_batch_tokens=256",
                                            "8 sequences of 32 tokens: micro-batch 4 x 2 ranks"),
    "trainer.max_steps=2000": (f"trainer.max_steps={STEPS}", "seconds, not hours"),
    "optim.lr=3e-5": ("optim.lr=3e-3", "a random model: steps large enough to move its loss"),
    "optim.warmup_steps=100": ("optim.warmup_steps=1", "4 steps in all"),
    "--tasks hellaswag,arc_easy": ("--tasks lmsys_journey --include_path tasks --device cpu",
                                   "the hub's tasks are downloads: a local one stands in; no GPU here"),
}  # fmt: skip
NOT_RUN = {"hf download ": "a download: the random Qwen3 stands in at hf/Qwen3-0.6B"}
TEXT = "The module provides functions for working with text. It returns the first match of a pattern."


def journey_commands() -> tuple[list[str], str]:
    """The bash block's commands and the Python snippet of the journey's section."""
    text = DOC.read_text(encoding="utf-8").split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [shlex.join(shlex.split(line, comments=True)) for line in block.splitlines() if line.strip()]
    return commands, re.search(r"```python\n(.*?)```", text, re.S).group(1)


def _stand_in(command: str) -> list[str]:
    for text, (replacement, _) in STAND_IN.items():
        command = command.replace(text, replacement)
    words = shlex.split(command)
    scripts = {"lmsys-import": "lmsys.hf_import", "lmsys-prepare": "lmsys.prepare",
               "lmsys-export": "lmsys.export", "lm_eval": "lm_eval"}  # fmt: skip
    if words[0] in scripts:  # a console script: the same module, from this checkout
        return [sys.executable, "-m", scripts[words[0]], *words[1:]]
    return words


def _with(overrides: list[str], *changes: str) -> list[str]:
    """`overrides` with each key of `changes` set to its value there (replaced or added)."""
    keys = {c.partition("=")[0] for c in changes}
    return [o for o in overrides if o.partition("=")[0] not in keys] + list(changes)


@dataclass
class Journey:
    cwd: Path
    outputs: dict[
        str, tuple[int, str]
    ]  # command (as documented, or a reference run's name) -> (exit, output)
    run_overrides: list[str]  # the journey's training overrides, as run

    def output(self, start: str) -> str:
        (key,) = [k for k in self.outputs if k.startswith(start)]
        code, out = self.outputs[key]
        assert code == 0 and "Traceback" not in out, f"{key}: exit {code}\n{out[-4000:]}"
        return out

    def losses(self, run: str) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_metrics(self.cwd / "runs" / run, "train")}


def _run(cwd: Path, commands: dict[str, list[str]]) -> dict[str, tuple[int, str]]:
    """The commands side by side in `cwd` (the user's directory): name -> (exit status, output)."""
    env = child_env()
    env["HF_DATASETS_OFFLINE"] = "1"
    env["HF_DATASETS_CACHE"] = str(cwd / "hf_datasets")
    procs = {
        name: subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, argv in commands.items()
    }
    outputs = {name: proc.communicate(timeout=900)[0] for name, proc in procs.items()}
    return {name: (procs[name].returncode, out) for name, out in outputs.items()}


@pytest.fixture(scope="module")
def journey(tmp_path_factory, hf_family) -> Journey:
    cwd = tmp_path_factory.mktemp("journey")
    shutil.copytree(hf_family["qwen3"], cwd / "hf" / "Qwen3-0.6B")
    write_docstring_files(
        cwd / "corpus", ["json", "argparse", "collections", "functools", "textwrap", "string"]
    )
    tasks = cwd / "tasks"
    tasks.mkdir()
    (tasks / "journey.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    (tasks / "journey.yaml").write_text(
        "task: lmsys_journey\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'journey.jsonl'}\n"
        'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: text\n'
        "metric_list:\n  - metric: word_perplexity\n"
    )
    commands, snippet = journey_commands()
    (cwd / "snippet.py").write_text(snippet)
    planned = {c: _stand_in(c) for c in commands if not any(c.startswith(k) for k in NOT_RUN)}
    train = next(c for c in planned if "lmsys.train" in c)
    overrides = planned[train][planned[train].index("lmsys.train") + 1 :]
    one = _with(overrides, "trainer.micro_batch_size=8")  # one process, the same global batch
    sweep = [o for o in one if not o.startswith("trainer.run_dir=")]  # jobs in runs/reference/0 and /1
    references = {  # one process: eager and compiled (one sweep), and Muon
        "reference": [sys.executable, "-m", "lmsys.train", "-m", *sweep, "trainer.compile=false,true",
                      "hydra.sweep.dir=runs/reference"],
        "muon": [sys.executable, "-m", "lmsys.train", *_with(one, "optim=muon", "trainer.run_dir=runs/muon")],
    }  # fmt: skip
    stages = [
        [c for c in planned if "lmsys.hf_import" in planned[c][2]],
        [c for c in planned if "lmsys.prepare" in planned[c][2]],
        [train, *references],
        [c for c in planned if "lmsys.export" in planned[c][2]],
        ["snippet", *[c for c in planned if planned[c][2] == "lm_eval"]],
    ]
    runs = {**planned, **references, "snippet": [sys.executable, "snippet.py"]}
    assert sorted(sum(stages, [])) == sorted(runs), "every command has a stage"
    outputs: dict[str, tuple[int, str]] = {}
    for stage in stages:
        outputs.update(_run(cwd, {name: runs[name] for name in stage}))
        failed = [name for name in stage if outputs[name][0] != 0]
        assert not failed, "\n\n".join(f"{n}: exit {outputs[n][0]}\n{outputs[n][1][-4000:]}" for n in failed)
    return Journey(cwd, outputs, overrides)


def test_every_command_of_the_journey_runs(journey):
    commands, _ = journey_commands()
    assert len(commands) == 6 and commands[0].startswith("hf download ")
    for command in commands[1:]:
        journey.output(command)
    for text in STAND_IN:  # every stand-in still names a documented value
        assert any(text in c for c in commands), f"the journey no longer has {text!r}: update STAND_IN"
    assert "starting from the weights of model.init_from=exports/qwen3-0.6b" in journey.output("torchrun")


def test_two_ranks_at_zero3_give_the_losses_of_one_process(journey):
    two, one = journey.losses("qwen3-cpt"), journey.losses("reference/0")
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, rel=1e-5), (step, two, one)
    assert one[STEPS] < one[1] - 0.05, one  # it learns
    stats = json.loads((journey.cwd / "runs" / "qwen3-cpt" / "engine_stats.json").read_text())["engine"]
    assert stats["stage"] == 3 and stats["world_size"] == 2, stats


def test_compiled_training_gives_the_eager_losses(journey):
    eager, compiled = journey.losses("reference/0"), journey.losses("reference/1")
    assert sorted(compiled) == list(range(1, STEPS + 1))
    for step, loss in eager.items():
        assert compiled[step] == pytest.approx(loss, rel=1e-5), (step, compiled, eager)
    assert re.search(r"torch.compile: 1 graph\(s\), 0 graph break\(s\)", journey.output("reference"))


def test_the_run_trains_the_exports_own_model(journey):
    from lmsys.interop.export_dir import load_export, model_config_dict

    imported = load_export(journey.cwd / "exports" / "qwen3-0.6b")[0]
    run = journey.cwd / "runs" / "qwen3-cpt"
    found = ckpt.find_latest(run, pytest.fail)
    trained = found.state.model_config(found.tag_dir)
    assert model_config_dict(trained) == model_config_dict(imported.cfg)
    assert (trained.hf_model_type, trained.tokenizer_vocab_size, trained.vocab_size) == (
        "qwen3",
        PIECES,
        PIECES + 16,
    )
    assert trained.name == "Qwen3-0.6B" and trained.attention.qk_norm and trained.attention.n_kv_heads == 1


def test_muon_trains_the_familys_matrices(journey):
    from lmsys.engine.muon import split_parameters
    from lmsys.engine.reshard import MUON_MOMENTS, SavedState, trainable_in_optimizer_order
    from lmsys.engine.zero import LossModule, consolidated_state_dict
    from lmsys.model.transformer import Transformer

    run = journey.cwd / "runs" / "muon"
    assert (
        json.loads((run / "engine_stats.json").read_text())["engine"]["optimizer"] == "DeepSpeed Muon + AdamW"
    )
    found = ckpt.find_latest(run, pytest.fail)
    model = LossModule(Transformer(found.state.model_config(found.tag_dir)))
    muon, _, _ = split_parameters(model)
    names = [name for name, _ in trainable_in_optimizer_order(model)]
    saved = SavedState(found.tag_dir, found.state.zero_stage, found.state.world_size, names)
    weights = consolidated_state_dict(found.tag_dir, found.state.zero_stage)
    hidden = {name for name, p in model.named_parameters() if any(p is m for m in muon)}
    assert hidden == {f"model.blocks.{i}.{n}" for i in range(2) for n in MUON_MATRICES}
    for name in hidden:
        state = saved.param(name, weights[name].shape)
        assert (
            sorted(state.moments) == list(MUON_MOMENTS) and state.moments["momentum_buffer"].abs().sum() > 0
        )
    muon_losses, adamw = journey.losses("muon"), journey.losses("reference/0")
    assert muon_losses[1] == pytest.approx(adamw[1], rel=1e-6)  # the same model and batch
    assert muon_losses[STEPS] < muon_losses[1] and abs(muon_losses[STEPS] - adamw[STEPS]) > 1e-3


@torch.no_grad()
def test_the_export_is_a_qwen3_that_transformers_and_lm_eval_run(journey, transformers):
    from lmsys.interop.export_dir import load_model

    out = journey.cwd / "exports" / "qwen3-cpt-hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == PIECES + 16
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours, tok, _ = load_model(journey.cwd / "runs" / "qwen3-cpt")  # the run's checkpoint, consolidated
    ids = torch.tensor([tok.encode(TEXT)[:48]])
    want = ours(ids)
    assert ((hf(ids).logits - want).abs().max() / want.abs().max()).item() <= 1e-5
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto(TEXT)["input_ids"] == tok.encode(TEXT)
    assert "The capital of France is" in journey.output("snippet")
    table = journey.output("lm_eval")
    row = re.search(r"\|lmsys_journey\s*\|.*\|word_perplexity\|[^|]*\|\s*([\d.]+)\|", table)
    assert row and math.isfinite(float(row.group(1))), table
