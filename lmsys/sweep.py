"""lmsys-sweep: compare the jobs of a sweep, and the glue between Hydra multiruns and the trainer.

    python -m lmsys.sweep summarize runs/sweep-20250101-120000   # table, summary.csv, losses.png
    lmsys-train -m optim.lr=1e-3,3e-4 model=tiny,seed_trax          # Hydra multirun, summarized at the end
    python -m launch.sweep --nproc 2 -- optim.lr=1e-3,3e-4 model=tiny  # each job a torchrun launch

A sweep directory holds one run directory per job, `<sweep_dir>/<job number>/` (the trainer's
usual run directory: config.yaml, metrics.jsonl, wandb/, checkpoints/), plus `sweep.json` when
launch/sweep.py ran it (each job's overrides, exit status and duration) or `multirun.yaml` when
Hydra did. Every job logs to its own W&B run, grouped under the sweep's name (logger.group).

The summary finds the jobs (sweep.json, else the jobs multirun.yaml's overrides expand to, failed
ones included, else every subdirectory holding a config.yaml or a metrics.jsonl), names each job
by the config values that differ between the jobs, and writes
- a table on stdout: per job its distinguishing values, steps done, training loss first and
  last, last and best validation loss, mean throughput, status; `*` marks the best job (lowest
  last validation loss, else lowest last training loss);
- `summary.csv` in the sweep directory: the same and more (run directory, overrides);
- `losses.png`: the training loss (left) and validation loss (right) of every job against the
  optimizer step, side by side on shared axes.

This module also expands sweep overrides exactly as Hydra's BasicSweeper does (`expand_sweep`)
and checks every job's config and batch arithmetic before anything runs (`check_multirun`), and
gives Hydra multirun jobs their run directory, W&B group and, for multi-task SLURM jobs, their
torch.distributed world (`multirun_defaults`, `submitit_distributed_env`, `SummaryCallback`).
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

from lmsys.config import CONF_DIR, ConfigError

PROG = "lmsys-sweep"
SWEEP_FILE = "sweep.json"
CSV_FILE = "summary.csv"
PLOT_FILE = "losses.png"
METRICS_FILE = "metrics.jsonl"  # lmsys.metrics.METRICS_FILE (not imported: it pulls in torch)
CONFIG_FILE = "config.yaml"
MULTIRUN_FILE = "multirun.yaml"  # what Hydra writes into a multirun's sweep directory
# Values that differ between jobs by construction, never what distinguishes them.
NOT_DISTINGUISHING = ("trainer.run_dir", "logger.group", "logger.tags")
TABLE_KEYS = 4  # distinguishing values shown in the terminal table (the CSV has them all)


# ----------------------------------------------------------------------------- sweep expansion


def _one_line(exc: BaseException) -> str:
    from lmsys.config import _one_line as config_one_line

    return config_one_line(exc)


def _overrides_parser() -> Any:
    """Hydra's override parser, with a config loader so `glob(...)` over config groups works."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.utils import create_config_search_path

        loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF_DIR)))
        return OverridesParser.create(config_loader=loader)
    except Exception:  # pragma: no cover - Hydra internals moved: plain lists still work
        return OverridesParser.create()


