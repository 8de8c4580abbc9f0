"""SLURM for real, on a one-machine cluster started by the test (tests/integration/launch/slurm_cluster.py):
launch/slurm.sbatch trains with 2 ranks; SIGUSR1 makes the ranks save their step and the script
requeue the job, which resumes from that step to the uninterrupted run's losses; a node count
that does not match the allocation fails with one line; with SWEEP_DIR the script runs a
launch.sweep that, preempted, requeues and finishes its jobs; a Hydra sweep through
hydra-submitit-launcher (hydra/launcher=slurm) runs 2 tiny jobs of 2 SLURM tasks (2 ranks) each
as SLURM jobs and summarizes them.

Marked `slurm` (deselect with -m "not slurm"); skipped, with the reason printed, only where SLURM
cannot be installed."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from tests.integration.launch.conftest import (
    REPO_ROOT,
    assert_trained,
    child_env,
    free_port,
    losses,
    run,
    run_meta,
)
from tests.integration.launch.test_sweep import wandb_groups

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SBATCH = REPO_ROOT / "launch" / "slurm.sbatch"


def job_output(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else f"(no {path})"


def wait_until(what: str, check, timeout_s: float, context) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{context()}")
        time.sleep(0.2)


def test_sbatch_preempted_saves_its_step_and_requeues(slurm, tiny, one_node, tmp_path):
    """`sbatch --ntasks=2 launch/slurm.sbatch` trains 2 ranks through a c10d rendezvous on the
    allocation's node. SIGUSR1 to the batch script (what --signal=B:USR1@120 sends before the time
    limit) during training: the script passes it to the job step, every rank finishes its step,
    saves it and exits 75, and the script requeues the job, which starts again with the same job
    id and run directory and resumes from exactly that step (none lost, none redone): the losses
    are those of the uninterrupted run."""
    run_dir = tmp_path / "run"
    # a free rendezvous port: the script's default (from the job id) may be taken on a shared machine
    env = child_env(
        PYTHON=sys.executable, RUN_DIR=str(run_dir), RDZV_TIMEOUT="120", RDZV_PORT=str(free_port())
    )
    job = slurm.sbatch(
        ["--ntasks=2", "--time=30", f"--output={tmp_path}/slurm-%j.out", f"--chdir={REPO_ROOT}"],
        SBATCH,
        [*tiny, "debug.step_delay_s=1"],  # a second between steps: the signal comes mid-run
        env,
    )
    log_path = tmp_path / f"slurm-{job}.out"

    def context() -> str:
        return f"{slurm.job(job)}\n{job_output(log_path)}\n{slurm.tail()}"

    wait_until("step 2", lambda: 2 in losses(run_dir), 300, context)
    slurm.signal_batch(job, "USR1")
    wait_until("the job requeued", lambda: slurm.job(job).get("JobState") == "PENDING", 300, context)
    first_allocation = sorted(losses(run_dir))
    slurm.start_now(job)
    info = slurm.wait(job, 400)
    log = job_output(log_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", context()
    assert info["Requeue"] == "1"  # #SBATCH --requeue
    assert f"lmsys-slurm: job {job} restart 0: 1 node(s) x 2 process(es) (CPU: tasks per node)" in log
    assert "(this node hosts the store)" in log  # c10d rendezvous on the allocation's first node
    assert "lmsys-slurm: SIGUSR1: the ranks save their current step and stop" in log, log
    saved = re.search(r"lmsys-train: preempted \(SIGUSR1\): saving step (\d+) \.\.\. saved ", log)
    assert saved is not None, log
    step = int(saved.group(1))
    assert first_allocation == list(range(1, step + 1))  # every step it made is in the checkpoint
    assert 2 <= step < 6
    assert f"requeueing job {job} (newest checkpoint step_{step:07d})" in log, log
    assert f"lmsys-slurm: job {job} restart 1:" in log, log
    launches = run_meta(run_dir)["launches"]
    assert len(launches) == 2 and launches[0]["resumed_from"] is None, launches
    assert launches[1]["resumed_from"].endswith(f"step_{step:07d}"), launches
    got = assert_trained(run_dir, world_size=2)
    for s in range(1, 7):
        assert got[s] == pytest.approx(one_node[s], rel=1e-5), (got, one_node)


def test_sbatch_sweep_continues_after_a_requeue(slurm, tiny, one_node, tmp_path):
    """SWEEP_DIR=<dir>: the script runs launch.sweep, 2 jobs of 2 ranks. SIGUSR1 during job 0: job
    0 saves its step, the sweep marks it preempted and exits 75, the script requeues; the requeued
    job runs the same sweep, which resumes job 0 from that step (to the uninterrupted losses) and
    then runs job 1."""
    sweep_dir = tmp_path / "sweep"
    env = child_env(
        PYTHON=sys.executable, SWEEP_DIR=str(sweep_dir), RDZV_TIMEOUT="120", RDZV_PORT=str(free_port())
    )
    job = slurm.sbatch(
        ["--ntasks=2", "--time=30", f"--output={tmp_path}/slurm-%j.out", f"--chdir={REPO_ROOT}"],
        SBATCH,
        [*tiny, "optim.lr=3e-3,1e-3", "debug.step_delay_s=1"],
        env,
    )
    log_path = tmp_path / f"slurm-{job}.out"

    def context() -> str:
        return f"{slurm.job(job)}\n{job_output(log_path)}\n{slurm.tail()}"

    wait_until("job 0 at step 2", lambda: 2 in losses(sweep_dir / "0"), 300, context)
    slurm.signal_batch(job, "USR1")
    wait_until("the job requeued", lambda: slurm.job(job).get("JobState") == "PENDING", 300, context)
    jobs = json.loads((sweep_dir / "sweep.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["preempted", "pending"], jobs
    slurm.start_now(job)
    info = slurm.wait(job, 500)
    log = job_output(log_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", context()
    assert f"lmsys-slurm: job {job} restart 0: 1 node(s) x 2 process(es) (CPU: tasks per node)" in log
    assert "lmsys-sweep: preempted: the running job saved its step; exit 75" in log, log
    assert "requeueing job" in log and "lmsys-sweep: job 2/2 (" in log, log
    jobs = json.loads((sweep_dir / "sweep.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "completed"], jobs
    launches = run_meta(sweep_dir / "0")["launches"]
    assert len(launches) == 2 and launches[1]["resumed_from"] is not None, launches
    got = assert_trained(sweep_dir / "0", world_size=2)
    for s in range(1, 7):
        assert got[s] == pytest.approx(one_node[s], rel=1e-5), (got, one_node)
    assert_trained(sweep_dir / "1", world_size=2)


def test_sbatch_node_count_mismatch_is_one_error_line(slurm, tmp_path):
    env = child_env(PYTHON=sys.executable, NNODES="2", RUN_DIR=str(tmp_path / "never"))
    job = slurm.sbatch(
        ["--nodes=1", f"--output={tmp_path}/slurm-%j.out", f"--chdir={REPO_ROOT}"], SBATCH, [], env
    )
    info = slurm.wait(job, 120)
    log = job_output(tmp_path / f"slurm-{job}.out")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", f"{info}\n{log}"
    errors = [ln for ln in log.splitlines() if "error" in ln]
    assert len(errors) == 1 and errors[0].startswith("lmsys-slurm: error: NNODES=2 but job"), log
    assert not (tmp_path / "never").exists()


def test_hydra_submitit_sweep_on_slurm(slurm, tiny, one_node, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")
    sweep_dir = tmp_path / "slurm-sweep"
    command = [
        sys.executable,
        "-m",
        "lmsys.train",
        "-m",
        "hydra/launcher=slurm",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    # 2 tasks per job: each task is a rank (lmsys.sweep.submitit_distributed_env); 2 CPUs, so the
    # jobs run one after the other.
    command += ["hydra.launcher.timeout_min=10", "hydra.launcher.tasks_per_node=2"]
    command += [*tiny, "logger=wandb_offline"]
    proc = run([*command, "optim.lr=3e-3,1e-3"], timeout=500, env=slurm.env(child_env()))
    logs = "\n".join(f"--- {p}\n{job_output(p)[-2000:]}" for p in sorted(sweep_dir.glob(".submitit/*/*.out")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    for num in (0, 1):
        assert_trained(sweep_dir / str(num), world_size=2, proc=proc)
        assert wandb_groups(sweep_dir / str(num)) == ["slurm-sweep"]
    # one SLURM job (array task) per sweep job, each with 2 tasks
    assert sorted(p.name for p in sweep_dir.glob(".submitit/*/*_result.pkl"))[-1].endswith("_1_1_result.pkl")
    assert len({p.parent.name for p in sweep_dir.glob(".submitit/*/*_result.pkl")}) == 2
    # job 0 is the reference config (optim.lr=3e-3, 2 ranks): the same losses
    got = losses(sweep_dir / "0")
    assert got == pytest.approx(one_node, rel=1e-5), (got, one_node)
    assert "lmsys-sweep: 2 job(s)" in proc.stdout
    assert (sweep_dir / "summary.csv").is_file() and (sweep_dir / "losses.png").is_file()
