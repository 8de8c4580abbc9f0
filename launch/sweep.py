"""lmsys sweep launcher: every job of a Hydra sweep is its own torchrun launch, then a summary.

    python -m launch.sweep --nproc 2 -- optim.lr=1e-3,3e-4 trainer.max_steps=50
    python -m launch.sweep --sweep-dir runs/seeds -- trainer.seed=range(1,4) trainer.max_steps=50

The overrides are expanded exactly as `lmsys-train -m` would (Hydra's override grammar and
BasicSweeper: the cartesian product of comma lists, range(), glob()), every job's config is
composed and validated, its batch arithmetic checked for the job's world size (processes x nodes)
and the launcher options checked, all before the first job starts (a misspelled key is one error
line, exit 2), then the jobs run one after the other, each as

    python launch/torchrun.py --nproc N ... -- <job overrides> \
        trainer.run_dir=<sweep_dir>/<num> logger.group=<name>

(`python -m lmsys.train` directly when --nproc is 1). Each job thus has its own run directory and
its own W&B run, grouped under the sweep's name (the sweep directory's name unless --name or a
logger.group override is given). `<sweep_dir>/sweep.json` records every job's overrides, status,
exit code and duration as it goes; at the end `lmsys.sweep.summary.summarize` prints the comparison table
and writes summary.csv, groups.csv (seed statistics per configuration; with --baseline KEY=VALUE the
paired differences from that configuration) and losses.png into the sweep directory.

Running the same command with the same --sweep-dir again skips the completed jobs and restarts
the others (trainer.resume=auto continues each from its newest checkpoint): a sweep inside a
requeued SLURM job picks up where it stopped. SIGTERM, SIGUSR1 (preemption, a time limit) and
SIGHUP are passed to the running job, which saves its step and stops; the sweep then records it
as "preempted" and exits 75 (EXIT_REQUEUE), the status launch/slurm.sbatch requeues on (Ctrl-C:
"interrupted", 130). A job that fails stops the sweep (exit status of the job) unless
--keep-going; a job that the hang watchdog ended (exit 86, a stuck rank) has the watchdog's line,
which names the rank, repeated and recorded in sweep.json ("error"). Options other than those
below (--nnodes, --rdzv-*, ...) go to launch/torchrun.py for every job.

Over several nodes: the same command on every node with the same --sweep-dir (shared filesystem);
each job gets a rendezvous id of its own (`<id>-job<num>`: torchrun closes a rendezvous when its
run ends) and node 0 alone writes sweep.json and the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python launch/sweep.py` as well as `python -m launch.sweep`
    sys.path.insert(0, str(REPO_ROOT))

from launch.torchrun import JobLayout, job_layout  # noqa: E402
from launch.torchrun import build_parser as launcher_parser  # noqa: E402
from lmsys.cli import run_cli  # noqa: E402
from lmsys.core.console import warn  # noqa: E402
from lmsys.core.errors import EXIT_REQUEUE, EXIT_STUCK_RANK, ConfigError, Stopped, UsageError  # noqa: E402
from lmsys.core.files import atomic_write_text  # noqa: E402
from lmsys.core.rundir import hang_line_file  # noqa: E402
from lmsys.sweep.multirun import SWEEP_FILE, check_jobs, expand_sweep, sweep_name  # noqa: E402
from lmsys.sweep.summary import summarize  # noqa: E402
from lmsys.training.stopping import RESUME_COMMAND_ENV  # noqa: E402

PROG = "lmsys-sweep"
TORCHRUN = Path(__file__).resolve().with_name("torchrun.py")
RESERVED = ("trainer.run_dir",)
SWEEP_HELP = """\
sweep overrides (after `--`): Hydra's sweep grammar, as `lmsys-train -m` takes it: a comma list
(optim.lr=1e-3,3e-4), range(1,4), glob(); one job per combination. Other options (--nnodes,
--rdzv-endpoint, ...) go to launch.torchrun for every job.

