"""The run directory: every file a training run leaves on disk is named here and nowhere else, and
the records of its metrics.jsonl are defined, written and read back here.

    runs/<model.name>-<YYYYmmdd-HHMMSS>/      trainer.run_dir
      config.yaml          the resolved config of the latest launch
      run.json             creation time and every launch (resumed from, restarts, world size, device)
      deepspeed.json       the DeepSpeed JSON the engine was built with
      engine_stats.json    what each rank holds (optimizer state, master weights, parameters) and
                           its measured peak (lmsys.training.peak_memory)
      metrics.jsonl        one record per line: {"kind": KIND, "step": N, <its fields>} (`Record`)
      loss.png             train and validation loss against the step
      checkpoints/         lmsys.engine.checkpoint's format
      diagnostics/         what a run writes when it goes wrong:
        hang.txt, hang-rank-<K>.txt     a stuck rank: the line and each rank's stacks (watchdog)
        nonfinite-step-<N>.json         a step gone non-finite, replayed (lmsys.training.health)
        divergence-step-<N>.json        a step whose loss diverged, replayed
        skipped-data.json               the data a rewind never trains on again
      wandb/               the W&B run files (offline runs are synced from here)
      export/              lmsys-export's default output; eval.png: lmsys-eval run='s plot

Light on purpose (json and yaml only, no torch): the launchers and the sweep summaries read run
directories too.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, TypeVar

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
DIAGNOSTICS = "diagnostics"
HANG_LINE_FILE = "hang.txt"
HANG_STACKS_FILES = "hang-rank-*.txt"
SKIPPED_DATA_FILE = "skipped-data.json"
BAD_STEP_REPORTS = {"non-finite": "nonfinite", "diverging": "divergence"}  # a bad step's kind -> its file


# ----------------------------------------------------------------------------- the files of diagnostics/


def diagnostics_dir(run_dir: Path) -> Path:
    return run_dir / DIAGNOSTICS


def hang_line_file(run_dir: Path) -> Path:
    """The stuck-rank line of a job the watchdog ended."""
    return run_dir / DIAGNOSTICS / HANG_LINE_FILE


def hang_stacks_file(run_dir: Path, rank: int) -> Path:
    """Rank `rank`'s Python stacks when the watchdog saw no progress."""
    return run_dir / DIAGNOSTICS / HANG_STACKS_FILES.replace("*", str(rank))


def bad_step_report_file(run_dir: Path, kind: str, step: int) -> Path:
    """The report of step `step` gone wrong; kind: non-finite | diverging."""
    return run_dir / DIAGNOSTICS / f"{BAD_STEP_REPORTS[kind]}-step-{step}.json"


def skipped_data_file(run_dir: Path) -> Path:
    return run_dir / DIAGNOSTICS / SKIPPED_DATA_FILE


def _skipped_data(run_dir: Path) -> list[dict[str, Any]]:
    path = skipped_data_file(run_dir)
    if not path.exists():
        return []
    return list(json.loads(path.read_text(encoding="utf-8"))["skipped"])


def skipped_data_steps(run_dir: Path) -> list[int]:
    """The stream steps (lmsys.data.loader) a run never trains on: those its rewinds skipped."""
    return [int(entry["data_step"]) for entry in _skipped_data(run_dir)]


def add_skipped_data(run_dir: Path, step: int, data_step: int, rewound_to: int, report: Path) -> None:
    """Append a rewind's entry to skipped-data.json: step `step` (stream step `data_step`) is never
    trained on again; the run went back to the checkpoint of `rewound_to`; `report`: the bad
    step's report."""
    entries = _skipped_data(run_dir)
    entries.append({"step": step, "data_step": data_step, "rewound_to": rewound_to, "report": report.name})
    atomic_write_text(skipped_data_file(run_dir), json.dumps({"skipped": entries}, indent=1) + "\n")


# ----------------------------------------------------------------------------- metrics.jsonl's records

# A field whose metadata holds JSON_NAME is written under that name (`async` is a Python keyword);
# one marked OMIT_UNSET is left out of its line while it holds its default.
JSON_NAME = "json_name"
OMIT_UNSET = {"omit_unset": True}


@dataclass(frozen=True)
class Record:
    """One line of metrics.jsonl. A field missing from a line (a file older than the field) reads
    as None; a float that is not finite is written as null."""

    KIND: ClassVar[str] = ""
    step: int

    def fields(self) -> dict[str, Any]:
        """The record's fields under their JSON names, `kind` and `step` left out."""
        out = {}
        for f in dataclasses.fields(self)[1:]:
            value = getattr(self, f.name)
            if f.metadata.get("omit_unset") and value == f.default:
                continue
            out[f.metadata.get(JSON_NAME, f.name)] = value
        return out

    def line(self) -> str:
        row = {"kind": self.KIND, "step": self.step, **self.fields()}
        return json.dumps({k: _finite_or_none(v) for k, v in row.items()})

    @classmethod
    def from_row(cls: type[R], row: dict[str, Any]) -> R | None:
        """The record of a parsed line of this kind, or None when its step is not an integer."""
        if not isinstance(row.get("step"), int):
            return None
        values = {f.name: row.get(f.metadata.get(JSON_NAME, f.name)) for f in dataclasses.fields(cls)}
        for f in dataclasses.fields(cls):
            if values[f.name] is None and f.default is not dataclasses.MISSING:
                values[f.name] = f.default
        return cls(**values)


R = TypeVar("R", bound=Record)


