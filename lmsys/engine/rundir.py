"""The run directory: what a training run leaves on disk, and the one reader of each file.

    runs/<model.name>-<YYYYmmdd-HHMMSS>/      trainer.run_dir
      config.yaml          the resolved config of the latest launch
      run.json             creation time and every launch (resumed from, restarts, world size, device)
      deepspeed.json       the DeepSpeed JSON the engine was built with
      engine_stats.json    what each rank holds (optimizer state, master weights, parameters)
      metrics.jsonl        one JSON record per line: {"kind": "train" | "eval", "step": N, ...}
      loss.png             train and validation loss against the step
      checkpoints/         lmsys.engine.checkpoint's format
      wandb/               the W&B run files (offline runs are synced from here)
      export/              lmsys-export's default output; eval.png: lmsys-eval run='s plot

Light on purpose (json and yaml only, no torch): the sweep summaries read run directories too.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from lmsys.core.files import atomic_write_text

RUNS_ROOT = Path("runs")  # where runs without trainer.run_dir go, relative to the working directory
CONFIG_FILE = "config.yaml"
RUN_FILE = "run.json"
DEEPSPEED_FILE = "deepspeed.json"
ENGINE_STATS_FILE = "engine_stats.json"
METRICS_FILE = "metrics.jsonl"
LOSS_PLOT_FILE = "loss.png"
EVAL_PLOT_FILE = "eval.png"
CHECKPOINTS = "checkpoints"
WANDB_DIR = "wandb"
EXPORT_DIR = "export"
DIAGNOSTICS = "diagnostics"  # what a run writes when it goes wrong (hang-rank-<K>.txt, ...)


# ----------------------------------------------------------------------------- reading


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file, in order; a line cut by a kill -9 (or not an object) is
    skipped, a missing file is empty."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl, oldest first; only those of `kind` when given."""
    records = read_jsonl(Path(run_dir) / METRICS_FILE)
    return [r for r in records if kind is None or r.get("kind") == kind]


def read_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The resolved config a run was launched with (config.yaml), or None when it has none or
    the file does not parse."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def read_run_file(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ----------------------------------------------------------------------------- writing


def record_launch(
    run_dir: Path, config_yaml: str, launch: dict[str, Any], elastic_run_id: str | None
) -> None:
    """Create the run directory if needed, write the launch's config.yaml and append the launch
    to run.json (created the first time). `elastic_run_id` (torchrun's run id) lets a restarted
    torchrun job find this directory again."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / CONFIG_FILE, config_yaml)
    meta = read_run_file(run_dir)
    now = datetime.now().isoformat(timespec="seconds")
    meta.setdefault("created", now)
    meta.setdefault("launches", []).append({"at": now, **launch})
    if elastic_run_id:
        meta["torchelastic_run_id"] = elastic_run_id
    atomic_write_text(run_dir / RUN_FILE, json.dumps(meta, indent=1))


def write_json(run_dir: Path, name: str, data: Any) -> None:
    atomic_write_text(run_dir / name, json.dumps(data, indent=1))


# ----------------------------------------------------------------------------- finding runs


def new_run_dir(model_name: str, root: Path = RUNS_ROOT) -> Path:
    """runs/<model_name>-<timestamp>, with -1, -2, ... when that name is taken."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = root / f"{model_name}-{stamp}"
    n = 1
    while path.exists():
        path = root / f"{model_name}-{stamp}-{n}"
        n += 1
    return path


def find_restarted_run(model_name: str, elastic_run_id: str, root: Path = RUNS_ROOT) -> Path | None:
    """The directory that the first attempt of torchrun job `elastic_run_id` created (the newest
    run.json naming it), so a restarted job continues its own run instead of starting a new one."""
    candidates = []
    for run_file in root.glob(f"{model_name}-*/{RUN_FILE}"):
        if read_run_file(run_file.parent).get("torchelastic_run_id") == elastic_run_id:
            candidates.append((run_file.stat().st_mtime, run_file.parent))
    return max(candidates)[1] if candidates else None


def run_dir_of(tag_dir: Path) -> Path | None:
    """The run directory holding checkpoint directory `tag_dir` (<run>/checkpoints/<tag>), or None
    for a checkpoint that lives elsewhere."""
    return tag_dir.parent.parent if tag_dir.parent.name == CHECKPOINTS else None
