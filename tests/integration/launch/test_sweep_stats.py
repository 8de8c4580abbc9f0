"""Seed statistics of a real sweep (lmsys/sweep/stats.py): `lmsys-train -m optim=adamw,muon
trainer.seed=1,2` in one process, its end-of-sweep summary asked for a baseline through the
Hydra callback, then `python -m lmsys.sweep summarize --baseline` again: groups.csv holds one row
per optimizer (n=2) with mean, std and ci95 of each metric, and muon's paired per-seed
differences from adamw, as computed here from summary.csv's per-job values."""

from __future__ import annotations

import csv
import math
import statistics
import sys

import pytest

from tests.integration.launch.conftest import MAX_STEPS, run

pytestmark = pytest.mark.slow


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_sweep_groups_seeds_and_compares_with_a_baseline(tiny, tmp_path):
    sweep_dir = tmp_path / "seeds"
    command = [sys.executable, "-m", "lmsys.train", "-m", *tiny, "trainer.micro_batch_size=8"]
    command += [
        "optim=adamw,muon",
        "trainer.seed=1,2",
        f"hydra.sweep.dir={sweep_dir}",
        'hydra.callbacks.sweep_summary.baseline="optim=adamw"',
    ]
    proc = run(command, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "lmsys-sweep: 2 configuration(s)" in proc.stdout
    jobs = read_csv(sweep_dir / "summary.csv")
    assert [(j["optim.name"], j["trainer.seed"]) for j in jobs] == [
        ("adamw", "1"), ("adamw", "2"), ("muon", "1"), ("muon", "2")
    ]  # fmt: skip
    assert all(j["status"] == "completed" and int(j["steps"]) == MAX_STEPS for j in jobs)
    groups = read_csv(sweep_dir / "groups.csv")
    assert [(g["optim.name"], g["n"], g["seeds"]) for g in groups] == [
        ("adamw", "2", "1 2"),
        ("muon", "2", "1 2"),
    ]
    for g in groups:
        for metric in ("final_val_loss", "best_val_loss", "final_loss", "tokens_per_s"):
            values = [float(j[metric]) for j in jobs if j["optim.name"] == g["optim.name"]]
            assert values[0] != values[1]  # the seeds differ
            assert float(g[f"{metric}_mean"]) == pytest.approx(statistics.mean(values), rel=1e-9)
            assert float(g[f"{metric}_std"]) == pytest.approx(statistics.stdev(values), rel=1e-9)
            half = 12.706204736 * statistics.stdev(values) / math.sqrt(2)  # t(0.975, 1 df)
            assert float(g[f"{metric}_ci95"]) == pytest.approx(half, rel=1e-8)
    adamw, muon = groups
    assert adamw["delta_final_val_loss_mean"] == "" and muon["pairs"] == "2"
    by = {(j["optim.name"], j["trainer.seed"]): float(j["final_val_loss"]) for j in jobs}
    diffs = [by["muon", s] - by["adamw", s] for s in ("1", "2")]
    assert float(muon["delta_final_val_loss_mean"]) == pytest.approx(statistics.mean(diffs), rel=1e-9)
    t = statistics.mean(diffs) / (statistics.stdev(diffs) / math.sqrt(2))
    p = 1 - 2 * math.atan(abs(t)) / math.pi  # Student t with 1 degree of freedom is Cauchy
    assert float(muon["delta_final_val_loss_p"]) == pytest.approx(p, rel=1e-9)
    assert "val last - optim=adamw" in proc.stdout and "(baseline)" in proc.stdout
    assert (sweep_dir / "losses.png").read_bytes()[:4] == b"\x89PNG"

    again = run(
        [sys.executable, "-m", "lmsys.sweep", "summarize", str(sweep_dir), "--baseline", "optim=adamw"]
    )
    assert again.returncode == 0, again.stderr
    assert read_csv(sweep_dir / "groups.csv") == groups
    wrong = run([sys.executable, "-m", "lmsys.sweep", "summarize", str(sweep_dir), "--baseline", "optim=sgd"])
    assert wrong.returncode == 2
    assert (
        wrong.stderr.strip() == "lmsys-sweep: error: no sweep job has optim.name=sgd (the baseline optim=sgd)"
    )
