"""What a training run prints, from the Console (lmsys/core/console.py) in this process: plain
progress lines every console interval, the bar in a terminal (forced, since a test has no tty),
lines when progress is off, and how durations read. The real CLI's output:
tests/integration/training/test_console.py."""

from __future__ import annotations

import re

from lmsys.core.console import Console, duration
from lmsys.core.rundir import EvalRecord, TrainRecord


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


STEP_LINE = re.compile(
    r"^lmsys-train: step (\d+)/(\d+) \| loss [\d.]+ \| lr [\d.e+-]+ \| grad norm [\d.e+-]+ \| "
    r"[\d,]+ tok/s \| elapsed \d+s(?: \| ETA \d+s)?$"
)


def report(step: int, initial: int = 0) -> TrainRecord:
    """Step `step` of a launch that began after step `initial`, 2 s per step."""
    return TrainRecord(step, 2.5, 1e-3, 0.75, 1234.0, None, 2.0, 2.0 * (step - initial), 0.5, 256 * step)