examples: each runs as written on the default data; the same command again finishes a sweep
  python -m launch.sweep --nproc 2 -- optim.lr=1e-3,3e-4 trainer.max_steps=50
  python -m launch.sweep --sweep-dir runs/seeds -- trainer.seed=range(1,4) trainer.max_steps=50"""


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def launch_layout(nproc: int | None, launcher_args: list[str]) -> JobLayout | None:
    """What launch/torchrun.py will do for every job (None: one plain process per job); checked
    before the first job starts, so bad launcher options or environment fail at once."""
    if nproc == 1 and not launcher_args:
        return None
    nproc_args = [] if nproc is None else ["--nproc", str(nproc)]
    return job_layout(launcher_parser().parse_args([*nproc_args, *launcher_args]), os.environ)


def job_command(
    job: list[str],
    num: int,
    nproc: int | None,
    launcher_args: list[str],
    layout: JobLayout | None,
    run_dir: Path,
    group: str | None,
) -> list[str]:
    overrides = [*job, f"trainer.run_dir={run_dir}"]
    if group is not None:
        overrides.append(f"logger.group={group}")
    if layout is None:
        return [sys.executable, "-m", "lmsys.train", *overrides]
    nproc_args = [] if nproc is None else ["--nproc", str(nproc)]
    rdzv_args = []
    if layout.rdzv_id is not None:
        # torchrun closes a c10d rendezvous when its run ends: each multi-node job needs an id of its
        # own, the same on every node (derived from the one launch/torchrun.py would pick).
        launcher_args = _drop_option(launcher_args, "--rdzv-id")
        rdzv_args = ["--rdzv-id", f"{layout.rdzv_id}-job{num}"]
    return [sys.executable, str(TORCHRUN), *nproc_args, *launcher_args, *rdzv_args, "--", *overrides]


def _drop_option(args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def _write_index(path: Path, index: dict) -> None:
    atomic_write_text(path, json.dumps(index, indent=1) + "\n")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # the workers import lmsys from the repository even when it is not installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_job(command: list[str]) -> int:
    """Run one job in the foreground and return its exit status. SIGTERM, SIGUSR1 and SIGHUP are
    passed to it (it saves its step and stops: Stopped when it exits 75); Ctrl-C, which the
    terminal sends to the job as well, ends the sweep once the job has stopped (KeyboardInterrupt)."""
    proc = subprocess.Popen(command, env=_env())
    forwarded: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)}
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # the terminal sent SIGINT to the job too; wait for it to stop
                forwarded.append(signal.SIGINT)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if code == EXIT_REQUEUE:
        raise Stopped(f"the job exited {code}", code)
    if forwarded:
        raise KeyboardInterrupt
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch.sweep",
        usage="%(prog)s [options] [launch.torchrun options] -- sweep overrides ...",
        description="Run every job of a Hydra sweep as its own torchrun launch, then summarize the sweep.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SWEEP_HELP,
    )
    parser.add_argument("--nproc", type=int, help="processes per job (default: launch/torchrun.py's choice)")
    parser.add_argument("--sweep-dir", help="where the jobs' run directories go (default runs/sweep-<time>)")
    parser.add_argument("--name", help="W&B group of the jobs (default: the sweep directory's name)")
    parser.add_argument("--keep-going", action="store_true", help="run the remaining jobs after a failure")
    parser.add_argument("--dry-run", action="store_true", help="print the jobs' commands and exit")
    parser.add_argument("--no-plot", action="store_true", help="no losses.png in the summary")
    parser.add_argument(
        "--baseline",
        metavar="KEY=VALUE",
        help="compare every configuration with this one seed by seed (e.g. optim=adamw; docs/sweeps.md)",
    )
    return parser


def _split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(our options, launch/torchrun.py's options, the sweep overrides)."""
    if "--" in argv:
        split = argv.index("--")
        args, launcher_args = build_parser().parse_known_args(argv[:split])
        return args, launcher_args, argv[split + 1 :]
    args, rest = build_parser().parse_known_args(argv)
    launcher_args = [a for a in rest if a.startswith("-")]
    if launcher_args:  # an option's value would be taken for an override: ask for `--`
        raise UsageError(f"put the sweep overrides after `--` when passing {launcher_args[0]}")
    return args, [], rest


def _check(
    args: argparse.Namespace, launcher_args: list[str], overrides: list[str]
) -> tuple[JobLayout | None, list]:
    """Everything checkable before the first job: the launcher options, every job's config, the
    summary's --baseline (in --dry-run too)."""
    if any(_key(o) in RESERVED for o in overrides):
        raise ConfigError(
            "trainer.run_dir is set per job (<sweep_dir>/<job number>); use --sweep-dir instead"
        )
    layout = launch_layout(args.nproc, launcher_args)
    if layout is not None and layout.nnodes > 1 and not args.sweep_dir:
        raise ConfigError(
            f"a sweep over {layout.nnodes} nodes needs --sweep-dir, the same on every node "
            "(on a shared filesystem)"
        )
    jobs = expand_sweep(overrides)
    check_jobs(jobs, world_size=1 if layout is None else layout.nproc * layout.nnodes, baseline=args.baseline)
    return layout, jobs


