"""lmsys-train: train a model of the family on prepared data with DeepSpeed ZeRO.

    python -m lmsys.prepare                                   # once: data/default
    python -m launch.torchrun -- deepspeed=zero2 model=tiny   # 2 processes (torchrun, quiet)
    lmsys-train optim.lr=3e-4 trainer.max_steps=50            # one process
    lmsys-train -m optim.lr=1e-3,3e-4 trainer.max_steps=50    # a Hydra sweep

How a run is set up and what one optimizer step does: lmsys/training/trainer.py.

Errors: a bad config, bad data or an incompatible checkpoint prints one line
`lmsys-train: error: ...` and exits 2 before anything is written; a training failure (too many
NaN steps) exits 1.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import time
import traceback
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lmsys.cli import flag_as_override, run_cli
from lmsys.core.config import CONF_DIR, adopt_init_from, compose, config_keys, to_config
from lmsys.core.console import one_line, report_error
from lmsys.core.errors import EXIT_REQUEUE, LmsysError, Stopped, TrainingError
from lmsys.sweep.multirun import (
    check_multirun,
    in_multirun,
    job_header,
    multirun_defaults,
    record_job,
    runs_in_process,
    shared_sweep_dir,
)
from lmsys.train_help import usage

# lmsys.training.trainer (torch, DeepSpeed: about 3 CPU-s) is imported by the functions that
# train, so that --help and a refused flag answer at once.
PROG = "lmsys-train"

# Hydra's own command-line flags; any other `--name` is taken for a key (`--max_steps 5`).
HYDRA_FLAGS = {
    "-h", "--help", "-m", "--multirun", "-c", "--cfg", "-i", "--info", "--hydra-help", "--resolve",
    "-p", "--package", "-r", "--run", "-sc", "--shell-completion", "-cp", "--config-path",
    "-cn", "--config-name", "-cd", "--config-dir", "--experimental-rerun", "--version",
}  # fmt: skip

# ----------------------------------------------------------------------------- entry points


# An absolute config path: the task may run as `lmsys.train` (the lmsys-train console script,
# submitit workers), where a relative one would be looked up as a Python package.
@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _hydra_task(dcfg: DictConfig) -> None:
    """A job of `lmsys-train -m` (or a run with Hydra's own flags)."""
    multirun_defaults(dcfg)  # `-m`: run_dir <sweep dir>/<job number>, W&B group = the sweep's name
    header = job_header(dcfg)
    if header and os.environ.get("RANK", "0") == "0":
        print(f"{PROG}: {header}", flush=True)
    from lmsys.training.run import train  # late: torch and DeepSpeed (PROG above)

    started = time.perf_counter()
    try:
        train(to_config(dcfg))
    except Stopped as stop:
        if in_multirun():
            status = "preempted" if stop.exit_code == EXIT_REQUEUE else "interrupted"
            record_job(status, stop.exit_code, time.perf_counter() - started)
        sys.exit(stop.exit_code)  # SystemExit passes through Hydra: the sweep stops here, to be resumed
    except LmsysError as exc:
        if not in_multirun():
            report_error(PROG, exc)
            sys.exit(exc.exit_code)
        number = HydraConfig.get().job.num
        report_error(PROG, LmsysError(f"sweep job {number} failed (exit {exc.exit_code}): {exc}"))
        record_job("failed", exc.exit_code, time.perf_counter() - started, one_line(exc))
        if not runs_in_process():
            raise  # a remote job: its launcher learns of the failure from the exception
        FAILED_JOBS.append((number, exc.exit_code))  # the sweep goes on; main() exits with the first
        return
    if in_multirun():
        record_job("completed", 0, time.perf_counter() - started)


FAILED_JOBS: list[tuple[int, int]] = []  # (job number, exit status) of this process's failed sweep jobs


def die_with_launcher() -> None:
    """Under torchrun, make this worker die with its launcher.

    torchrun starts each worker in a session of its own, so a `kill -9` of torchrun (or of the
    job's process group) would leave the workers training on as orphans, writing checkpoints
    that race with the resumed job. PR_SET_PDEATHSIG has the kernel SIGKILL us when the parent
    dies; checkpoints are atomic, so dying at any moment is safe. Linux only; a no-op elsewhere.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes  # Linux workers under torchrun only
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


def end_worker(status: int) -> NoReturn:
    """End a training process without the interpreter's finalization.

    The DeepSpeed engine stays referenced by torch's hook registries and holds the process groups,
    so gloo's threads outlive destroy_process_group; one that needs the GIL while the interpreter
    finalizes aborts the process ("terminate called without an active exception", SIGABRT) after
    a run that finished and saved: CI saw it after complete runs of 2 ranks and of 1. Everything
    the run owns is closed by then (checkpoints, W&B, the run record); the exit handlers still run
    (a sweep's summary), the streams are flushed, then the process ends with its status."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def started_distributed() -> bool:
    """Whether this process brought up DeepSpeed (and with it gloo's threads): any training run,
    one process or many, under torchrun or not; not --help, nor a mistake found before."""
    return "deepspeed" in sys.modules


LOST_PEER_GRACE_S = 2.0  # a survivor's wait before it ends, once its line is said

# How gloo and NCCL word a collective whose peer process is gone
_PEER_GONE = (
    "closed by peer",
    "reset by peer",
    "broken pipe",
    "remote process exited",
    "communicator was aborted",
)


def lost_peer(exc: BaseException) -> str | None:
    """The line of a rank whose collective failed because another rank of the job is gone
    (killed, crashed): raised inside torch.distributed in a job of several ranks, in the words
    gloo and NCCL use for a lost peer (_PEER_GONE). None for any other error, which keeps its
    traceback. The launcher's own line names the rank that failed."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    where = next(
        (f for f in reversed(frames) if "torch/distributed/" in f.filename.replace(os.sep, "/")), None
    )
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(exc).split()))  # gloo's source location
    gone = type(exc).__name__ == "DistNetworkError" or any(p in text.lower() for p in _PEER_GONE)
    if where is None or not gone:
        return None
    reason = text.split(". ")[0] or type(exc).__name__
    return (
        f"rank {os.environ.get('RANK', '0')}: another rank left the job: {where.name} failed "
        f"({reason}); the launcher's line names the rank that failed"
    )


def _is_plain_run(argv: list[str]) -> bool:
    """Only overrides (no Hydra flags such as -m, --cfg, --help)."""
    return not any(arg.startswith("-") for arg in argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def show_help() -> int:
        print(usage(PROG, __doc__ or "", [a for a in argv if not a.startswith("-")]))
        return 0

    def plain_run() -> int:
        from lmsys.engine.zero import close_distributed  # late: torch and DeepSpeed (PROG above)
        from lmsys.training.run import train

        try:
            train(compose(argv))  # composed once, here: a mistake is one line
        except Stopped as stop:  # saved after a signal: already said in one line
            return stop.exit_code
        except RuntimeError as exc:
            lost = lost_peer(exc)
            if lost is None:
                raise
            report_error(PROG, TrainingError(lost))
            # a consequence, not the cause: the launcher (torchrun polls every 0.1 s) must see the
            # rank that failed end first, or its line would name this one
            time.sleep(LOST_PEER_GRACE_S)
            return TrainingError.exit_code
        finally:
            close_distributed()
        return 0

    def check_sweep() -> int:
        check_multirun(argv)  # every job composed up front: a mistake is one line before any job runs
        return 0

    def refuse_flag() -> int:  # Hydra would print its usage block, with no hint of the key
        flag_as_override(PROG, argv, config_keys(), HYDRA_FLAGS)
        return 0

    if any(arg in ("-h", "--help") for arg in argv):
        return run_cli(PROG, show_help)
    if any(a.startswith("-") and a.partition("=")[0] not in HYDRA_FLAGS for a in argv):
        return run_cli(PROG, refuse_flag)
    die_with_launcher()
    if _is_plain_run(argv):
        return run_cli(PROG, plain_run)
    if "-m" in argv or "--multirun" in argv:
        status = run_cli(PROG, check_sweep)
        if status:
            return status
        argv = shared_sweep_dir(argv)  # under torchrun: one sweep directory for all ranks
    # model.init_from=DIR alone: the export's model as the preset, for Hydra's own composition too
    sys.argv = [sys.argv[0] if sys.argv else PROG, *adopt_init_from(argv)]
    _hydra_task()
    if FAILED_JOBS:  # each said why in its line; the summary marks them
        numbers = ", ".join(str(n) for n, _ in FAILED_JOBS)
        report_error(
            PROG,
            LmsysError(
                f"{len(FAILED_JOBS)} sweep job(s) failed: job {numbers} (above; the summary marks them)"
            ),
        )
        return FAILED_JOBS[0][1]
    return 0


if __name__ == "__main__":
    # Run the copy imported as `lmsys.train`, not `__main__`: launchers that pickle the task
    # (hydra/launcher=slurm, submitit) must find its classes by an importable name on the worker.
    from lmsys.train import end_worker, started_distributed
    from lmsys.train import main as _main

    try:
        exit_status = _main()
    except SystemExit as exc:  # Hydra's own exits (a config error in a sweep job)
        if not started_distributed():
            raise
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        exit_status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # kept: the traceback, then the same safe end
        if not started_distributed():
            raise
        traceback.print_exc()
        exit_status = 1
    if started_distributed():
        end_worker(exit_status)
    sys.exit(exit_status)