def expand_sweep(overrides: Sequence[str]) -> list[list[str]]:
    """Every job of a sweep, as Hydra's BasicSweeper enumerates them (the cartesian product of the
    comma lists / range() / glob() values, in command-line order). ConfigError on a syntax error."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    try:
        parsed = _overrides_parser().parse_overrides(list(overrides))
        batches = BasicSweeper.split_arguments(parsed, None)
    except Exception as exc:  # OverrideParseException, HydraException (unsupported sweep kinds)
        raise ConfigError(_one_line(exc)) from exc
    return [list(job) for job in batches[0]] if batches else [[]]


def swept_keys(overrides: Sequence[str]) -> list[str]:
    """The keys that take several values in a sweep (e.g. ['optim.lr', 'model'])."""
    try:
        parsed = _overrides_parser().parse_overrides(list(overrides))
    except Exception as exc:
        raise ConfigError(_one_line(exc)) from exc
    return [o.get_key_element() for o in parsed if o.is_sweep_override()]


def _is_hydra_override(override: str) -> bool:
    key = override.lstrip("+~").split("=", 1)[0]
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _job_label(job: Sequence[str], jobs: Sequence[Sequence[str]]) -> str:
    """The overrides that set this job apart (the swept values), else all of them."""
    differing = [o for i, o in enumerate(job) if any(len(j) <= i or j[i] != o for j in jobs)]
    return " ".join(differing or job)


def check_jobs(jobs: Sequence[Sequence[str]], world_size: int | None = None, remote: bool = False) -> None:
    """Everything about each job of a sweep that can be checked before the first one starts, so a
    mistake is one ConfigError naming the first bad job instead of N failed jobs: its config
    composes (keys, values); with `world_size`, its batch arithmetic divides for that many ranks;
    its model fits its prepared data (vocabulary). `remote`: the jobs run on other machines
    (SLURM), so a data directory missing here is left for the job to find."""
    from lmsys.config import compose

    def bad(number: int, exc: Exception) -> ConfigError:
        return ConfigError(f"sweep job {number} ({_job_label(jobs[number], jobs)}): {exc}")

    configs = []
    for number, job in enumerate(jobs):
        try:
            configs.append(compose([o for o in job if not _is_hydra_override(o)]))
        except ConfigError as exc:
            raise bad(number, exc) from exc
    # These import torch: only once every config composed, so a misspelled key is reported at once.
    from lmsys.corpus import DataError
    from lmsys.data import PreparedData
    from lmsys.engine import batch_plan

    if world_size is not None:  # every job's batch before any data: it needs no files
        for number, cfg in enumerate(configs):
            try:
                batch_plan(cfg, world_size)
            except ConfigError as exc:
                raise bad(number, exc) from exc
    data: dict[str, PreparedData | None] = {}
    for number, cfg in enumerate(configs):
        try:
            if cfg.data.dir not in data:
                here = not remote or Path(cfg.data.dir).exists()
                data[cfg.data.dir] = PreparedData(cfg.data.dir) if here else None
            prepared = data[cfg.data.dir]
            if prepared is not None:
                prepared.check_model(cfg.model)
        except DataError as exc:
            raise bad(number, exc) from exc


# Hydra's command-line flags that take a value (the value is not an override).
_FLAGS_WITH_VALUE = {
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--experimental-rerun",
}


def multirun_world_size(overrides: Sequence[str], env: dict[str, str] | None = None) -> int | None:
    """Ranks per job of `lmsys-train -m`: Hydra's default launcher runs the jobs in this process
    (WORLD_SIZE under torchrun, else 1); hydra/launcher=slurm gives each job tasks_per_node x nodes
    ranks. None when it cannot be known (another launcher, a value that is not a number)."""
    env = dict(os.environ) if env is None else env
    values = dict(o.lstrip("+").partition("=")[::2] for o in overrides)
    launcher = values.get("hydra/launcher")
    try:
        if launcher is None:
            return int(env.get("WORLD_SIZE") or 1)
        if launcher == "slurm":
            tasks = int(values.get("hydra.launcher.tasks_per_node", 1))
            return tasks * int(values.get("hydra.launcher.nodes", 1))
    except ValueError:
        return None
    return None


def check_multirun(argv: Sequence[str]) -> None:
    """For `lmsys-train -m ...`: expand the sweep and compose every job (and check its batch
    arithmetic when the ranks per job are known); ConfigError (one line) on an unknown key or an
    invalid value. Flags such as -m or --config-dir (and its value) are skipped."""
    overrides: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg.startswith("-"):
            skip_next = arg in _FLAGS_WITH_VALUE
        else:
            overrides.append(arg)
    launchers = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("hydra/launcher=")]
    remote = any(name != "basic" for name in launchers)  # e.g. slurm: the jobs run elsewhere
    check_jobs(expand_sweep(overrides), multirun_world_size(overrides), remote=remote)


# ----------------------------------------------------------------------------- Hydra multirun glue


def sweep_name(sweep_dir: str | Path) -> str:
    """The W&B group of a sweep: its directory's name."""
    return Path(sweep_dir).resolve().name.lstrip(".") or "sweep"


