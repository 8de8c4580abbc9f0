"""What a training run prints: plain progress lines in a log file, the bar in a terminal, the
startup, checkpoint, validation-coverage and W&B lines, and what a resume says it continues.

The log-file mode is the real CLI with its output captured through pipes (the cached 1-process
run); the terminal mode is the Console with a terminal forced, since a test has no tty.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from lmsys.core import rundir
from lmsys.core.config import OptimConfig
from lmsys.core.console import Console, duration
from lmsys.core.rundir import EvalRecord, MetricsFile, TrainRecord
from lmsys.engine.zero import lr_at
from lmsys.training.plots import loss_figure, plot_losses, resume_steps
from lmsys.training.reporter import Reporter
from tests.train.conftest import MAX_STEPS, copy_run, run_train

STEP_LINE = re.compile(
    r"^lmsys-train: step (\d+)/(\d+) \| loss [\d.]+ \| lr [\d.e+-]+ \| grad norm [\d.e+-]+ \| "
    r"[\d,]+ tok/s \| elapsed \d+s(?: \| ETA \d+s)?$"
)


def report(step: int, initial: int = 0) -> TrainRecord:
    """Step `step` of a launch that began after step `initial`, 2 s per step."""
    return TrainRecord(step, 2.5, 1e-3, 0.75, 1234.0, None, 2.0, 2.0 * (step - initial), 0.5, 256 * step)


def test_log_file_gets_plain_lines_and_no_bar_frames(runs):
    run = runs.get("1proc").check()  # stdout and stderr are pipes: not a terminal
    out = run.stdout.splitlines()
    assert "\r" not in run.stdout + run.stderr
    steps = [int(m.group(1)) for line in out if (m := STEP_LINE.match(line))]
    # logger.console_interval=10 (the default) and 6 steps: the launch's first and last step
    assert steps == [1, MAX_STEPS], run.stdout
    assert "ETA" in next(line for line in out if STEP_LINE.match(line))
    assert out[0].startswith("lmsys-train: starting: process group, model, DeepSpeed engine")
    saved = [line for line in out if line.startswith("lmsys-train: saved checkpoint ")]
    assert [Path(line.split()[3]).name for line in saved] == ["step_0000002", "step_0000004", "step_0000006"]
    assert all(Path(line.split()[3]).is_dir() for line in saved)
    # trainer.eval_batches=2 micro-batches of 8 on 1 rank: 16 of the split's sequences, said so
    banner = next(line for line in out if line.startswith("lmsys-train: validation every 3 steps on "))
    assert re.search(r"on 16 of \d+ val sequences \(trainer.eval_batches=0 for the whole split\)$", banner)
    evals = [line for line in out if " val loss " in line and line.startswith("lmsys-train: step ")]
    assert len(evals) == 2 and all("(16 of " in e and "| lr " in e and "grad norm" in e for e in evals)
    wandb_lines = [line for line in out if line.startswith("lmsys-train: W&B: offline run in ")]
    assert len(wandb_lines) == 2  # at the start and at the end
    sync_dir = Path(wandb_lines[-1].rsplit("wandb sync ", 1)[1])
    assert sync_dir.is_dir() and sync_dir.parent == run.run_dir / "wandb"
    assert list(sync_dir.glob("*.wandb"))


def test_plain_lines_every_console_interval(capsys):
    console = Console("lmsys-train", progress=True, interval=10, terminal=False)
    with console.progress(total=30, initial=4):
        for step in range(5, 31):
            console.step_done(report(step, initial=4))
    out, err = capsys.readouterr()
    assert [int(m.group(1)) for m in map(STEP_LINE.match, out.splitlines()) if m] == [5, 10, 20, 30]
    assert err == ""  # no bar
    first = out.splitlines()[0]
    assert first.endswith("| elapsed 2s | ETA 50s")  # the launch's first step; 25 to go at 2 s each
    assert "ETA" not in out.splitlines()[-1]  # the last step


def test_terminal_shows_the_bar_with_the_fields(capsys):
    console = Console("lmsys-train", progress=True, interval=1, terminal=True)
    with console.progress(total=3, initial=0):
        for step in (1, 2, 3):
            console.step_done(report(step))
        console.eval_done(EvalRecord.of(3, 2.25), 2.5, "all 12 val sequences")
    out, err = capsys.readouterr()
    assert not any(STEP_LINE.match(line) for line in out.splitlines())  # the bar instead of lines
    assert "3/3" in err and "lr=1.00e-03" in err and "gnorm=0.75" in err and "tok_s=1,234" in err
    assert (
        "lmsys-train: step 3: train loss 2.5000 | val loss 2.2500 (all 12 val sequences) | lr 1.00e-03" in out
    )


def test_durations():
    assert [duration(s) for s in (0, 42.4, 185, 3725, 90000)] == ["0s", "42s", "3m05s", "1h02m", "25h00m"]


def test_a_progress_false_terminal_gets_lines(capsys):
    console = Console("lmsys-train", progress=False, interval=2, terminal=True)
    with console.progress(total=4, initial=0):
        for step in range(1, 5):
            console.step_done(report(step))
    out, err = capsys.readouterr()
    assert [int(m.group(1)) for m in map(STEP_LINE.match, out.splitlines()) if m] == [1, 2, 4]
    assert err == ""


@pytest.mark.slow
def test_extending_max_steps_keeps_the_schedule(runs, tmp_path):
    """The finished 6-step run resumed with trainer.max_steps=9: it says so, and steps 7-9 get the
    learning rate of the 6-step schedule (its floor), not a cosine re-planned over 9 steps."""
    reference = runs.get("1proc").check()
    run_dir = copy_run(reference, tmp_path / "run")
    overrides = [o for o in runs.overrides("1proc") if not o.startswith("logger")] + ["logger=none"]
    extended = run_train("extended", 1, [*overrides, "trainer.max_steps=9"], run_dir, cwd=tmp_path).check()
    assert "trainer.max_steps extended from 6 to 9; the learning rate keeps its schedule" in extended.stdout
    optim = OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=6)
    lrs = {r["step"]: r["lr"] for r in extended.records()}
    assert [lrs[s] for s in (7, 8, 9)] == pytest.approx([lr_at(s, optim, 9) for s in (7, 8, 9)], rel=1e-12)
    assert lrs[9] == pytest.approx(3e-3 * OptimConfig().min_lr_ratio)
    assert "decay_steps: 6" in (run_dir / "config.yaml").read_text()

    again = run_train("again", 1, [*overrides, "trainer.max_steps=9"], run_dir, cwd=tmp_path).check()
    assert "no steps to run: the checkpoint is at step 9 (trainer.max_steps=9)" in again.stdout
    assert "steps 10..9" not in again.stdout


def test_sweep_jobs_get_a_header(runs):
    run = runs.get("2proc-zero0").check()  # one `-m deepspeed=zero0,zero1,zero2,zero3` launch
    headers = [line for line in run.stdout.splitlines() if line.startswith("lmsys-train: sweep job ")]
    assert len(headers) == 4, run.stdout  # rank 0 only
    for number, line in enumerate(headers):
        assert line.startswith(f"lmsys-train: sweep job {number}: ")
        assert f"deepspeed=zero{number}" in line and line.endswith(f"/2proc-zero{number}")


def test_the_done_line_counts_the_skipped_updates(capsys, tmp_path):
    reporter = Reporter(Console("lmsys-train", terminal=False), log_interval=1, plot=False)
    with reporter.steps(1, 4):
        for step in range(1, 5):
            reporter.step_done(replace(report(step), skipped=step in (2, 4)))
    reporter.finish((2.5, 2.5, None), 0, 4, 8.0, tmp_path, None)
    done = next(line for line in capsys.readouterr().out.splitlines() if "done:" in line)
    assert done.startswith("lmsys-train: done: steps 1..4 in 8.0 s, 2 updates skipped (steps 2, 4), loss")


def test_loss_png_marks_where_the_run_resumed(tmp_path):
    """Two launches, the second resumed from step 3's checkpoint: a dashed line at step 3."""
    metrics = MetricsFile(tmp_path, resumed_step=0)
    for step in range(1, 6):
        metrics.write(report(step))
    metrics.close()
    for resumed in (None, tmp_path / "checkpoints" / "step_0000003"):
        launch = rundir.Launch(resumed, None, 0, 1, "cpu")
        rundir.record_launch(tmp_path, "{}\n", launch, None)
    assert resume_steps(tmp_path) == [3]
    figure = loss_figure(tmp_path)
    vertical = [line for line in figure.axes[0].lines if list(line.get_xdata()) == [3, 3]]
    assert len(vertical) == 1 and vertical[0].get_label() == "resumed"
    assert plot_losses(tmp_path).read_bytes()[:4] == b"\x89PNG"
