"""Running sweeps: Hydra's sweep expansion, the checks before any job starts, and the glue
between Hydra multiruns (any launcher, torchrun, SLURM via submitit) and the trainer.

    lmsys-train -m optim.lr=1e-3,3e-4 model=tiny,seed_trax          # Hydra multirun, summarized at the end
    python -m launch.sweep --nproc 2 -- optim.lr=1e-3,3e-4 model=tiny  # each job a torchrun launch

A sweep directory holds one run directory per job, `<sweep_dir>/<job number>/` (the trainer's
usual run directory), plus `sweep.json` when launch/sweep.py ran it (each job's overrides, exit
status and duration) or `multirun.yaml` when Hydra did. Every job logs to its own W&B run,
grouped under the sweep's name (logger.group). Reading it back: lmsys/sweep/summary.py.

`expand_sweep` enumerates jobs exactly as Hydra's BasicSweeper does, `check_multirun` composes
every job's config and checks its batch arithmetic before anything runs, `multirun_defaults`
gives each Hydra multirun job its run directory and W&B group, `shared_sweep_dir` makes the
ranks of a torchrun launch agree on one sweep directory, and `submitit_distributed_env` forms
one torch.distributed world from a multi-task SLURM job.

No torch at import: launch/sweep.py and `lmsys-train -m` report a mistake before torch loads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import open_dict, read_write

from lmsys.core.config import CONF_DIR, ROOT_CONFIG, compose, config_to_dict, flatten_dict, hydra_error_line
from lmsys.core.errors import ConfigError, DataError
from lmsys.sweep.stats import check_baseline

SWEEP_FILE = "sweep.json"
BASELINE_KEY = "hydra.callbacks.sweep_summary.baseline"  # `lmsys-train -m`'s --baseline
MULTIRUN_FILE = "multirun.yaml"  # what Hydra writes into a multirun's sweep directory
JOBS_FILE = "jobs.jsonl"  # `lmsys-train -m`: each job's outcome, a line per job as it ends


# ----------------------------------------------------------------------------- sweep expansion


def _overrides_parser() -> Any:
    """Hydra's override parser, with a config loader so `glob(...)` over config groups works."""
    try:
        # Hydra's internals: guarded, so a Hydra that moved them still parses plain lists.
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.utils import create_config_search_path

        loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF_DIR)))
        return OverridesParser.create(config_loader=loader)
    except Exception:  # pragma: no cover - Hydra internals moved: plain lists still work
        return OverridesParser.create()


def expand_sweep(overrides: Sequence[str]) -> list[list[str]]:
    """Every job of a sweep, as Hydra's BasicSweeper enumerates them (the cartesian product of the
    comma lists / range() / glob() values, in command-line order). ConfigError on a syntax error."""
    try:
        parsed = _overrides_parser().parse_overrides(list(overrides))
        batches = BasicSweeper.split_arguments(parsed, None)
    except Exception as exc:  # OverrideParseException, HydraException (unsupported sweep kinds)
        raise ConfigError(hydra_error_line(exc)) from exc
    return [list(job) for job in batches[0]] if batches else [[]]


def swept_keys(overrides: Sequence[str]) -> list[str]:
    """The keys that take several values in a sweep (e.g. ['optim.lr', 'model'])."""
    try:
        parsed = _overrides_parser().parse_overrides(list(overrides))
    except Exception as exc:
        raise ConfigError(hydra_error_line(exc)) from exc
    return [o.get_key_element() for o in parsed if o.is_sweep_override()]


def is_hydra_override(override: str) -> bool:
    key = override.lstrip("+~").split("=", 1)[0]
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _job_label(job: Sequence[str], jobs: Sequence[Sequence[str]]) -> str:
    """The overrides that set this job apart (the swept values), else all of them."""
    differing = [o for i, o in enumerate(job) if any(len(j) <= i or j[i] != o for j in jobs)]
    return " ".join(differing or job)