def multirun_defaults(cfg: Any) -> None:
    """In a Hydra multirun job (`lmsys-train -m`, any Hydra launcher): unless given, trainer.run_dir
    becomes the job's directory and logger.group the sweep's name. The job's directory is
    <hydra.sweep.dir>/<job number>, or Hydra's own job directory when hydra.sweep.subdir is set to
    something other than conf/config.yaml's "." (which keeps Hydra from creating anything per job).
    Does nothing in a plain run. `cfg` is the task's DictConfig, changed in place."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict, read_write

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return
    submitit_distributed_env()
    with read_write(cfg), open_dict(cfg):
        if cfg.trainer.get("run_dir") is None:
            subdir = str(hc.sweep.subdir) if hc.sweep.subdir is not None else "."
            job_dir = Path(hc.sweep.dir) / str(hc.job.num) if subdir in ("", ".") else hc.runtime.output_dir
            cfg.trainer.run_dir = str(job_dir)
        if cfg.logger.get("group") is None:
            cfg.logger.group = sweep_name(hc.sweep.dir)


SWEEP_DIR_KEY = "lmsys/sweep_dir"  # in torchrun's store: the sweep directory the ranks agreed on


def default_sweep_dir() -> str:
    """conf/config.yaml's hydra.sweep.dir with its `${now:FORMAT}` resolved to this moment."""
    import re
    from datetime import datetime

    import yaml

    pattern = str(yaml.safe_load((CONF_DIR / "config.yaml").read_text())["hydra"]["sweep"]["dir"])
    now = datetime.now()
    return re.sub(r"\$\{now:([^}]*)\}", lambda m: now.strftime(m.group(1)), pattern)


def shared_sweep_dir(argv: Sequence[str], timeout_s: float = 300.0) -> list[str]:
    """`lmsys-train -m` under torchrun: every rank runs Hydra's multirun, and each would resolve
    the default hydra.sweep.dir's `${now:...}` on its own, a second apart at times, so the ranks
    would write to different sweep directories. Here the ranks agree on one through torchrun's
    own store (the first rank to ask sets it; the store lives as long as the launcher, so an
    elastic restart finds the same directory and its jobs resume from their checkpoints), and
    it is appended to argv as hydra.sweep.dir. argv comes back as it is when hydra.sweep.dir is
    given, or when not under torchrun (no agent store to agree through)."""
    argv = list(argv)
    given = any(a.split("=", 1)[0].lstrip("+~") == "hydra.sweep.dir" for a in argv)
    if given or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return argv
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    agreed = store.compare_set(SWEEP_DIR_KEY, "", default_sweep_dir()).decode()
    return [*argv, f"hydra.sweep.dir={agreed}"]


def submitit_distributed_env() -> bool:
    """In a hydra/launcher=slurm job of several SLURM tasks (hydra.launcher.tasks_per_node=8, nodes=N)
    every task runs the training function: export torch.distributed's env:// variables (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from the SLURM job, as torchrun would, so the
    tasks form one world. A job of one task, or not under submitit, is left alone. True if exported."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return False
    if "RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun inside the job
        return False
    from submitit.helpers import TorchDistributedEnvironment

    # Every task keeps all the node's GPUs visible: the trainer picks cuda:<LOCAL_RANK> itself.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return True


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - Hydra < 1.1
    _HydraCallback = object  # type: ignore[assignment,misc]


class SummaryCallback(_HydraCallback):  # type: ignore[misc,valid-type]
    """Hydra callback (conf/config.yaml, hydra.callbacks): summarize a multirun when it ends.

    Runs in the process that launched the sweep (for submitit: the submitting one, after every
    job finished); under torchrun only rank 0 writes. Never fails the sweep. When a job failed,
    Hydra raises at the end of the sweep instead of calling on_multirun_end: the summary is then
    written on the way out (atexit), after Hydra's report, with the failed jobs marked."""

    def __init__(self) -> None:
        self._sweep_dir: Path | None = None

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
            summarize(sweep_dir)
        except Exception as exc:
            print(
                f"{PROG}: warning: no sweep summary ({type(exc).__name__}: {exc})",
                file=sys.stderr,
                flush=True,
            )


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
        if self.launcher_status in ("failed", "interrupted"):
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


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    out[prefix[:-1]] = data
    return out


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut by a kill
            continue
    return records


