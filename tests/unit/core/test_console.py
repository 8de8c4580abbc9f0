"""What a training run prints, from the Console (lmsys/core/console.py) in this process: plain
progress lines every console interval, the bar in a terminal (forced, since a test has no tty),
lines when progress is off, how durations read, the done line's count of skipped updates and
loss.png's mark where a run resumed. The real CLI's output:
tests/integration/training/test_console.py."""

from __future__ import annotations

import re
from dataclasses import replace

from lmsys.core import rundir
from lmsys.core.console import Console, duration
from lmsys.core.rundir import EvalRecord, MetricsFile, TrainRecord
from lmsys.training.plots import loss_figure, plot_losses, resume_steps
from lmsys.training.reporter import Reporter


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


STEP_LINE = re.compile(
    r"^lmsys-train: step (\d+)/(\d+) \| loss [\d.]+ \| lr [\d.e+-]+ \| grad norm [\d.e+-]+ \| "
    r"[\d,]+ tok/s \| elapsed \d+s(?: \| ETA \d+s)?$"
)


def report(step: int, initial: int = 0) -> TrainRecord:
    """Step `step` of a launch that began after step `initial`, 2 s per step."""
    return TrainRecord(step, 2.5, 1e-3, 0.75, 1234.0, None, 2.0, 2.0 * (step - initial), 0.5, 256 * step)
