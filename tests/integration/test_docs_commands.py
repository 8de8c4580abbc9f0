"""Every command the README and the commands' --help show is run by this test, as written, in a
scratch directory prepared like a user's: every command a user can copy is known to work as
written.

Extraction is real: the README's ```bash blocks and the inline `python -m ...` / `lmsys-...`
commands of its journeys, and the example lines of every command's --help (the commands are
found in the source tree: lmsys/*.py and launch/*.py with a main, the packages with a
__main__.py, tools.bench's benchmarks). A command added to the README or to a --help is tested
without touching this file.

How each command runs, in the scratch directory (the cwd, so runs/, exports/ and data/ land
there), one stage after the other (prepare, train, export, use the export, lm-evaluation-harness),
the commands of a stage side by side:
- the data: `corpus/` (docstrings of 20 standard-library modules) and `data/default` prepared from
  it by the real CLI, so the defaults point at small data (the default corpus, the whole standard
  library, takes about a minute to prepare: see NOT_RUN);
- the examples' placeholder paths hold what they name: runs/tiny-x is a copy of the journey's
  run (runs/demo), exports/tiny of its export, hf/gpt2 of its transformers directory
  (exports/demo-hf), notes.txt a text file; `--tasks TASKS` names a local task (CHANGED);
- `lmsys-<tool>` runs as `python -m <module>` from pyproject's [project.scripts] (the same command);
- the training launch whose run the journey reads afterwards (runs/demo) trains for real; every
  other training command runs in its launcher's check-only mode (CHECK_ONLY below): the whole
  preflight (config, batch arithmetic for its world size, the prepared data) and nothing trained;
- the few commands that cannot run here are in NOT_RUN with the reason, modules another branch
  is adding are in PENDING, and README lines that are wrong or too long as written are in CHANGED
  with what the test runs instead (the README should say that; see the entries).

Every command that runs must exit 0 without a traceback.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from tests.stdlib_text import write_docstring_files

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"

# Commands that cannot run on a 2-core machine without GPUs or downloads: exact text, or a prefix
# ending in a space. Each names what covers it instead.
NOT_RUN = {
    "make train": "prepares the default corpus (~1 min) and trains 300 steps (~3 min): its four commands "
    "are the journey's, run here",
    "make test": "the suite itself",
    "make test-fast": "the suite's unit tier itself",
    "make lint": "tests/test_lint.py runs ruff",
    ".venv/bin/pytest tests/unit/model": "a part of the suite itself",
    "python -m lmsys.prepare": "the default corpus, the whole standard library: ~1 min on 2 cores "
    "(tests/unit/data/test_prepare.py prepares corpora of every kind)",
    "python -m lmsys.prepare data.sources=[corpus/] data.tokenizer=hf/gpt2 model=gpt2_124m": "needs "
    "GPT-2's own tokenizer files (50257 pieces, a download); tests/unit/data/test_tokenizer_json.py uses a "
    "GPT-2-style byte-level BPE",
    "python -m launch.torchrun --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 -- model=gpt2_350m ...": (
        "a second machine (node0) and `...`; tests/integration/launch/test_torchrun.py runs two nodes on "
        "127.0.0.1"
    ),
    "sbatch --nodes=4 --gpus-per-node=8 launch/slurm.sbatch model=gpt2_1558m deepspeed=zero3 trainer=gpt2 "
    "optim=gpt2": "4 nodes x 8 GPUs; tests/integration/launch/test_slurm.py submits the script to a "
    "one-machine cluster",
    "python -m tools.bench": "the kernel table, then the training loop: minutes; tests/integration/tools/ "
    "runs each",
    "python -m tools.bench ": "benchmarks, minutes each (the kernels' on a GPU); tests/integration/tools/ "
    "runs them",
    "python -m tools.inspect": "compiles every kernel (minutes); "
    "tests/integration/tools/test_inspect_subset.py compiles a subset",
    "python -m tools.inspect ": "compiles kernels (minutes); tests/integration/tools/test_inspect_subset.py "
    "runs a subset",
    "python -m lmsys.prepare data.format=chat ": "needs a model's tokenizer and a file of conversations; "
    "tests/integration/data/test_chat.py previews and prepares them, tests/integration/llama/test_sft.py "
    "runs docs/huggingface.md's fine-tuning journey",
}

# Modules the README names that another branch is adding: printed, and run once they exist.
PENDING: dict[str, str] = {}

# README lines that do not run as written here, with what runs instead and why. The README should
# say the replacement (then this entry goes: an entry whose README line is gone fails the test).
CHANGED = {
    "python -m lmsys.harness --model lmsys --model_args path=runs/demo/export --tasks TASKS": (
        "python -m lmsys.harness --model lmsys --model_args path=runs/demo/export --tasks lmsys_docs_rolling "
        "--include_path tasks",
        "TASKS is a placeholder; the hub's tasks need downloads, so a local task (tasks/) stands in",
    ),
}

# The launchers' check-only modes: the preflight every launch runs before its first worker.
CHECK_ONLY = {
    "launch.torchrun": "--dry-run: the launch plan and the trainer's preflight for its world size",
    "launch.sweep": "--dry-run: every job composed and preflighted, the launcher plan",
    "lmsys.train": "as launch.torchrun --nproc 1 --dry-run (one process), launch.sweep --nproc 1 "
    "--dry-run (-m): the same preflight",
}

# Commands whose --help this test does not ask: lm-evaluation-harness's own parser (its examples are
# lm-eval's), and the benchmarks and kernel tools, whose examples are all in NOT_RUN (a torch import
# each, for nothing to run).
HELP_NOT_ASKED = ("lmsys.harness", "tools.bench", "tools.inspect")

# Stages: a command runs after those of the stages before it (what it reads is written there).
STAGES = {
    "lmsys.prepare": 0,
    "lmsys.train": 1,
    "launch.torchrun": 1,
    "launch.sweep": 1,
    "lmsys.export": 2,
    "lmsys.generate": 3,
    "lmsys.evaluate": 3,
    "lmsys.hf_import": 3,
    "lmsys.harness": 4,
}
HELP_COMMAND = re.compile(r"^(?:examples?:\s*)?((?:python -m |lmsys-[a-z]+ |torchrun -)\S.*)$")
SYNOPSIS = re.compile(r" \[|\{|\||usage:|\.\.\.")  # `tool [--opt] {a,b} ...`: a usage line, not a command


def _strip_comment(line: str) -> str:
    return shlex.join(shlex.split(line, comments=True)) if "#" in line else line.strip()


# ----------------------------------------------------------------------------- extraction


def readme_commands(text: str) -> list[str]:
    """The ```bash blocks' lines, and inline `python -m ...` / `lmsys-...` commands of the journeys."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.strip() and not line.strip().startswith("#"):
                commands.append(_strip_comment(line))
    journeys = text.split("## A tour", 1)[1].split("\n## ", 1)[0]
    journeys = re.sub(r"```.*?```", "", journeys, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", journeys):
        if span.startswith(("python -m ", "lmsys-")) and " " in span and not SYNOPSIS.search(span):
            commands.append(span.strip())
    return commands


def command_modules() -> list[list[str]]:
    """Every command of the source tree, as the arguments after `python -m`, less HELP_NOT_ASKED."""
    found = []
    for package in ("lmsys", "launch"):
        for path in sorted((REPO_ROOT / package).glob("*.py")):
            source = path.read_text(encoding="utf-8")
            if "def main(" in source and '__name__ == "__main__"' in source:
                found.append([f"{package}.{path.stem}"])
    for main in sorted([*REPO_ROOT.glob("lmsys/*/__main__.py"), *REPO_ROOT.glob("tools/*/__main__.py")]):
        found.append([".".join(main.parent.relative_to(REPO_ROOT).parts)])
    from tools.bench.__main__ import COMMANDS

    found += [["tools.bench", name] for name in COMMANDS]
    return [m for m in found if m[0] not in HELP_NOT_ASKED]


def help_commands(help_text: str) -> list[str]:
    commands = []
    for line in help_text.splitlines():
        match = HELP_COMMAND.match(line.strip())
        if match and not SYNOPSIS.search(match.group(1)):
            commands.append(_strip_comment(match.group(1)))
    return commands


# ----------------------------------------------------------------------------- running


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["WANDB_MODE"] = "offline"
    env.pop("WANDB_API_KEY", None)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NPROC", "NNODES"):
        env.pop(key, None)
    return env


def console_scripts() -> dict[str, str]:
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in scripts.items()}


@dataclass
class Planned:
    text: str  # as the README or the --help writes it
    argv: list[str]  # what runs
    how: str  # "as written", "check-only: ...", "changed: ..."
    stage: int


def _module_of(tokens: list[str], scripts: dict[str, str]) -> tuple[str | None, list[str]]:
    """(module, its arguments) of `python -m M ...` or a console script."""
    if tokens[0] in scripts:
        return scripts[tokens[0]], tokens[1:]
    if tokens[:2] == ["python", "-m"]:
        return tokens[2], tokens[3:]
    return None, tokens


def _in_checkout(module: str) -> bool:
    """Whether this checkout has `module` (a .py or a package); not importlib's answer, which an
    editable install of another checkout can give."""
    path = REPO_ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _insert_dry_run(args: list[str]) -> list[str]:
    split = args.index("--") if "--" in args else len(args)
    return [*args[:split], "--dry-run", *args[split:]]


def plan(text: str, read_later: str, scripts: dict[str, str]) -> Planned | str:
    """How `text` runs here, or why it does not (a string)."""
    for key, reason in NOT_RUN.items():
        if text == key or (key.endswith(" ") and text.startswith(key)):
            return f"not run here: {reason}"
    how = "as written"
    if text in CHANGED:
        text_run, why = CHANGED[text]
        how = f"changed: {why}"
    else:
        text_run = text
    module, args = _module_of(shlex.split(text_run), scripts)
    if module is None:
        raise AssertionError(
            f"{text!r}: neither `python -m` nor a console script; add it to NOT_RUN with why"
        )
    if not _in_checkout(module):
        if module in PENDING:
            return f"pending: {PENDING[module]}"
        raise AssertionError(f"{text!r}: no module {module}")
    run_dirs = re.findall(r"trainer\.run_dir=(\S+)", text_run)
    trains_for_later = bool(run_dirs) and run_dirs[0] in read_later
    if module in ("launch.torchrun", "launch.sweep") and not trains_for_later:
        args, how = _insert_dry_run(args), f"check-only: {CHECK_ONLY[module]}"
    elif module == "lmsys.train" and not any(a.startswith("-") and a != "-m" for a in args):
        overrides = [a for a in args if a != "-m"]
        module = "launch.sweep" if "-m" in args else "launch.torchrun"
        args, how = (
            ["--nproc", "1", "--dry-run", "--", *overrides],
            f"check-only: {CHECK_ONLY['lmsys.train']}",
        )
    return Planned(text, [sys.executable, "-m", module, *args], how, STAGES.get(module, 1))


def prepare_scratch(cwd: Path) -> None:
    """The user's directory: a small corpus, data/default prepared from it, the README to evaluate
    on, notes.txt, and a local lm-evaluation-harness task."""
    write_docstring_files(cwd / "corpus", [
        "json", "argparse", "collections", "functools", "itertools", "pathlib", "re", "os", "random",
        "string", "textwrap", "typing", "dataclasses", "heapq", "bisect", "statistics", "fractions",
        "decimal", "datetime", "calendar",
    ])  # fmt: skip
    shutil.copy(README, cwd / "README.md")
    (cwd / "notes.txt").write_text((cwd / "corpus" / "doc_00.txt").read_text()[:3000], encoding="utf-8")
    tasks = cwd / "tasks"
    tasks.mkdir()
    (tasks / "rolling.jsonl").write_text(json.dumps({"text": (cwd / "notes.txt").read_text()[:1500]}) + "\n")
    (tasks / "rolling.yaml").write_text(
        "task: lmsys_docs_rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'rolling.jsonl'}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: text\nmetric_list:\n  - metric: word_perplexity\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "lmsys.prepare", "data.sources=[corpus/]"],
        cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def fill_placeholders(cwd: Path, stage: int) -> None:
    """After a stage: the paths the --help examples name, as copies of what the journey made."""
    copies = {
        1: [("runs/demo", "runs/tiny-x")],
        2: [("runs/demo/export", "exports/tiny"), ("exports/demo-hf", "hf/gpt2")],
    }
    for src, dst in copies.get(stage, []):
        if (cwd / src).is_dir() and not (cwd / dst).exists():
            shutil.copytree(cwd / src, cwd / dst, ignore=shutil.ignore_patterns("wandb", "export"))


def run_stage(cwd: Path, planned: list[Planned]) -> list[str]:
    """The commands side by side; the failures, each with its output's tail."""
    procs = [
        (p, subprocess.Popen(p.argv, cwd=cwd, env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True))
        for p in planned
    ]  # fmt: skip
    failures = []
    for p, proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0 or "Traceback" in out:
            failures.append(
                f"{p.text}\n  ran: {shlex.join(p.argv[1:])}\n  exit {proc.returncode}:\n{out[-3000:]}"
            )
    return failures


# ----------------------------------------------------------------------------- the tests


def test_extraction_finds_the_readme_journeys_and_help_examples():
    """The parser sees what a reader sees (guards against a format change hiding every command)."""
    commands = readme_commands(README.read_text(encoding="utf-8"))
    assert "make train" in commands and any(
        c.startswith("python -m lmsys.export runs/demo") for c in commands
    )
    assert any(c.startswith("python -m lmsys.harness --model lmsys") for c in commands)  # an inline one
    assert not any("#" in c for c in commands), commands
    text = "examples: python -m lmsys.export runs/x   # note\n          python -m lmsys.generate m p=1\n"
    text += "usage: python -m lmsys.sweep summarize SWEEP_DIR [--no-plot]\n  lmsys-train -m a=1,2\n"
    assert help_commands(text) == ["python -m lmsys.export runs/x", "python -m lmsys.generate m p=1",
                                   "lmsys-train -m a=1,2"]  # fmt: skip
    assert ["launch.sweep"] in command_modules() and ["lmsys.sweep"] in command_modules()


@pytest.mark.slow
def test_every_readme_and_help_command_runs(tmp_path):
    started = time.perf_counter()
    readme = README.read_text(encoding="utf-8")
    for text in CHANGED:
        assert text in readme_commands(readme), f"README no longer has {text!r}: remove it from CHANGED"
    helps = [
        subprocess.Popen([sys.executable, "-m", *m, "--help"], cwd=tmp_path, env=child_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for m in command_modules()
    ]  # fmt: skip
    commands = readme_commands(readme)
    for module, proc in zip(command_modules(), helps):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "Traceback" not in err, (module, err[-2000:])
        commands += help_commands(out)
    commands = list(dict.fromkeys(commands))  # the README and a --help may show the same one

    scripts = console_scripts()
    planned, skipped = [], []
    for text in commands:
        read_later = " ".join(c for c in commands if c != text)
        outcome = plan(text, read_later, scripts)
        (skipped.append(f"{text}\n    {outcome}") if isinstance(outcome, str) else planned.append(outcome))
    cwd = tmp_path / "user"
    cwd.mkdir()
    prepare_scratch(cwd)
    failures = []
    for stage in sorted({p.stage for p in planned}):
        failures += run_stage(cwd, [p for p in planned if p.stage == stage])
        fill_placeholders(cwd, stage)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)  # the machine's load stretches wall time
    report = [
        f"{len(planned)} commands run in {time.perf_counter() - started:.0f} s "
        f"({used.ru_utime + used.ru_stime:.0f} CPU-s in the commands):"
    ]
    report += [f"  [{p.how}] {p.text}" for p in planned]
    report += [f"{len(skipped)} not run:", *[f"  {s}" for s in skipped]]
    print("\n".join(report))
    assert not failures, "\n\n".join(failures)
    assert len(planned) >= 15, report
