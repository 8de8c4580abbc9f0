"""Reading a sweep back: compare its jobs in a table, a CSV and a plot.

    python -m lmsys.sweep summarize runs/multirun-20250101-120000   # table, summary.csv, losses.png

The summary finds the jobs (sweep.json, else the jobs multirun.yaml's overrides expand to, failed
ones included, else every subdirectory holding a config.yaml or a metrics.jsonl), names each job
by the config values that differ between the jobs, and writes
- a table on stdout: per job its distinguishing values, steps done, training loss first and
  last, last and best validation loss, mean throughput, status; `*` marks the best job (lowest
  last validation loss, else lowest last training loss);
- `summary.csv` in the sweep directory: the same and more (run directory, overrides);
- `losses.png`: the training loss (left) and validation loss (right) of every job against the
  optimizer step, side by side on shared axes; when jobs repeat a configuration with other seeds,
  one mean line per configuration with a band of +-1 standard deviation over its seeds;
- `groups.csv` (lmsys/sweep/stats.py): one row per configuration (the jobs equal in everything
  but trainer.seed) with n and, for the last and best validation loss, the last training loss
  and tokens/s, `<metric>_mean`, `_std` and `_ci95` (Student t); with a baseline
  (`--baseline optim=adamw`) also the paired per-seed differences from it: `delta_<metric>_mean`,
  `_ci95`, `_p` (paired t-test) and `pairs`. The same, shortened, as a second table.
`SummaryCallback` writes it at the end of every `lmsys-train -m` (conf/config.yaml; its baseline:
`'hydra.callbacks.sweep_summary.baseline="optim=adamw"'`).
"""

from __future__ import annotations

import atexit
import csv
import io
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

from lmsys.core.config import compose, config_to_dict, flatten_dict
from lmsys.core.console import warn
from lmsys.core.errors import ConfigError
from lmsys.core.rundir import (
    CONFIG_FILE,
    METRICS_FILE,
    EvalRecord,
    TrainRecord,
    read_all_records,
    read_config,
    read_jsonl,
)
from lmsys.sweep.multirun import (
    JOBS_FILE,
    MULTIRUN_FILE,
    SWEEP_FILE,
    expand_sweep,
    is_hydra_override,
    sweep_name,
)
from lmsys.sweep.stats import Group, Paired, Spread, group_jobs, paired_against
from lmsys.training.plots import plot_sweep, plot_sweep_groups

PROG = "lmsys-sweep"
CSV_FILE = "summary.csv"
GROUPS_FILE = "groups.csv"
PLOT_FILE = "losses.png"
# Values that differ between jobs by construction, never what distinguishes them.
NOT_DISTINGUISHING = ("trainer.run_dir", "logger.group", "logger.tags")
TABLE_KEYS = 4  # distinguishing values shown in the terminal table (the CSV has them all)


# ----------------------------------------------------------------------------- reading a sweep


@dataclass
class Job:
    name: str  # job number (directory name)
    run_dir: Path
    overrides: list[str] = field(default_factory=list)
    returncode: int | None = None  # from sweep.json
    launcher_status: str | None = None  # from sweep.json: completed | failed | interrupted | pending
    seconds: float | None = None
    config: dict[str, Any] = field(default_factory=dict)  # flattened config.yaml
    train: list[tuple[int, float]] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: float | None = None
    train_seconds: float | None = None

    @property
    def max_steps(self) -> int | None:
        value = self.config.get("trainer.max_steps")
        return int(value) if isinstance(value, (int, float)) else None

    @property
    def steps(self) -> int:
        return self.train[-1][0] if self.train else 0

    @property
    def status(self) -> str:
        if self.launcher_status in ("failed", "interrupted", "preempted"):
            code = f" ({self.returncode})" if self.returncode not in (None, 0) else ""
            return f"{self.launcher_status}{code}"
        if self.launcher_status == "pending":
            return "not run"
        if not self.run_dir.is_dir():
            return "failed or not run"
        if not self.train:
            return "no metrics"
        if self.max_steps is not None and self.steps < self.max_steps:
            return "incomplete"
        return "completed"

    def final(self, which: str) -> float | None:
        series = self.train if which == "train" else self.val
        return series[-1][1] if series else None

    def best(self, which: str) -> float | None:
        series = self.train if which == "train" else self.val
        return min(v for _, v in series) if series else None


