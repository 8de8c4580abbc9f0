"""The real DeepSpeed checkpoints and training runs the export, generation and evaluation tests
load (tests/integration/export/ds_checkpoints.py writes the checkpoints of ZeRO stages 0-3 on 2
processes and of stages 2-3 on 1 process, each with the engine's own logits on fixed ids; one run
through `torchrun -m lmsys.train` in the main job's shape: 2 processes, ZeRO-2, the tiny preset with
tied embeddings, shrunk; one short run on 1 process). The jobs run side by side, so their start-up
costs overlap, once for every worker of the session (tests/sharing.py); each worker reads its own
copy of what they wrote, since tests write into the runs (an export into the run directory).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures.exports import (
    REPO_ROOT,
    SEQ,
    SHORT_SEQ,
    SMALL,
    TORCHRUN,
    TRAIN_BATCH,
    TRAIN_STEPS,
    child_env,
)
from tests.sharing import made_once

# job name -> (world size, ZeRO stages checkpointed by ds_checkpoints.py, extra overrides)
DS_JOBS = {
    "w2": (2, "0,1,2,3", []),
    "w1": (1, "2,3", []),
    "w2-bf16": (2, "0,1,3", ["deepspeed.precision=bf16"]),  # GPU training's default precision
}
OUTCOMES = "outcomes.json"


@dataclass
class Job:
    name: str
    out: Path  # relative to the jobs' directory
    returncode: int
    stdout: str
    stderr: str

    def wait(self) -> Path:
        assert self.returncode == 0, (
            f"{self.name} failed ({self.returncode}):\n{self.stdout[-3000:]}\n{self.stderr[-5000:]}"
        )
        return self.out


def _torchrun(nproc: int, *args: str) -> subprocess.Popen:
    """torchrun for 2 processes; one process is a plain `python` (lmsys.engine.zero makes a world of
    one itself), which spares the agent's start-up."""
    if nproc == 1:
        command = [sys.executable, *args]
    else:  # --standalone: a c10d rendezvous on a free port chosen by the OS (no port races)
        command = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_jobs(root: Path, data_dir: Path) -> None:
    """Start the DeepSpeed checkpoint writers and the training runs side by side, wait for all,
    and write each one's outcome to root/OUTCOMES."""
    model = [f"model.{o}" for o in SMALL]
    started: dict[str, tuple[str, subprocess.Popen, str]] = {}
    for name, (world, stages, extra) in DS_JOBS.items():
        overrides = [
            *extra,
            *model,
            f"data.seq_len={SEQ}",
            "trainer.micro_batch_size=2",
            f"trainer.global_batch_tokens={4 * SEQ}",
        ]
        script = str(Path(__file__).with_name("ds_checkpoints.py"))
        proc = _torchrun(world, script, str(root / "checkpoints" / name), str(data_dir), stages, *overrides)
        started[name] = (f"ds_checkpoints.py {name} on {world} process(es)", proc, f"checkpoints/{name}")
    run_dir = root / "trained" / "run"
    overrides = [
        "model=tiny", *model, "deepspeed=zero2", f"data.dir={data_dir}", f"trainer.max_steps={TRAIN_STEPS}",
        f"trainer.global_batch_tokens={TRAIN_BATCH * SEQ}", "trainer.micro_batch_size=4",
        "trainer.eval_interval=3", "trainer.eval_batches=2", "trainer.save_interval=3",
        "trainer.progress=false", "trainer.dist_timeout_s=120", "trainer.hang_timeout_s=100",
        "optim.lr=3e-3", "optim.warmup_steps=2", "logger=none", "logger.plot=false",
        f"trainer.run_dir={run_dir}",
    ]  # fmt: skip
    started["train"] = (
        "torchrun -m lmsys.train",
        _torchrun(2, "-m", "lmsys.train", *overrides),
        "trained/run",
    )
    short_dir = root / "trained_short" / "run"
    short = [  # trained at data.seq_len=SHORT_SEQ of model.max_seq_len=SEQ positions (one process)
        "model=tiny", *model, f"data.seq_len={SHORT_SEQ}", f"data.dir={data_dir}", "trainer.max_steps=2",
        f"trainer.global_batch_tokens={4 * SHORT_SEQ}", "trainer.micro_batch_size=4",
        "trainer.eval_interval=2", "trainer.eval_batches=1", "trainer.save_interval=2",
        "trainer.progress=false", "logger=none", "logger.plot=false", f"trainer.run_dir={short_dir}",
    ]  # fmt: skip
    short_proc = _torchrun(1, "-m", "lmsys.train", *short)
    started["short"] = ("python -m lmsys.train (short)", short_proc, "trained_short/run")
    outcomes = {}
    try:
        for name, (label, proc, out) in started.items():
            stdout, stderr = proc.communicate(timeout=600)
            outcomes[name] = [label, out, proc.returncode, stdout, stderr]
    finally:
        for _, proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    (root / OUTCOMES).write_text(json.dumps(outcomes), encoding="utf-8")


@pytest.fixture(scope="session")
def jobs(tmp_path_factory, data_dir) -> dict[str, Job]:
    """The jobs' outcomes, each with its output directory: this worker's copy of everything they
    wrote (job name -> Job)."""
    shared = made_once(tmp_path_factory, "export_jobs", lambda root: _run_jobs(root, data_dir))
    mine = tmp_path_factory.mktemp("export_jobs")
    outcomes = json.loads((shared / OUTCOMES).read_text(encoding="utf-8"))
    for part in ("checkpoints", "trained", "trained_short"):
        if (shared / part).is_dir():
            shutil.copytree(shared / part, mine / part)
    return {
        name: Job(label, mine / out, code, stdout, stderr)
        for name, (label, out, code, stdout, stderr) in outcomes.items()
    }


@pytest.fixture(scope="session")
def ds_checkpoints(jobs) -> Path:
    """Real DeepSpeed checkpoints: <root>/w<world>/zero<stage>/checkpoints/step_0000002 and
    <root>/w<world>/zero<stage>/reference_logits.safetensors (the engine's logits), for world 2
    (stages 0-3) and world 1 (stages 2, 3)."""
    for name in DS_JOBS:
        jobs[name].wait()
    return jobs["w2"].out.parent


@pytest.fixture(scope="session")
def trained_run(jobs) -> Path:
    """A real training run: `torchrun --nproc_per_node=2 -m lmsys.train`, ZeRO-2, the tiny preset
    (tied embeddings) shrunk, 6 steps; checkpoints and validation at steps 3 and 6."""
    return jobs["train"].wait()


@pytest.fixture(scope="session")
def short_run(jobs) -> Path:
    """A real training run (one process, 2 steps, checkpoint at step 2) at data.seq_len=SHORT_SEQ,
    half of its model.max_seq_len=SEQ: positions SHORT_SEQ.. were never trained."""
    return jobs["short"].wait()
