"""Sweeps for real: a misspelled sweep key is one error line before anything runs,
`python -m launch.sweep` runs every job as its own torchrun launch (own run directory, own W&B run
in the sweep's group) and summarizes; `lmsys-train -m` does the same in one process;
`python -m lmsys.sweep summarize` works on its own. The expansion and the sweep directory:
tests/unit/sweep/test_sweep.py."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmsys.sweep.summary import distinguishing_keys, find_jobs
from tests.integration.launch.conftest import (
    MAX_STEPS,
    REPO_ROOT,
    assert_trained,
    child_env,
    losses,
    one_error_line,
    run,
    run_meta,
)
from tests.unit.sweep.test_sweep import _fake_job


def wandb_groups(run_dir: Path) -> list[str]:
    """The W&B group of every offline run under run_dir/wandb."""
    from tests.wandb_files import wandb_records

    groups = []
    for path in sorted(run_dir.glob("wandb/*run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "run":
                groups.append(record.run.run_group)
                break
    return groups


# ----------------------------------------------------------------------------- expansion and checks


@pytest.mark.parametrize(
    "options, overrides, needle",
    [
        ([], ["optim.lrr=1e-3,3e-4"], "optim.lrr"),
        ([], ["model=tiny,nosuch"], "model/nosuch"),
        ([], ["optim.lr=1e-3,(3"], "Error parsing override"),
        # 1536 tokens / seq 128 = 12 sequences: not a multiple of micro 8 x 2 processes
        (
            ["--nproc", "2"],
            ["trainer.global_batch_tokens=8192,1536"],
            "sweep job 1 (trainer.global_batch_tokens=1536)",
        ),
        (
            ["--nproc", "2"],
            ["data.dir={data}", "model.vocab_size=512,1024"],
            "sweep job 1 (model.vocab_size=1024)",
        ),
        (["--nnodes", "2"], ["optim.lr=1e-3,3e-4"], "need a rendezvous endpoint"),
        # a baseline no job has: found before any job runs, in --dry-run too
        (
            ["--nproc", "1", "--baseline", "optim.lr=0.5"],
            ["data.dir={data}", "model.vocab_size=512", "optim.lr=1e-3,3e-3", "trainer.seed=1,2"],
            "no sweep job has optim.lr=0.5 (the baseline optim.lr=0.5); the jobs have optim.lr=0.001, 0.003",
        ),
        (
            ["--dry-run", "--nproc", "1", "--baseline", "optim=sgd"],
            ["data.dir={data}", "model.vocab_size=512", "optim=adamw,muon", "optim.grad_clip=0"],
            "no sweep job has optim.name=sgd (the baseline optim=sgd); the jobs have optim.name=adamw, muon",
        ),
        (["--dry-run", "--baseline", "adamw"], ["optim.lr=1e-3,3e-4"], "a baseline is KEY=VALUE"),
        (
            ["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"],
            ["optim.lr=1e-3"],
            "needs --sweep-dir",
        ),
    ],
)
def test_launch_sweep_rejects_a_bad_sweep_before_running(
    prepared_data, tmp_path, monkeypatch, capsys, options, overrides, needle
):
    from launch.sweep import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # 2 CPU processes per job by default
    for name in ("NPROC", "NNODES", "NODE_RANK", "MASTER_ADDR", "RDZV_ENDPOINT", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    sweep_dir = tmp_path / "sweep"
    where = [] if "needs --sweep-dir" in needle else ["--sweep-dir", str(sweep_dir)]
    overrides = [o.format(data=prepared_data) for o in overrides]
    assert main([*options, *where, "--", *overrides]) == 2
    assert needle in one_error_line(capsys.readouterr().err, "lmsys-sweep: error:")
    assert not sweep_dir.exists()


def test_launch_sweep_gives_each_multi_node_job_its_rendezvous_id(tiny, tmp_path, capsys):
    """torchrun closes a c10d rendezvous when its run ends: job 1 must not reuse job 0's id."""
    from launch.sweep import main

    options = ["--dry-run", "--nproc", "1", "--nnodes", "2", "--node-rank", "1"]
    options += ["--rdzv-endpoint", "127.0.0.1:29999", "--rdzv-id", "abc", "--sweep-dir", str(tmp_path / "s")]
    assert main([*options, "--", *tiny, "optim.lr=1e-3,3e-4"]) == 0
    commands = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("job ")]
    assert len(commands) == 2
    for num, command in enumerate(commands):
        assert command[command.index("--rdzv-id") + 1] == f"abc-job{num}" and command.count("--rdzv-id") == 1
        assert f"trainer.run_dir={tmp_path / 's' / str(num)}" in command and "logger.group=s" in command