def _load_job(job: Job) -> Job:
    if (job.run_dir / CONFIG_FILE).is_file():
        job.config = flatten_dict(read_config(job.run_dir) or {})
    elif job.overrides:  # a job that failed before writing its config: compose it from its overrides
        try:
            job.config = flatten_dict(
                config_to_dict(compose([o for o in job.overrides if not is_hydra_override(o)]))
            )
            # as a run's config.yaml records it (the cosine's horizon), or it would show as a difference
            job.config["optim.decay_steps"] = job.config.get("optim.decay_steps") or job.config.get(
                "trainer.max_steps"
            )
        except ConfigError:
            job.config = {}
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    speeds, seconds = [], 0.0
    for record in read_all_records(job.run_dir):
        if not isinstance(record, (TrainRecord, EvalRecord)):
            continue
        if isinstance(record.loss, (int, float)) and math.isfinite(record.loss):
            losses = train if isinstance(record, TrainRecord) else val
            losses[record.step] = float(record.loss)  # a resumed run rewrote its later steps: last one wins
        if isinstance(record, TrainRecord):
            if isinstance(record.tokens_per_s, (int, float)) and record.step > 1:
                speeds.append(float(record.tokens_per_s))
            if isinstance(record.step_time_s, (int, float)):
                seconds += float(record.step_time_s)
    job.train = sorted(train.items())
    job.val = sorted(val.items())
    job.tokens_per_s = sum(speeds) / len(speeds) if speeds else None
    job.train_seconds = seconds or None
    return job


def _job_sort_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def _multirun_jobs(root: Path) -> list[Job]:
    """The jobs of a Hydra multirun (`lmsys-train -m`) from its multirun.yaml, failed ones included
    (their run directory may not exist), in <root>/<job number>; [] when that is not the layout."""
    path = root / MULTIRUN_FILE
    if not path.is_file():
        return []
    try:
        hydra_cfg = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("hydra", {})
        task = list(hydra_cfg["overrides"]["task"])
        subdir = str(hydra_cfg.get("sweep", {}).get("subdir", "."))
        expanded = expand_sweep(task)
    except (yaml.YAMLError, KeyError, TypeError, AttributeError, ConfigError):
        return []
    jobs = [Job(name=str(i), run_dir=root / str(i), overrides=job) for i, job in enumerate(expanded)]
    if subdir not in (".", "") or not any(job.run_dir.is_dir() for job in jobs):
        return []  # job directories elsewhere (a custom subdir, trainer.run_dir given): scan instead
    outcomes = {r.get("num"): r for r in read_jsonl(root / JOBS_FILE)}  # a rerun's line wins
    for i, job in enumerate(jobs):
        if i in outcomes:
            job.launcher_status = outcomes[i].get("status")
            job.returncode = outcomes[i].get("returncode")
            job.seconds = outcomes[i].get("seconds")
    return jobs


def find_jobs(sweep_dir: str | Path) -> list[Job]:
    """The jobs of a sweep directory (see the module docstring), loaded."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ConfigError(f"sweep directory {root} does not exist")
    jobs: list[Job] = []
    index_path = root / SWEEP_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ConfigError(f"{index_path} is not valid JSON ({exc})") from exc
        for entry in index.get("jobs", []):
            run_dir = Path(entry["run_dir"])
            if not run_dir.is_absolute() and not run_dir.exists():
                run_dir = root / run_dir
            jobs.append(
                Job(
                    name=str(entry.get("num", len(jobs))),
                    run_dir=run_dir,
                    overrides=list(entry.get("overrides", [])),
                    returncode=entry.get("returncode"),
                    launcher_status=entry.get("status"),
                    seconds=entry.get("seconds"),
                )
            )
    else:
        jobs = _multirun_jobs(root)
    if not jobs:
        for child in sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: _job_sort_key(p.name)):
            if (child / CONFIG_FILE).is_file() or (child / METRICS_FILE).is_file():
                jobs.append(Job(name=child.name, run_dir=child))
    if not jobs:
        raise ConfigError(
            f"{root} holds no sweep jobs (no {SWEEP_FILE}, no subdirectory with {CONFIG_FILE} "
            f"or {METRICS_FILE})"
        )
    return [_load_job(job) for job in jobs]


def distinguishing_keys(jobs: Sequence[Job]) -> list[str]:
    """Config keys whose values differ between jobs. A group swept as a whole (model=tiny,seed_trax)
    changes many keys under one prefix: when `<prefix>.name` differs, it stands for the prefix."""
    configs = [j.config for j in jobs if j.config]
    if len(configs) < 2:
        return []
    keys: list[str] = []
    for key in configs[0]:
        if key.startswith(NOT_DISTINGUISHING):
            continue
        values = {json.dumps(c.get(key), sort_keys=True, default=str) for c in configs}
        if len(values) > 1:
            keys.append(key)
    extra = sorted({k for c in configs[1:] for k in c} - set(configs[0]))
    keys += [k for k in extra if not k.startswith(NOT_DISTINGUISHING)]
    named = {k.rsplit(".", 1)[0] for k in keys if k.endswith(".name") and "." in k}
    return [k for k in keys if k.endswith(".name") or not any(k.startswith(p + ".") for p in named)]


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            return f"{value:.{digits - 1}g}" if abs(value) < 1e-3 else f"{value:,.0f}"
        return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, list):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    return str(value)


def _best_job(jobs: Sequence[Job]) -> Job | None:
    scored = [(j.final("val"), j) for j in jobs if j.final("val") is not None]
    if not scored:
        scored = [(j.final("train"), j) for j in jobs if j.final("train") is not None]
    return min(scored, key=lambda item: item[0])[1] if scored else None


def rows(jobs: Sequence[Job], keys: Sequence[str]) -> list[dict[str, Any]]:
    """One dict per job: the CSV's columns."""
    out = []
    for job in jobs:
        row: dict[str, Any] = {"job": job.name}
        row.update({key: job.config.get(key) for key in keys})
        row.update(
            {
                "status": job.status,
                "steps": job.steps,
                "max_steps": job.max_steps,
                "first_loss": job.train[0][1] if job.train else None,
                "final_loss": job.final("train"),
                "min_loss": job.best("train"),
                "final_val_loss": job.final("val"),
                "best_val_loss": job.best("val"),
                "tokens_per_s": job.tokens_per_s,
                "train_seconds": job.train_seconds,
                "wall_seconds": job.seconds,
                "run_dir": str(job.run_dir),
                "overrides": " ".join(job.overrides),
            }
        )
        out.append(row)
    return out


