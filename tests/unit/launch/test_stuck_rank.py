"""The verdict on a stuck job (launch/stuck.py): the ranks that are late and the ones that answer
nothing, named. Real jobs with a frozen and an asleep rank: tests/integration/launch/test_stuck_rank.py."""

from __future__ import annotations

from lmsys.training.watchdog import Position, decide, describe


def test_the_verdict_names_the_late_and_the_silent_ranks():
    waiting = Position(30, 57, None, "loss all-reduce")
    positions = {0: waiting, 1: Position(20, 57, 1, "forward"), 2: waiting}
    verdict = decide(positions, world_size=4)
    assert (verdict.behind, verdict.silent, verdict.waiting) == ([1, 3], [3], [0, 2])
    assert describe(verdict, 300, "runs/x/diagnostics/hang-rank-*.txt") == (
        "ranks 1,3 did not reach step 57's loss all-reduce (mark #30) within 300 s: rank 1 is at step 57's "
        "forward of micro-batch 1 (mark #20), rank 3 did not answer: stopped or dead; ranks 0,2 wait there; "
        "stacks in runs/x/diagnostics/hang-rank-*.txt"
    )
    assert decide({0: waiting, 1: waiting}, world_size=2).behind == []  # all wait alike: nobody to blame
