"""The ETA of the step lines counts the evaluations still to come: the training pace is measured
without the evaluations done so far, and each evaluation to come costs the last one's time (before
the first, the plan's estimate when there is one)."""

from __future__ import annotations

import re

from lmsys.core.console import Console, evaluations_after
from lmsys.core.rundir import EvalRecord, TrainRecord

STEP_S = 1.0  # each training step
EVAL_S = 10.0  # each evaluation


def train_record(step: int, elapsed_s: float) -> TrainRecord:
    return TrainRecord(step, 2.5, 1e-3, 0.75, 1234.0, None, STEP_S, elapsed_s, 0.5, 256 * step)


def eta_of(line: str) -> str:
    match = re.search(r"\| ETA (\S+)$", line)
    assert match, line
    return match.group(1)


def run_lines(capsys, estimate: float | None) -> list[str]:
    """Steps 1..10 of 1 s with an evaluation of 10 s after steps 5 and 10; every step's line."""
    console = Console("lmsys-train", progress=False, interval=1, terminal=False)
    console.eval_interval, console.evaluation_estimate_s = 5, estimate
    elapsed = 0.0
    with console.progress(total=10, initial=0):
        for step in range(1, 11):
            elapsed += STEP_S
            console.step_done(train_record(step, elapsed))
            if step % 5 == 0:
                console.eval_done(EvalRecord.of(step, 2.0, EVAL_S), 2.5, "all 8 val sequences")
                elapsed += EVAL_S
    return capsys.readouterr().out.splitlines()


def test_the_eta_counts_the_evaluations_to_come(capsys):
    lines = run_lines(capsys, estimate=None)
    step_lines = [line for line in lines if "/10 |" in line]
    # before any evaluation is timed (no estimate): the 9 steps to go
    assert eta_of(step_lines[0]) == "9s"
    # after step 5's evaluation: 4 steps at 1 s (its 10 s not taken for training) + one evaluation
    assert eta_of(step_lines[5]) == "14s", step_lines[5]  # was 16 / 6 * 4 = 11s without evaluations
    (eval_line,) = [line for line in lines if "val loss" in line and "step 5:" in line]
    assert eta_of(eval_line) == "15s"  # 5 steps and step 10's evaluation


def test_the_plans_estimate_counts_before_the_first_evaluation(capsys):
    step_lines = [line for line in run_lines(capsys, estimate=12.0) if "/10 |" in line]
    assert eta_of(step_lines[0]) == "33s"  # 9 steps + 2 evaluations of 12 s
    assert eta_of(step_lines[5]) == "14s"  # measured from then on


def test_evaluations_after_a_step():
    assert evaluations_after(0, 10, 5) == 2
    assert evaluations_after(0, 12, 5) == 3  # 5, 10 and the last step
    assert evaluations_after(5, 12, 5) == 2
    assert evaluations_after(10, 12, 5) == 1
    assert evaluations_after(11, 12, 5) == 1
    assert evaluations_after(4, 5, 5) == 1