def format_table(jobs: Sequence[Job], keys: Sequence[str]) -> str:
    best = _best_job(jobs)
    shown = list(keys[:TABLE_KEYS])
    header = ["job", *shown, "steps", "loss first->last", "val last", "val best", "tok/s", "status"]
    lines = []
    for job in jobs:
        first = job.train[0][1] if job.train else None
        lines.append(
            [
                job.name + (" *" if job is best else ""),
                *(_fmt(job.config.get(k)) for k in shown),
                f"{job.steps}/{job.max_steps}" if job.max_steps else str(job.steps),
                f"{_fmt(first)} -> {_fmt(job.final('train'))}",
                _fmt(job.final("val")),
                _fmt(job.best("val")),
                _fmt(job.tokens_per_s) if job.tokens_per_s is None else f"{job.tokens_per_s:,.0f}",
                job.status,
            ]
        )
    text = _aligned(header, lines)
    if len(keys) > len(shown):
        text.write(f"(and {len(keys) - len(shown)} more differing values in {CSV_FILE})\n")
    return text.getvalue()


def write_csv(path: Path, table: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in table:
        columns += [c for c in row if c not in columns]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in table:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})


def job_label(job: Job, keys: Sequence[str]) -> str:
    parts = [f"{k}={_fmt(job.config.get(k))}" for k in keys[:TABLE_KEYS]]
    return f"{job.name}: " + " ".join(parts) if parts else job.name


# ----------------------------------------------------------------------------- seed statistics

# groups.csv's metrics: name -> the value of one job
GROUP_METRICS: dict[str, Any] = {
    "final_val_loss": lambda job: job.final("val"),
    "best_val_loss": lambda job: job.best("val"),
    "final_loss": lambda job: job.final("train"),
    "tokens_per_s": lambda job: job.tokens_per_s,
}


def group_rows(groups: Sequence[Group], paired: dict[str, dict[int, Paired]]) -> list[dict[str, Any]]:
    """groups.csv: one row per configuration. `paired`: metric -> group index -> differences."""
    out = []
    for index, group in enumerate(groups):
        row: dict[str, Any] = {"group": group.label, **group.values, "n": len(group.jobs)}
        row["seeds"] = " ".join(str(j.config.get("trainer.seed")) for j in group.jobs)
        for name, metric in GROUP_METRICS.items():
            spread = Spread.of([metric(job) for job in group.jobs])
            row.update({f"{name}_mean": spread.mean, f"{name}_std": spread.std, f"{name}_ci95": spread.ci95})
        for name, by_group in paired.items():
            if index in by_group:
                diff = by_group[index]
                row.update(
                    {
                        f"delta_{name}_mean": diff.mean,
                        f"delta_{name}_ci95": diff.ci95,
                        f"delta_{name}_p": diff.p_value,
                        "pairs": diff.pairs,
                    }
                )
        out.append(row)
    return out


def _pm(mean: float | None, ci: float | None) -> str:
    return "-" if mean is None else _fmt(mean) + ("" if ci is None else f" +-{_fmt(ci)}")