def _load_job(job: Job) -> Job:
    import yaml

    config_path = job.run_dir / CONFIG_FILE
    if config_path.is_file():
        try:
            job.config = _flatten(yaml.safe_load(config_path.read_text(encoding="utf-8")) or {})
        except yaml.YAMLError:
            job.config = {}
    elif job.overrides:  # a job that failed before writing its config: compose it from its overrides
        from lmsys.config import compose, config_to_dict

        try:
            job.config = _flatten(
                config_to_dict(compose([o for o in job.overrides if not _is_hydra_override(o)]))
            )
        except ConfigError:
            job.config = {}
    by_step: dict[str, dict[int, float]] = {"train": {}, "eval": {}}
    speeds, seconds = [], 0.0
    for record in _read_metrics(job.run_dir):
        kind, step, loss = record.get("kind"), record.get("step"), record.get("loss")
        if kind not in by_step or not isinstance(step, int):
            continue
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            by_step[kind][step] = float(loss)  # a resumed run rewrote its later steps: last one wins
        if kind == "train":
            if isinstance(record.get("tokens_per_s"), (int, float)) and step > 1:
                speeds.append(float(record["tokens_per_s"]))
            if isinstance(record.get("step_time_s"), (int, float)):
                seconds += float(record["step_time_s"])
    job.train = sorted(by_step["train"].items())
    job.val = sorted(by_step["eval"].items())
    job.tokens_per_s = sum(speeds) / len(speeds) if speeds else None
    job.train_seconds = seconds or None
    return job


def _job_sort_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def _multirun_jobs(root: Path) -> list[Job]:
    """The jobs of a Hydra multirun (`lmsys-train -m`) from its multirun.yaml, failed ones included
    (their run directory may not exist), in <root>/<job number>; [] when that is not the layout."""
    import yaml

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
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *lines)]
    text = io.StringIO()
    for i, line in enumerate([header, *lines]):
        text.write("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() + "\n")
        if i == 0:
            text.write("  ".join("-" * w for w in widths) + "\n")
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


def plot(jobs: Sequence[Job], keys: Sequence[str], path: Path, title: str) -> Path | None:
    """losses.png: training loss (left) and validation loss (right), every job on shared axes."""
    if not any(j.train or j.val for j in jobs):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, job in enumerate(jobs):
        color = colors[i % len(colors)]
        label = job_label(job, keys)
        if job.train:
            axes[0].plot(*zip(*job.train), color=color, lw=1.2, label=label)
        if job.val:
            axes[1].plot(*zip(*job.val), "o-", color=color, lw=1.2, ms=3, label=label)
    for ax, name in zip(axes, ("training loss", "validation loss")):
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cross-entropy (nats/token)")
    if not any(j.val for j in jobs):
        axes[1].text(0.5, 0.5, "no validation yet", ha="center", va="center", transform=axes[1].transAxes)
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="lower center", ncol=min(3, max(1, len(labels))), fontsize=8, frameon=False
    )
    fig.suptitle(title)
    rows_of_legend = math.ceil(len(labels) / 3) if labels else 0
    fig.tight_layout(rect=(0, min(0.4, 0.06 * rows_of_legend + 0.02), 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


@dataclass
class Summary:
    jobs: list[Job]
    keys: list[str]
    table: str
    csv_path: Path
    plot_path: Path | None


def summarize(sweep_dir: str | Path, plot_png: bool = True, out: Any = None) -> Summary:
    """Read a sweep directory, print the table, write summary.csv and losses.png into it."""
    root = Path(sweep_dir)
    jobs = find_jobs(root)
    keys = distinguishing_keys(jobs)
    table = format_table(jobs, keys)
    csv_path = root / CSV_FILE
    write_csv(csv_path, rows(jobs, keys))
    plot_path = plot(jobs, keys, root / PLOT_FILE, f"sweep {sweep_name(root)}") if plot_png else None
    stream = sys.stdout if out is None else out
    stream.write(f"{PROG}: {len(jobs)} job(s) in {root}\n{table}")
    stream.write(f"{PROG}: wrote {csv_path}" + (f" and {plot_path}" if plot_path else "") + "\n")
    stream.flush()
    return Summary(jobs, keys, table, csv_path, plot_path)


# ----------------------------------------------------------------------------- command line


USAGE = f"""usage: python -m lmsys.sweep summarize SWEEP_DIR [--no-plot]

Compare the jobs of a sweep directory: a table here, {CSV_FILE} and {PLOT_FILE} in SWEEP_DIR."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command != "summarize":
        print(f"{PROG}: error: unknown command {command!r}; the command is: summarize", file=sys.stderr)
        return 2
    no_plot = "--no-plot" in rest
    dirs = [a for a in rest if a != "--no-plot"]
    if len(dirs) != 1 or dirs[0].startswith("-"):
        print(f"{PROG}: error: summarize takes one sweep directory\n{USAGE}", file=sys.stderr)
        return 2
    try:
        summarize(dirs[0], plot_png=not no_plot)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