def _open_index(sweep_dir: Path, group: str | None, overrides: list[str], jobs: list) -> dict:
    """sweep.json's contents: the earlier run's (to finish it) or a new index of pending jobs."""
    index = {"sweep_dir": str(sweep_dir), "group": group, "overrides": overrides, "jobs": []}
    index_path = sweep_dir / SWEEP_FILE
    if index_path.is_file():
        old = json.loads(index_path.read_text(encoding="utf-8"))
        if [j["overrides"] for j in old.get("jobs", [])] != jobs:
            raise UsageError(
                f"{sweep_dir} holds another sweep ({' '.join(old.get('overrides', []))}); "
                "choose another --sweep-dir"
            )
        index["jobs"] = old["jobs"]
    else:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        index["jobs"] = [
            {"num": i, "overrides": job, "run_dir": str(sweep_dir / str(i)), "status": "pending"}
            for i, job in enumerate(jobs)
        ]
    return index


def _stuck_line(entry: dict) -> str | None:
    """The hang watchdog's line of a job it ended (lmsys/training/watchdog.py writes it)."""
    path = hang_line_file(Path(entry["run_dir"]))
    return path.read_text(encoding="utf-8").strip() if path.is_file() else None


def _run_jobs(index: dict, commands: list[list[str]], keep_going: bool, save) -> int:
    """Every job not completed yet, in order; the sweep's exit status."""
    exit_code, total = 0, len(commands)
    try:
        for i, (entry, command) in enumerate(zip(index["jobs"], commands)):
            if entry["status"] == "completed":
                print(
                    f"{PROG}: job {i + 1}/{total} ({entry['run_dir']}): already completed, skipped",
                    flush=True,
                )
                continue
            # counted from 1 for the reader; the run directory keeps Hydra's job number (from 0)
            print(
                f"{PROG}: job {i + 1}/{total} ({entry['run_dir']}): {' '.join(entry['overrides'])}",
                flush=True,
            )
            entry.update(status="running", started=datetime.now().isoformat(timespec="seconds"))
            save()
            t0 = time.perf_counter()
            try:
                code = run_job(command)
            except Stopped:
                entry.update(
                    status="preempted", returncode=EXIT_REQUEUE, seconds=round(time.perf_counter() - t0, 1)
                )
                raise
            except KeyboardInterrupt:
                entry.update(status="interrupted", returncode=130, seconds=round(time.perf_counter() - t0, 1))
                raise
            entry.update(
                status="completed" if code == 0 else "failed",
                returncode=code,
                seconds=round(time.perf_counter() - t0, 1),
            )
            stuck = _stuck_line(entry) if code == EXIT_STUCK_RANK else None
            if stuck:
                entry["error"] = stuck
            save()
            if code != 0:
                why = f": {stuck}" if stuck else ""
                print(
                    f"{PROG}: job {i + 1}/{total} ({entry['run_dir']}) failed with exit status {code}{why}",
                    file=sys.stderr,
                    flush=True,
                )
                exit_code = exit_code or code
                if not keep_going:
                    break
    except Stopped:
        save()
        print(
            f"{PROG}: preempted: the running job saved its step; exit {EXIT_REQUEUE}: requeue, or run the "
            "same command again, to finish the sweep",
            file=sys.stderr,
            flush=True,
        )
        exit_code = EXIT_REQUEUE
    except KeyboardInterrupt:
        save()
        print(
            f"{PROG}: interrupted; run the same command again to finish the sweep",
            file=sys.stderr,
            flush=True,
        )
        exit_code = 130
    return exit_code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        args, launcher_args, overrides = _split_args(argv)
        layout, jobs = _check(args, launcher_args, overrides)
        # Every node runs every job; node 0 alone keeps sweep.json and writes the summary.
        primary = layout is None or layout.node_rank == 0
        sweep_dir = Path(args.sweep_dir or f"runs/sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
        given_group = any(_key(o) == "logger.group" for o in overrides)
        group = None if given_group else (args.name or sweep_name(sweep_dir))
        commands = [
            job_command(job, i, args.nproc, launcher_args, layout, sweep_dir / str(i), group)
            for i, job in enumerate(jobs)
        ]
        if args.dry_run:
            for i, command in enumerate(commands):
                print(f"job {i + 1}/{len(commands)}: {' '.join(command)}")
            return 0
        # what a job stopped by a signal names as the command that continues: this sweep, again
        again = [] if args.sweep_dir else ["--sweep-dir", str(sweep_dir)]
        os.environ.setdefault(RESUME_COMMAND_ENV, shlex.join(["python", "-m", "launch.sweep", *again, *argv]))
        index = _open_index(sweep_dir, group, overrides, jobs)
        save = (lambda: _write_index(sweep_dir / SWEEP_FILE, index)) if primary else (lambda: None)
        save()
        print(
            f"{PROG}: {len(jobs)} job(s) in {sweep_dir} (W&B group {group or 'from logger.group'})",
            flush=True,
        )
        exit_code = _run_jobs(index, commands, args.keep_going, save)
        if primary:
            try:
                summarize(sweep_dir, plot_png=not args.no_plot, baseline=args.baseline)
            except ConfigError as exc:
                warn(PROG, f"no summary: {exc}")
        return exit_code

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
