"""lmsys-train's own help and its one-line mistakes, through the real command (no training)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmsys.core.errors import ConfigError
from tests.integration.features import child_env


def lmsys_train(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmsys.train", *args],
        cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_help_lists_groups_keys_and_examples(tmp_path):
    proc = lmsys_train("--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    out = proc.stdout
    assert out.startswith("usage: lmsys-train")
    assert "  model           gpt2_124m," in out, out
    assert "  deepspeed       zero0, zero1, zero2*, zero3, zero3_offload" in out, out
    assert "trainer.max_steps" in out and "examples:" in out and "torchrun" in out
    assert list(tmp_path.iterdir()) == []  # help writes nothing


def test_help_and_a_refused_flag_answer_without_torch():
    """--help and a refused flag import neither torch nor DeepSpeed (about 3 CPU-s); the trainer's
    own name for its lines is the command's."""
    probe = (
        "import sys, contextlib, io\n"
        "from lmsys.train import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    codes = main(['--help']), main(['--max_stepz', '5'])\n"
        "print(codes, sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.strip() == "(0, 2) []", proc.stdout + proc.stderr

    import lmsys.train
    from lmsys.training import run

    assert lmsys.train.PROG == run.PROG


def test_help_shows_the_values_the_overrides_give(tmp_path):
    out = lmsys_train("model=gpt2_124m", "optim.lr=0.25", "-h", cwd=tmp_path).stdout
    assert any(ln.startswith("  data.seq_len") and ln.endswith("[1024]") for ln in out.splitlines()), out
    assert any(ln.startswith("  optim.lr ") and ln.endswith("[0.25]") for ln in out.splitlines()), out


def test_a_misspelled_key_is_one_line_with_the_nearest_one(tmp_path):
    proc = lmsys_train("optim.lrr=1", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "lmsys-train: error: Key 'lrr' not in 'OptimConfig' (key: optim.lrr); did you mean optim.lr?"
    ]


def test_a_fault_injection_key_under_trainer_names_its_debug_key(tmp_path):
    """The debug.* keys spelled under trainer. (trainer.debug_<name>): one line naming debug.<name>,
    for a plain run, a sweep's job, and through Hydra's own error (a key Hydra composes)."""
    from omegaconf import OmegaConf

    from lmsys.core.config import Config, compose, hydra_error_line

    for args in (
        ["trainer.debug_nan_steps=[3]"],
        ["-m", "optim.lr=1e-3,3e-4", "trainer.debug_nan_steps=[3]"],
    ):
        proc = lmsys_train(*args, cwd=tmp_path)
        (line,) = proc.stderr.strip().splitlines()  # a sweep's names the job: "sweep job 0 (...): ..."
        assert proc.returncode == 2 and line.startswith("lmsys-train: error: "), proc.stderr
        assert line.endswith("trainer.debug_nan_steps is now debug.nan_steps"), line
    with pytest.raises(ConfigError, match="^trainer.debug_hang_how is now debug.hang_how$"):
        compose(["+trainer.debug_hang_how=stop"])
    with pytest.raises(Exception) as hydra_says:  # OmegaConf's own error, as Hydra's app meets it
        OmegaConf.merge(OmegaConf.structured(Config), {"trainer": {"debug_replay_oom": []}})
    assert hydra_error_line(hydra_says.value) == "trainer.debug_replay_oom is now debug.replay_oom"
    assert compose(["debug.nan_steps=[3]", "debug.hang_how=stop"]).debug.nan_steps == [3]
    assert list(tmp_path.iterdir()) == []


def test_every_example_fits_the_default_data(tmp_path):
    """Each example in --help runs as written on data/default (what `python -m lmsys.prepare`
    writes, with the default model's vocabulary): its model has that vocabulary, and launches go
    through the quiet launcher (raw torchrun adds ~40 lines of its own). The docs test
    (tests/integration/test_docs_commands.py) runs them."""
    from lmsys.core.config import compose
    from lmsys.sweep.multirun import expand_sweep

    out = lmsys_train("--help", cwd=tmp_path).stdout
    examples = out.split("examples", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    commands = [line.split("#", 1)[0].split() for line in examples]
    assert len(commands) >= 5 and not any(c[0] == "torchrun" for c in commands), examples
    default_vocab = compose([]).model.vocab_size
    for command in commands:
        args = command[command.index("--") + 1 :] if "--" in command else command[1:]
        if args[:2] == ["-m", "lmsys.train"]:
            args = args[2:]
        if "lmsys.prepare" in command or "--cfg" in args:
            continue
        overrides = [a for a in args if not a.startswith("-")]
        for job in expand_sweep(overrides) if "-m" in args else [overrides]:
            assert compose(job).model.vocab_size == default_vocab, (command, job)


def test_an_argparse_flag_is_one_line_naming_the_override(tmp_path):
    """`--max_steps 5` (an argparse habit) is not Hydra's usage block but the key=value it means."""
    proc = lmsys_train("--max_steps", "5", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "lmsys-train: error: unknown option --max_steps; lmsys-train takes key=value overrides: "
        "did you mean trainer.max_steps=5?"
    ]
    assert list(tmp_path.iterdir()) == []