def check_jobs(
    jobs: Sequence[Sequence[str]],
    world_size: int | None = None,
    remote: bool = False,
    baseline: str | None = None,
) -> None:
    """Everything about each job of a sweep that can be checked before the first one starts, so a
    mistake is one ConfigError naming the first bad job instead of N failed jobs: its config
    composes (keys, values), the summary's `baseline` (KEY=VALUE) is one of the jobs', then the
    trainer's preflight (lmsys.training.preflight: with `world_size`, the batch arithmetic for that
    many ranks; the prepared data against the model and data.seq_len). `remote`: the jobs run on
    other machines (SLURM), so a data directory missing here is left for the job to find."""

    def bad(number: int, exc: Exception) -> ConfigError:
        return ConfigError(f"sweep job {number} ({_job_label(jobs[number], jobs)}): {exc}")

    configs = []
    for number, job in enumerate(jobs):
        try:
            configs.append(compose([o for o in job if not is_hydra_override(o)]))
        except ConfigError as exc:
            raise bad(number, exc) from exc
    if baseline:
        try:
            check_baseline(baseline, [flatten_dict(config_to_dict(cfg)) for cfg in configs])
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    # Imported only now, once every config composed: it imports torch (seconds), and a
    # misspelled key should be reported at once.
    from lmsys.training.preflight import preflight

    # every job's batch arithmetic first (a mistake in the sweep's values), then the data
    for number, cfg in enumerate(configs):
        try:
            preflight(cfg, world_size, data="skip")
        except ConfigError as exc:
            raise bad(number, exc) from exc
    opened: dict[str, Any] = {}  # each data directory is opened once
    for number, cfg in enumerate(configs):
        try:
            preflight(cfg, world_size, data="if_present" if remote else "required", opened=opened)
        except (ConfigError, DataError) as exc:
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
    baselines = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith(f"{BASELINE_KEY}=")]
    baseline = baselines[-1].strip("\"'") if baselines else None
    jobs = expand_sweep([o for o in overrides if not o.lstrip("+").startswith(f"{BASELINE_KEY}=")])
    check_jobs(jobs, multirun_world_size(overrides), remote=remote, baseline=baseline)


# ----------------------------------------------------------------------------- Hydra multirun glue


def in_multirun() -> bool:
    """Whether this process runs a job of a Hydra multirun (`lmsys-train -m`)."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def sweep_name(sweep_dir: str | Path) -> str:
    """The W&B group of a sweep: its directory's name."""
    return Path(sweep_dir).resolve().name.lstrip(".") or "sweep"


def multirun_defaults(cfg: Any) -> None:
    """In a Hydra multirun job (`lmsys-train -m`, any Hydra launcher): unless given, trainer.run_dir
    becomes the job's directory and logger.group the sweep's name. The job's directory is
    <hydra.sweep.dir>/<job number>, or Hydra's own job directory when hydra.sweep.subdir is set to
    something other than conf/config.yaml's "." (which keeps Hydra from creating anything per job).
    Does nothing in a plain run. `cfg` is the task's DictConfig, changed in place."""
    if not in_multirun():
        return
    hc = HydraConfig.get()
    submitit_distributed_env()
    with read_write(cfg), open_dict(cfg):
        if cfg.trainer.get("run_dir") is None:
            subdir = str(hc.sweep.subdir) if hc.sweep.subdir is not None else "."
            job_dir = Path(hc.sweep.dir) / str(hc.job.num) if subdir in ("", ".") else hc.runtime.output_dir
            cfg.trainer.run_dir = str(job_dir)
        if cfg.logger.get("group") is None:
            cfg.logger.group = sweep_name(hc.sweep.dir)


def job_header(cfg: Any) -> str | None:
    """`sweep job 3: optim.lr=1e-3 model=tiny -> <run dir>` in a multirun job (Hydra's own job
    lines are off: conf/config.yaml), None in a plain run. Call after multirun_defaults."""
    if not in_multirun():
        return None
    hc = HydraConfig.get()
    overrides = " ".join(hc.overrides.task) or "(no overrides)"
    return f"sweep job {hc.job.num}: {overrides} -> {cfg.trainer.run_dir}"


def runs_in_process() -> bool:
    """Whether this multirun's jobs run in this process, one after the other (Hydra's basic
    launcher): a failed job can then be reported here in one line and the sweep go on; a remote
    launcher (submitit) learns of a failure only from the exception."""
    target = str(HydraConfig.get().launcher.get("_target_", ""))
    return target.endswith("BasicLauncher")


def record_job(status: str, returncode: int, seconds: float, error: str | None = None) -> None:
    """Append this multirun job's outcome to <sweep dir>/jobs.jsonl (rank 0; the summary reads it:
    status, exit code, wall time)."""
    if os.environ.get("RANK", "0") != "0":
        return
    hc = HydraConfig.get()
    entry = {"num": hc.job.num, "status": status, "returncode": returncode, "seconds": round(seconds, 3)}
    if error is not None:
        entry["error"] = error
    path = Path(hc.sweep.dir) / JOBS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


SWEEP_DIR_KEY = "lmsys/sweep_dir"  # in torchrun's store: the sweep directory the ranks agreed on


def default_sweep_dir() -> str:
    """conf/config.yaml's hydra.sweep.dir with its `${now:FORMAT}` resolved to this moment."""
    pattern = str(yaml.safe_load(ROOT_CONFIG.read_text())["hydra"]["sweep"]["dir"])
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
    from torch.distributed import TCPStore  # under torchrun only: torch is imported there anyway

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
    from submitit.helpers import TorchDistributedEnvironment  # an optional extra, in SLURM jobs only

    # Every task keeps all the node's GPUs visible: the trainer picks cuda:<LOCAL_RANK> itself.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return True
