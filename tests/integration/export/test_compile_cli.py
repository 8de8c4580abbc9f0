"""compile= of lmsys-generate and lmsys-eval, the real CLIs with inductor: the same output as
eager, one stderr line saying what was compiled (generation: a prompt graph and a decode graph;
evaluation: one graph for every batch, the last one padded), a compile failure under true is one
error line (exit 2), and under auto it runs eager with one warning.

Inductor builds C++ on a CPU (tens of seconds per graph), so each CLI compiles once here, in
parallel. The failure is a real one: inductor with no working C++ compiler (CXX) and an empty
inductor cache (a cached graph would need no compiler).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.fixtures.exports import (
    assert_one_line_error,
    child_env,
    cli_command,
    run_clis,
    run_side_by_side,
)

pytestmark = pytest.mark.slow

GENERATE = [
    "prompt=The",
    "prompt=Return a new list of the",
    "greedy=true",
    "max_new_tokens=12",
    "output=jsonl",
]


def test_compiled_generation_and_evaluation_print_what_eager_prints(random_export, tokenizer_path, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(
        " ".join(f"Return the value of item {i} in the list." for i in range(60)), encoding="utf-8"
    )
    evaluate = [f"text={text}", "seq_len=16", "batch_size=4"]  # 8 windows: 4 + 4, then the stream's tail
    calls = {
        f"{prog}-{choice}": [module, str(random_export), *args, f"compile={choice}"]
        for prog, module, args in (
            ("generate", "lmsys.generate", GENERATE),
            ("eval", "lmsys.evaluate", evaluate),
        )
        for choice in ("false", "true")
    }
    procs = run_clis(calls, parallel=4, timeout=600)
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, proc.stdout, proc.stderr)
    eager, compiled = (procs[f"generate-{c}"] for c in ("false", "true"))
    assert compiled.stdout == eager.stdout
    assert [json.loads(line)["new_tokens"] for line in compiled.stdout.splitlines()] == [12, 12]
    assert compiled.stderr.strip().splitlines() == [compiled.stderr.strip()]  # one line, nothing else
    assert "lmsys-generate: torch.compile: 2 graph(s), 0 graph break(s), compiled in" in compiled.stderr
    assert "(for generation)" in compiled.stderr and eager.stderr.strip() == ""
    eager, compiled = (procs[f"eval-{c}"] for c in ("false", "true"))
    results = [line for line in compiled.stdout.splitlines() if "perplexity" in line]
    assert results and results == [line for line in eager.stdout.splitlines() if "perplexity" in line]
    assert "lmsys-eval: torch.compile: 1 graph(s), 0 graph break(s)" in compiled.stderr, compiled.stderr


def _without_a_cxx_compiler(tmp_path) -> dict[str, str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = child_env()
    env["CXX"] = str(tmp_path / "no-such-g++")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor-cache")  # empty: everything must be built
    return env


AUTO_FALLBACK = """
import torch
from lmsys.model.compiling import compiled_for_cli
model, warnings = torch.nn.Linear(4, 3), []
want = model(torch.ones(2, 4))
with compiled_for_cli("auto", torch.device("cuda"), "lmsys-test", "testing", warnings.append) as use:
    assert use(model)
    assert torch.equal(model(torch.ones(2, 4)), want)
print(warnings)
"""


def test_a_compile_failure_is_one_error_line_under_true_and_runs_eager_with_a_warning_under_auto(
    random_export, tmp_path
):
    """Both at once (each process mostly imports torch and starts inductor). auto compiles on CUDA
    only: its decision is given a CUDA device (no tensor goes there) and the model stays on the
    CPU, where inductor then fails to build."""
    commands = {
        "true": cli_command("lmsys.generate", str(random_export), *GENERATE, "compile=true"),
        "auto": [sys.executable, "-c", AUTO_FALLBACK],
    }
    envs = {name: _without_a_cxx_compiler(tmp_path / name) for name in commands}
    procs = run_side_by_side({name: (commands[name], envs[name]) for name in commands})
    assert_one_line_error(
        procs["true"], "lmsys-generate", "compile=true: torch.compile failed on this model and device",
        "C++ compiler", "compile=false runs eager",
    )  # fmt: skip
    assert procs["true"].stdout == ""
    auto = procs["auto"]
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.strip() == str(["torch.compile failed on this model and device; testing ran eager"])
    assert "lmsys-test: torch.compile:" not in auto.stderr
    assert os.path.isdir(envs["auto"]["TORCHINDUCTOR_CACHE_DIR"])  # inductor did try