def test_launch_sweep_help_shows_the_overrides_and_counts_jobs_from_one(tiny, tmp_path, capsys):
    """--help shows the `-- sweep overrides` part and examples; jobs are numbered 1/N ... N/N."""
    from launch.sweep import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "usage: python -m launch.sweep [options] [launch.torchrun options] -- sweep overrides"
    )
    assert "  python -m launch.sweep --nproc 2 -- optim.lr=1e-3,3e-4 trainer.max_steps=50" in out
    assert (
        main(["--dry-run", "--nproc", "1", "--sweep-dir", str(tmp_path / "s"), "--", *tiny, "optim.lr=1,2"])
        == 0
    )
    numbers = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("job ")]
    assert numbers == ["job 1/2", "job 2/2"]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["optim.lrr=1e-3,3e-4"], "optim.lrr"),
        # one process per job: 1536 / 128 = 12 sequences do not divide by micro-batches of 8
        (["trainer.global_batch_tokens=8192,1536"], "sweep job 1 (trainer.global_batch_tokens=1536)"),
        (
            ["optim.lr=1e-3,3e-3", 'hydra.callbacks.sweep_summary.baseline="optim.lr=0.01"'],
            "no sweep job has optim.lr=0.01 (the baseline optim.lr=0.01)",
        ),
    ],
)
def test_lmsys_train_multirun_rejects_a_bad_sweep_in_one_line(tmp_path, overrides, needle):
    sweep_dir = tmp_path / "sweep"
    proc = run(
        [sys.executable, "-m", "lmsys.train", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"], timeout=120
    )
    assert proc.returncode == 2
    assert needle in one_error_line(proc.stderr, "lmsys-train: error:")
    assert not sweep_dir.exists()


# ----------------------------------------------------------------------------- the summary alone


def test_summarize_cli_table_csv_and_png(tmp_path):
    root = tmp_path / "sweep-fake"
    _fake_job(root, 0, 1e-3, "tiny", [6.0, 5.5, 5.0, 4.8, 4.6, 4.5], [5.2, 4.7])
    _fake_job(root, 1, 3e-4, "tiny", [6.0, 5.8, 5.6, 5.4, 5.3, 5.2], [5.7, 5.3])
    _fake_job(root, 2, 1e-3, "seed_trax", [6.1, 5.9, 5.7, 5.6], [5.8])  # stopped at step 4
    (root / "10").mkdir()  # not a job: no config.yaml, no metrics.jsonl

    assert distinguishing_keys(find_jobs(root)) == ["model.name", "optim.lr"]
    proc = run([sys.executable, "-m", "lmsys.sweep", "summarize", str(root)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("job"))
    assert "model.name" in header and "optim.lr" in header and "val best" in header
    row0 = next(ln for ln in lines if ln.startswith("0 *"))  # the best: lowest last validation loss
    assert "6/6" in row0 and "completed" in row0 and "4.7000" in row0
    row2 = next(ln for ln in lines if ln.startswith("2 "))
    assert "seed_trax" in row2 and "4/6" in row2 and "incomplete" in row2

    with open(root / "summary.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [r["job"] for r in table] == ["0", "1", "2"]
    assert [float(r["final_loss"]) for r in table] == [4.5, 5.2, 5.6]
    assert table[1]["optim.lr"] == "0.0003" and table[2]["status"] == "incomplete"
    png = (root / "losses.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_summarize_cli_errors_are_one_line(tmp_path):
    proc = run([sys.executable, "-m", "lmsys.sweep", "summarize", str(tmp_path / "missing")], timeout=60)
    assert proc.returncode == 2
    assert "does not exist" in one_error_line(proc.stderr, "lmsys-sweep: error:")
    proc = run([sys.executable, "-m", "lmsys.sweep", "summarize", str(tmp_path)], timeout=60)
    assert proc.returncode == 2
    assert "holds no sweep jobs" in one_error_line(proc.stderr, "lmsys-sweep: error:")


# ----------------------------------------------------------------------------- real sweeps


def preempt_during_first_job(command: list[str], sweep_dir: Path) -> int:
    """Start the sweep, send it SIGUSR1 (what SLURM sends before a time limit) once job 0 has
    logged a step; returns the step job 0 stopped after. The sweep must exit 75."""
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while not losses(sweep_dir / "0") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, out[-3000:] + err[-3000:]
    assert "lmsys-sweep: preempted: the running job saved its step; exit 75" in err
    jobs = json.loads((sweep_dir / "sweep.json").read_text())["jobs"]
    assert [(j["status"], j.get("returncode")) for j in jobs] == [("preempted", 75), ("pending", None)]
    return max(losses(sweep_dir / "0"))


@pytest.mark.slow
def test_launch_sweep_runs_each_job_as_a_two_process_torchrun(tiny, one_node, tmp_path):
    """Each job a 2-rank torchrun launch; preempted during job 0 (SIGUSR1), the sweep exits 75 and
    the same command again (what a requeued SLURM job runs) resumes job 0 from the step it saved,
    to the uninterrupted losses, then runs job 1."""
    sweep_dir = tmp_path / "lr-sweep"
    command = [sys.executable, "-m", "launch.sweep", "--nproc", "2", "--sweep-dir", str(sweep_dir), "--"]
    overrides = [*tiny, "logger=wandb_offline", "optim.lr=3e-3,1e-3", "debug.step_delay_s=0.5"]
    stopped = preempt_during_first_job([*command, *overrides], sweep_dir)
    proc = run([*command, *overrides], timeout=400, env=child_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    launches = run_meta(sweep_dir / "0")["launches"]
    assert len(launches) == 2 and launches[1]["resumed_from"].endswith(f"step_{stopped:07d}"), launches
    assert losses(sweep_dir / "0") == pytest.approx(one_node, rel=1e-5)  # job 0 is the reference config

    index = json.loads((sweep_dir / "sweep.json").read_text())
    assert [j["status"] for j in index["jobs"]] == ["completed", "completed"]
    lrs = [next(o for o in j["overrides"] if o.startswith("optim.lr=")) for j in index["jobs"]]
    assert lrs == ["optim.lr=0.003", "optim.lr=0.001"]  # the sweep's values replace TINY's
    curves = []
    for num in (0, 1):
        run_dir = sweep_dir / str(num)
        curves.append(assert_trained(run_dir, world_size=2, proc=proc))
        assert wandb_groups(run_dir) == ["lr-sweep"] * (2 if num == 0 else 1)  # an attempt per launch
    assert curves[0][MAX_STEPS] != curves[1][MAX_STEPS]  # two different learning rates

    assert "optim.lr" in proc.stdout and "completed" in proc.stdout  # the table
    with open(sweep_dir / "summary.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [float(r["optim.lr"]) for r in table] == [3e-3, 1e-3]
    assert [float(r["final_loss"]) for r in table] == pytest.approx([c[MAX_STEPS] for c in curves])
    assert (sweep_dir / "losses.png").read_bytes()[:4] == b"\x89PNG"

    # The same command again finishes what is left: here nothing, without starting a job.
    again = run([*command, *overrides], timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("already completed, skipped") == 2
    assert len(run_meta(sweep_dir / "0")["launches"]) == 2
    # jobs are counted from 1 (the run directories keep Hydra's numbers from 0)
    assert f"lmsys-sweep: job 1/2 ({sweep_dir / '0'}): " in proc.stdout, proc.stdout
    assert f"lmsys-sweep: job 2/2 ({sweep_dir / '1'}): " in proc.stdout and "job 0/" not in proc.stdout


@pytest.mark.slow
def test_lmsys_train_multirun_gives_each_job_its_run_dir_and_group(tiny, tmp_path):
    """`lmsys-train -m`: Hydra's BasicLauncher runs the jobs in this one process, one after the
    other; each lands in <hydra.sweep.dir>/<job number> in the sweep's W&B group. Jobs 1 and 3
    fail (no such checkpoint), each in one line: the others still run, the exit status is the
    failed jobs' (2), and the summary at the end lists all four."""
    sweep_dir = tmp_path / "sweep-inprocess"
    command = [
        sys.executable,
        "-m",
        "lmsys.train",
        "-m",
        *tiny,
        "trainer.micro_batch_size=8",
        "logger=wandb_offline",
    ]
    command += [
        "optim.lr=3e-3,1e-3",
        "trainer.resume=auto,/nonexistent/step_0000001",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = run(command, timeout=400)
    assert proc.returncode == 2, proc.stdout[-4000:] + proc.stderr[-4000:]  # the first failed job's
    assert (
        "sweep job 1 failed (exit 2): trainer.resume=/nonexistent/step_0000001 is not a checkpoint"
        in proc.stderr
    )
    for num in (0, 2):
        run_dir = sweep_dir / str(num)
        assert_trained(run_dir, world_size=1, proc=proc)
        assert wandb_groups(run_dir) == ["sweep-inprocess"]
    assert losses(sweep_dir / "0") != losses(sweep_dir / "2")
    assert not (sweep_dir / "1").exists() and not (sweep_dir / "3").exists()
    assert "lmsys-sweep: 4 job(s)" in proc.stdout
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line[:1].isdigit()}
    assert rows["1"].endswith("failed (2)") and "/nonexistent" in rows["1"]
    assert "Error executing job" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert rows["2"].endswith("completed") and "0.0010" in rows["2"]
    with open(sweep_dir / "summary.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [r["status"] for r in table] == ["completed", "failed (2)"] * 2
    assert "optim.decay_steps" not in table[0]  # a failed job's composed config differs in nothing else
    assert all(float(r["wall_seconds"]) > 0 for r in table)
    assert (sweep_dir / "losses.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_lmsys_train_multirun_under_torchrun_has_one_sweep_dir(tiny, tmp_path):
    """`torchrun --nproc_per_node=2 --max-restarts=1 -m lmsys.train -m ...`: both ranks run Hydra
    and every job trains on both, in one sweep directory (the default one, under the working
    directory). Job 0 loses rank 1 at step 4 on the first attempt; torchrun restarts the ranks,
    which find the same sweep directory through its store, so job 0 resumes from its step-3
    checkpoint and job 1 then runs. (Without the agreement the ranks would differ only when their
    clocks straddle a second; the test above checks the agreement itself.)"""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--standalone", "--nproc_per_node=2", "--max-restarts=1", "--monitor-interval=0.5"]
    command += ["-m", "lmsys.train", "-m", *tiny, "debug.crash_at_step=4", "optim.lr=3e-3,1e-3"]
    proc = run(command, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "rank 1 exits at step 4" in proc.stdout and "step_0000003 (step 3)" in proc.stdout
    sweep_dirs = sorted((tmp_path / "runs").iterdir())
    assert len(sweep_dirs) == 1 and sweep_dirs[0].name.startswith("multirun-"), sweep_dirs
    sweep_dir = sweep_dirs[0]
    curves = [assert_trained(sweep_dir / str(num), world_size=2, proc=proc) for num in (0, 1)]
    assert curves[0] != curves[1]
    assert len(run_meta(sweep_dir / "0")["launches"]) == 2  # trained, then resumed
    assert (sweep_dir / "multirun.yaml").is_file() and (sweep_dir / "summary.csv").is_file()
