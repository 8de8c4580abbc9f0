"""A model.kernels=triton export runs through lmsys-generate and lmsys-eval on a machine without
CUDA, as a user starts them: no TRITON_INTERPRET in the environment (this session's conftest set
it for itself, so the child's environment drops it). The CLIs select the Triton CPU interpreter
(lmsys.model.ops.prepare_kernels); without it the first kernel call fails. The results equal those of
the same weights exported with kernels=torch.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from lmsys.interop.export_dir import write_export
from lmsys.model.transformer import Transformer
from tests.fixtures.exports import REPO_ROOT, child_env, cli_command, run_side_by_side, small_config

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU interpreter is selected only without CUDA"
)


def test_triton_export_runs_on_cpu_without_triton_interpret(tmp_path, tokenizer_path):
    torch.manual_seed(0)
    state = Transformer(small_config()).state_dict()
    text = tmp_path / "text.txt"
    text.write_text("def main():\n    return parse(sys.argv)\n\n" * 4, encoding="utf-8")
    env = child_env()
    env.pop("TRITON_INTERPRET", None)

    commands = {}
    for kernels in ("torch", "triton"):
        export = write_export(
            tmp_path / kernels, small_config(extra=[f"kernels={kernels}"]), state, tokenizer_path, {"step": 0}
        )
        json_out = tmp_path / f"{kernels}.json"
        calls = {
            "generate": [str(export), "prompt=def ", "greedy=true", "max_new_tokens=6", "output=jsonl"],
            "eval": [str(export), f"text={text}", f"json={json_out}"],
        }
        for name, args in calls.items():
            module = "lmsys.generate" if name == "generate" else "lmsys.evaluate"
            commands[name, kernels] = (cli_command(module, *args, "device=cpu"), env)
    outputs = {}
    for key, proc in run_side_by_side(commands).items():
        assert proc.returncode == 0, (
            f"{key}: exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
        outputs[key] = proc.stdout

    completions = {k: json.loads(outputs["generate", k].splitlines()[-1]) for k in ("torch", "triton")}
    assert completions["triton"]["new_tokens"] == 6
    assert completions["triton"]["completion"] == completions["torch"]["completion"]
    losses = {k: json.loads((tmp_path / f"{k}.json").read_text())["loss"] for k in ("torch", "triton")}
    assert losses["triton"] == pytest.approx(losses["torch"], rel=1e-5)

    # bf16 on CPU with the Triton kernels: the interpreter cannot, so one error line, exit 2
    bf16 = subprocess.run(
        cli_command("lmsys.generate", str(tmp_path / "triton"), "prompt=def ", "device=cpu", "dtype=bf16"),
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bf16.returncode == 2, bf16.stdout + bf16.stderr
    assert bf16.stderr.startswith("lmsys-generate: error: model.kernels=triton with bf16 on cpu")
    assert len(bf16.stderr.strip().splitlines()) == 1, bf16.stderr