@dataclass(frozen=True)
class TrainRecord(Record):
    """One finished optimizer step (W&B: train/<field>, every logger.log_interval steps)."""

    KIND: ClassVar[str] = "train"
    loss: float | None  # the step's global weighted mean loss
    lr: float
    grad_norm: float | None  # None where the engine does not report it
    tokens_per_s: float
    mfu: float | None  # fraction of the devices' peak; None on CPU (no known peak)
    step_time_s: float  # this step alone
    # wall time since this launch's first step began, logging of earlier steps included:
    # differences give the loop's true per-step cost (tools.bench train)
    elapsed_s: float
    memory_gb: float  # peak memory of this process so far (lmsys.training.peak_memory.memory_gb)
    tokens: int  # tokens trained on so far, this step included
    skipped: bool = False  # the update was skipped (a non-finite loss, a gradient overflow)


@dataclass(frozen=True)
class EvalRecord(Record):
    """A validation (W&B: eval/<field>, always)."""

    KIND: ClassVar[str] = "eval"
    loss: float | None
    ppl: float | None
    seconds: float | None = None  # the evaluation's wall time (the ETA counts the ones to come)

    @classmethod
    def of(cls, step: int, loss: float, seconds: float | None = None) -> EvalRecord:
        return cls(step, loss, math.exp(min(loss, 80.0)), seconds)


@dataclass(frozen=True)
class CheckpointRecord(Record):
    """A committed checkpoint (not sent to W&B)."""

    KIND: ClassVar[str] = "checkpoint"
    path: str
    seconds: float  # = stall_s
    stall_s: float  # the loop's stall
    write_s: float  # writing, checking and committing it (in the background when asynchronous)
    waited_s: float = 0.0  # of the stall, waiting for the previous save to finish
    asynchronous: bool = field(default=False, metadata={JSON_NAME: "async"})


@dataclass(frozen=True)
class MemoryRecord(Record):
    """After the second applied step: every rank's measured peak beside the plan's prediction
    (lmsys.training.peak_memory; not sent to W&B)."""

    KIND: ClassVar[str] = "memory"
    measured_peak_bytes: int  # the largest rank's
    measured_peak_bytes_per_rank: list[int]
    predicted_peak_bytes: int | None  # None without a plan (trainer.plan=off)
    measured_by: str  # cuda_max_allocated (the tensors) | rss (a CPU's peak RSS: a bound)
    measured_includes_diagnosis: bool = field(default=False, metadata=OMIT_UNSET)


RECORDS: dict[str, type[Record]] = {
    r.KIND: r for r in (TrainRecord, EvalRecord, CheckpointRecord, MemoryRecord)
}


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsFile:
    """metrics.jsonl open for appending (rank 0). A resumed run recomputes the steps after its
    checkpoint: their old records (and a line cut by a kill -9) are dropped first."""

    def __init__(self, run_dir: Path, resumed_step: int) -> None:
        self.path = run_dir / METRICS_FILE
        if self.path.exists():
            kept = [r for r in read_jsonl(self.path) if int(r.get("step", 0)) <= resumed_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: Record) -> None:
        self._file.write(record.line() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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


def read_records(run_dir: str | Path, kind: type[R]) -> list[R]:
    """The records of one kind in a run's metrics.jsonl, oldest first."""
    rows = read_jsonl(Path(run_dir) / METRICS_FILE)
    found = (kind.from_row(row) for row in rows if row.get("kind") == kind.KIND)
    return [record for record in found if record is not None]


def read_all_records(run_dir: str | Path) -> list[Record]:
    """Every record of a known kind in a run's metrics.jsonl, oldest first."""
    found = []
    for row in read_jsonl(Path(run_dir) / METRICS_FILE):
        kind = RECORDS.get(str(row.get("kind")))
        record = kind.from_row(row) if kind is not None else None
        if record is not None:
            found.append(record)
    return found


def read_metrics(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The lines of a run's metrics.jsonl as JSON objects, oldest first; only those of `kind` when
    given (the benchmarks read them so)."""
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


@dataclass(frozen=True)
class Launch:
    """One launch of a run, as run.json lists it."""

    resumed_from: Path | None  # the checkpoint it continued
    init_from: Path | None  # the export whose weights it started from (model.init_from)
    torchelastic_restart: int  # torchrun's restarts of the job before this attempt
    world_size: int
    device: str


def record_launch(run_dir: Path, config_yaml: str, launch: Launch, elastic_run_id: str | None) -> None:
    """Create the run directory if needed, write the launch's config.yaml and append the launch
    to run.json (created the first time). `elastic_run_id` (torchrun's run id) lets a restarted
    torchrun job find this directory again."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / CONFIG_FILE, config_yaml)
    meta = read_run_file(run_dir)
    now = datetime.now().isoformat(timespec="seconds")
    meta.setdefault("created", now)
    entry = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(launch).items()}
    meta.setdefault("launches", []).append({"at": now, **entry})
    if elastic_run_id:
        meta["torchelastic_run_id"] = elastic_run_id
    atomic_write_text(run_dir / RUN_FILE, json.dumps(meta, indent=1))


def write_json(run_dir: Path, name: str, data: Any) -> None:
    atomic_write_text(run_dir / name, json.dumps(data, indent=1))


def write_engine_stats(
    run_dir: Path, engine: dict[str, Any], ranks: Sequence[tuple[dict[str, int], int]]
) -> None:
    """engine_stats.json: the engine's settings and, per rank, what it holds (lmsys.engine.zero.
    shard_stats) with its measured peak."""
    rows = [{**held, "measured_peak_bytes": peak} for held, peak in ranks]
    write_json(run_dir, ENGINE_STATS_FILE, {"engine": engine, "ranks": rows})


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