def format_groups(table: list[dict[str, Any]], baseline: str | None) -> str:
    """The configurations: n, mean +- ci95 of the losses, and the difference from the baseline."""
    header = ["configuration", "n", "val last", "val best", "loss last", "tok/s"]
    if baseline:
        header += [f"val last - {baseline}", "p"]
    lines = []
    for row in table:
        line = [row["group"], str(row["n"])]
        line += [
            _pm(row[f"{m}_mean"], row[f"{m}_ci95"]) for m in ("final_val_loss", "best_val_loss", "final_loss")
        ]
        line.append("-" if row["tokens_per_s_mean"] is None else f"{row['tokens_per_s_mean']:,.0f}")
        if baseline:
            if "delta_final_val_loss_mean" in row:
                p = row["delta_final_val_loss_p"]
                line += [
                    _pm(row["delta_final_val_loss_mean"], row["delta_final_val_loss_ci95"]),
                    "-" if p is None else f"{p:.3g}",
                ]
            else:
                line += ["(baseline)", ""]
        lines.append(line)
    text = _aligned(header, lines)
    text.write("(mean +-95% confidence half-width over seeds, Student t")
    text.write("; differences paired by trainer.seed, two-sided paired t-test)\n" if baseline else ")\n")
    return text.getvalue()


@dataclass
class Summary:
    jobs: list[Job]
    keys: list[str]
    table: str
    csv_path: Path
    plot_path: Path | None
    groups_path: Path | None = None
    groups: list[dict[str, Any]] = field(default_factory=list)


def summarize(
    sweep_dir: str | Path, plot_png: bool = True, out: Any = None, baseline: str | None = None
) -> Summary:
    """Read a sweep directory, print the tables, write summary.csv, groups.csv and losses.png
    into it. `baseline`: KEY=VALUE of the group the others are compared with, seed by seed
    (ConfigError when no job matches it)."""
    root = Path(sweep_dir)
    jobs = find_jobs(root)
    keys = distinguishing_keys(jobs)
    table = format_table(jobs, keys)
    csv_path = root / CSV_FILE
    write_csv(csv_path, rows(jobs, keys))
    groups = group_jobs(jobs, keys)
    paired: dict[str, dict[int, Paired]] = {}
    if baseline:
        try:
            paired = {
                name: paired_against(groups, baseline, metric) for name, metric in GROUP_METRICS.items()
            }
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    grouped = group_rows(groups, paired)
    groups_path = root / GROUPS_FILE
    write_csv(groups_path, grouped)
    repeated = any(len(g.jobs) > 1 for g in groups)
    plot_path = None
    if plot_png and repeated:
        plot_path = plot_sweep_groups(groups, root / PLOT_FILE, f"sweep {sweep_name(root)}")
    elif plot_png:
        labels = [job_label(job, keys) for job in jobs]
        plot_path = plot_sweep(jobs, labels, root / PLOT_FILE, f"sweep {sweep_name(root)}")
    stream = sys.stdout if out is None else out
    stream.write(f"{PROG}: {len(jobs)} job(s) in {root}\n{table}")
    if repeated or baseline:
        stream.write(f"{PROG}: {len(groups)} configuration(s)\n{format_groups(grouped, baseline)}")
    written = [str(csv_path), str(groups_path), *([str(plot_path)] if plot_path else [])]
    stream.write(f"{PROG}: wrote {', '.join(written)}\n")
    stream.flush()
    return Summary(jobs, keys, table, csv_path, plot_path, groups_path, grouped)


# ----------------------------------------------------------------------------- at the end of a multirun


class SummaryCallback(Callback):
    """Hydra callback (conf/config.yaml, hydra.callbacks): summarize a multirun when it ends.

    Runs in the process that launched the sweep (for submitit: the submitting one, after every
    job finished); under torchrun only rank 0 writes. Never fails the sweep. When a job failed,
    Hydra raises at the end of the sweep instead of calling on_multirun_end: the summary is then
    written on the way out (atexit), after Hydra's report, with the failed jobs marked."""

    def __init__(self, baseline: str | None = None) -> None:
        self._sweep_dir: Path | None = None
        self._baseline = baseline  # KEY=VALUE: the group the others are compared with

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        if os.environ.get("RANK", "0") != "0":
            return
        self._sweep_dir = Path(str(config.hydra.sweep.dir))
        atexit.register(self._summarize)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        self._summarize()

    def _summarize(self) -> None:
        sweep_dir, self._sweep_dir = self._sweep_dir, None  # once
        if sweep_dir is None:
            return
        try:
            summarize(sweep_dir, baseline=self._baseline)
        except Exception as exc:  # a summary is a courtesy: it never fails the sweep
            warn(PROG, f"no sweep summary ({type(exc).__name__}: {exc})")


def _aligned(header: list[str], lines: list[list[Any]]) -> io.StringIO:
    """A plain-text table: columns padded to their widest cell, a rule under the header."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *lines)]
    text = io.StringIO()
    for i, line in enumerate([header, *lines]):
        text.write("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() + "\n")
        if i == 0:
            text.write("  ".join("-" * w for w in widths) + "\n")
    return text
