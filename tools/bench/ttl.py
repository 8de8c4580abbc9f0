"""Time to loss: how many steps and seconds optim=muon needs to reach the validation loss that
AdamW reaches after its whole run, per seed, as a mean over seeds with a 95% interval.

    python -m tools.bench ttl                          # default corpus, tiny preset, 300 steps, seeds 1-3
    python -m tools.bench ttl steps=100 seeds=3 set=trainer.global_batch_tokens=4096

One real sweep (`python -m lmsys.train -m optim=adamw,muon trainer.seed=1,...` in one process,
Hydra's multirun, validation every `eval_every` steps) into `sweep_dir`, summarized with AdamW as
the baseline (groups.csv: seed statistics and paired differences). Then, for each seed, the
target is that seed's AdamW validation loss after the last step; Muon's steps to it are the
first validation step where Muon's loss is at or below it, its seconds the summed step times
(evaluation excluded) up to that step. Printed: the target, Muon's steps and seconds (mean
+- ci95, Student t over seeds), the ratio against AdamW's steps and seconds for the whole run
(the baseline, measured in the same sweep), and whether the ratio meets `target_ratio`. A seed
whose Muon run never reaches its target counts as not reached (and the ratio is not met).

The default corpus must be prepared first (`python -m lmsys.prepare`, data/default).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from lmsys.cli import Option, parse_options, run_cli
from lmsys.core.errors import DataError
from lmsys.core.rundir import read_metrics
from lmsys.sweep.stats import Spread
from lmsys.sweep.summary import Job, find_jobs

PROG = "tools.bench ttl"

OPTIONS = [
    Option("steps", "int", 300, "steps of every run (AdamW's whole run; Muon's budget)"),
    Option("seeds", "int", 3, "seeds per optimizer (trainer.seed=1..N)"),
    Option("eval_every", "int", 10, "steps between validations (the resolution of Muon's steps)"),
    Option("preset", "str", "tiny", "model preset (conf/model/)"),
    Option("data", "str", "data/default", "prepared data (python -m lmsys.prepare writes data/default)"),
    Option("target_ratio", "float", 0.75, "the goal: Muon's steps / AdamW's steps"),
    Option("sweep_dir", "str", None, "where the sweep goes (default runs/ttl-<time>)"),
    Option("set", "str", None, "a training override for both, e.g. set=optim.warmup_steps=10", repeat=True),
]

SUMMARY = (
    "Time-to-loss benchmark: Muon's steps and seconds to AdamW's final validation loss, per seed,\n"
    "mean and 95% interval over seeds (a real lmsys-train sweep, AdamW as its baseline)."
)


@dataclass(frozen=True)
class Reached:
    seed: int
    target: float  # AdamW's final validation loss for this seed
    step: int | None  # Muon's first validation step at or below it (None: not reached)
    seconds: float | None  # Muon's summed step times up to that step
    adamw_seconds: float  # AdamW's summed step times over the whole run


def step_seconds(job: Job) -> dict[int, float]:
    """Each step's time (metrics.jsonl's step_time_s), by step."""
    return {
        r["step"]: float(r["step_time_s"]) for r in read_metrics(job.run_dir, "train") if "step_time_s" in r
    }


def reached(adamw: Job, muon: Job, seed: int) -> Reached:
    target = adamw.final("val")
    if target is None:
        raise DataError(f"the AdamW run {adamw.run_dir} has no validation loss; see its output")
    step = next((s for s, loss in muon.val if loss <= target), None)
    muon_times = step_seconds(muon)
    seconds = None if step is None else sum(t for s, t in muon_times.items() if s <= step)
    return Reached(seed, target, step, seconds, sum(step_seconds(adamw).values()))


def run_sweep(opts: dict[str, Any], sweep_dir: Path) -> None:
    seeds = ",".join(str(s) for s in range(1, opts["seeds"] + 1))
    command = [
        sys.executable, "-m", "lmsys.train", "-m",
        f"model={opts['preset']}", f"data.dir={opts['data']}", f"trainer.max_steps={opts['steps']}",
        f"trainer.eval_interval={opts['eval_every']}", f"trainer.save_interval={opts['steps']}",
        "trainer.progress=false", "logger=none", *opts["set"],
        "optim=adamw,muon", f"trainer.seed={seeds}", f"hydra.sweep.dir={sweep_dir}",
        'hydra.callbacks.sweep_summary.baseline="optim=adamw"',
    ]  # fmt: skip
    print(f"{PROG}: {' '.join(command[1:])}", flush=True)
    proc = subprocess.run(command)
    if proc.returncode != 0:
        raise DataError(f"the sweep failed (exit {proc.returncode}); its jobs are in {sweep_dir}")


def _pm(spread: Spread, digits: int = 1) -> str:
    if spread.mean is None:
        return "-"
    return f"{spread.mean:.{digits}f}" + ("" if spread.ci95 is None else f" +-{spread.ci95:.{digits}f}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts = parse_options(PROG, argv, OPTIONS, SUMMARY)
        if opts is None:
            return 0
        if not (Path(opts["data"]) / "manifest.json").is_file():
            raise DataError(f"no prepared data in {opts['data']}; run `python -m lmsys.prepare` first")
        sweep_dir = Path(opts["sweep_dir"] or f"runs/ttl-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
        if not (sweep_dir / "multirun.yaml").is_file():
            run_sweep(opts, sweep_dir)
        jobs = find_jobs(sweep_dir)
        by = {(j.config.get("optim.name"), j.config.get("trainer.seed")): j for j in jobs}
        results = [
            reached(by["adamw", seed], by["muon", seed], seed)
            for seed in range(1, opts["seeds"] + 1)
            if ("adamw", seed) in by and ("muon", seed) in by
        ]
        if not results:
            raise DataError(f"{sweep_dir} holds no adamw/muon pair of runs")
        steps = opts["steps"]
        hit = [r for r in results if r.step is not None]
        step_spread = Spread.of([r.step for r in hit])
        second_spread = Spread.of([r.seconds for r in hit])
        adamw_seconds = Spread.of([r.adamw_seconds for r in results])
        print(f"time to loss, {opts['preset']} on {opts['data']}, {len(results)} seed(s), sweep {sweep_dir}")
        for r in results:
            got = "not reached" if r.step is None else f"step {r.step} ({r.seconds:.1f} s)"
            print(
                f"  seed {r.seed}: AdamW val loss after {steps} steps {r.target:.4f}; "
                f"Muon reaches it at {got}"
            )
        print(f"  AdamW    {steps} steps, {_pm(adamw_seconds)} s (baseline)")
        print(f"  Muon     {_pm(step_spread)} steps, {_pm(second_spread)} s (mean +-ci95 over seeds)")
        all_hit = len(hit) == len(results) and step_spread.mean is not None
        ratio = step_spread.mean / steps if all_hit and step_spread.mean is not None else None
        time_ratio = (
            second_spread.mean / adamw_seconds.mean
            if all_hit and second_spread.mean is not None and adamw_seconds.mean
            else None
        )
        if ratio is None or time_ratio is None:
            print(f"  ratio    - (Muon did not reach AdamW's loss for {len(results) - len(hit)} seed(s))")
            return 1
        verdict = "met" if ratio <= opts["target_ratio"] else "NOT met"
        print(
            f"  ratio    {ratio:.2f}x the steps, {time_ratio:.2f}x the seconds "
            f"(target <= {opts['target_ratio']}x steps: {verdict})"
        )
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
