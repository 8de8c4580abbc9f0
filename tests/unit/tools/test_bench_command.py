"""`python -m tools.bench`: one command for every benchmark; a wrong name is one line. The
benchmarks themselves run in tests/integration/tools/."""

from __future__ import annotations

from pathlib import Path

from tools.bench.__main__ import COMMANDS, DEFAULT, main

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_every_benchmark_is_one_name_and_the_default_is_make_bench():
    kernels = {"kernels", "attention", "layer_norm", "ce"}
    system = {"train", "prepare", "generate", "plan", "ttl", "checkpoint", "integrity"}
    assert set(COMMANDS) == kernels | system
    assert DEFAULT == (["kernels"], ["train"])
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "\t$(PY) -m tools.bench\n" in makefile and "\t$(PY) -m tools.inspect $(INSPECT_ARGS)\n" in makefile


def test_help_names_every_benchmark(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out.splitlines()[0] for name in COMMANDS)


def test_an_unknown_benchmark_is_one_line(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tools.bench: error: unknown benchmark 'trian'; usage: python -m tools.bench")
    assert len(err.splitlines()) == 1
