"""lmsys-launch: run `lmsys.train` (or another module) under torchrun, on one node or on many.

    python -m launch.torchrun -- model=tiny deepspeed=zero2          # this node: 1 process per GPU (CPU: 2)
    python -m launch.torchrun --nproc 8 -- model=gpt2_124m deepspeed=zero2
    # two nodes: the same command on each; the node of rank 0 hosts the rendezvous store
    python -m launch.torchrun --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 -- model=gpt2_350m
    python -m launch.torchrun --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29400 -- model=gpt2_350m
    MASTER_ADDR=node0 MASTER_PORT=29400 NNODES=2 NODE_RANK=1 python -m launch.torchrun -- model=gpt2_350m

Everything after the options (or after `--`) goes to the module unchanged: Hydra overrides.
Each value comes from the first of these that is set:

    processes per node  --nproc, $NPROC, $SLURM_GPUS_ON_NODE, the GPUs visible ($CUDA_VISIBLE_DEVICES,
                        else `nvidia-smi -L`), else 2 (a CPU machine)
    nodes               --nnodes, $NNODES, $SLURM_JOB_NUM_NODES inside a SLURM job, else 1
    node rank           --node-rank, $NODE_RANK, $SLURM_NODEID, else 0
    endpoint host:port  --rdzv-endpoint, $RDZV_ENDPOINT, $MASTER_ADDR:$MASTER_PORT (port 29400 if unset),
                        inside a SLURM job the first node of $SLURM_JOB_NODELIST; needed for 2+ nodes
    rendezvous id       --rdzv-id, $RDZV_ID, $SLURM_JOB_ID, else one derived from the endpoint
    restarts            --max-restarts, $MAX_RESTARTS, else 0

One node and no endpoint: `torchrun --standalone` (a private rendezvous store on a free port).
Otherwise a c10d rendezvous at the endpoint: node 0 hosts the store when the endpoint names this
machine, the other nodes first wait for it to answer (at most --rdzv-timeout seconds, then one
error line instead of a hang), and every node joining is bounded by the same timeout (c10d
`join_timeout`). Inside a SLURM job a node count that differs from the allocation's is an error.

Elastic restarts: with --max-restarts K, when a worker dies torchrun stops the others and starts
the whole group again, up to K times; with trainer.resume=auto (the default) the new workers load
the newest complete checkpoint of the same run directory and go on from its step. Give
trainer.run_dir explicitly for multi-node jobs (one directory on a shared filesystem).

Stopping: SIGTERM, SIGUSR1 (a preemption, SLURM's time-limit warning) and SIGINT (Ctrl-C) to the
launcher go to every worker, which finishes its optimizer step, saves a checkpoint of it and
exits (lmsys/training/stopping.py); the workers get --shutdown-timeout seconds (default 300,
$SHUTDOWN_TIMEOUT) before torchrun kills them. A repeated SIGTERM or SIGUSR1 does not cut that
short; a second Ctrl-C does (the checkpoint being written is abandoned, never left half-visible).
The workers' stop line names this launcher's command line (LMSYS_LAUNCH_COMMAND) as the one that
continues the run, with trainer.run_dir set.

Workers get OMP_NUM_THREADS = cores / processes unless it is set. Exit status: 0; 2 for bad
arguments or environment; 3 when the rendezvous fails (endpoint silent, nodes missing); 75
(EXIT_REQUEUE) when stopped by SIGTERM or SIGUSR1: requeue the job (or run it again) and
trainer.resume=auto continues from the saved step; 130 after Ctrl-C; 86 (EXIT_STUCK_RANK) when the
trainer's hang watchdog found a rank that stopped making progress (trainer.hang_timeout_s): the
launcher repeats its line, which names the rank, and kills every worker left on this node, a
frozen one included (launch/stuck.py); otherwise that of the first worker that failed (128 +
signal number when it was killed).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python launch/torchrun.py` as well as `python -m launch.torchrun`
    sys.path.insert(0, str(REPO_ROOT))

from launch.stuck import HangRelay  # noqa: E402
from lmsys.cli import run_cli  # noqa: E402  (after the path set-up above)
from lmsys.core.errors import EXIT_INTERRUPTED, EXIT_REQUEUE, EXIT_STUCK_RANK, LmsysError  # noqa: E402
from lmsys.training.stopping import LAUNCH_COMMAND_ENV  # noqa: E402

PROG = "lmsys-launch"
DEFAULT_PORT = 29400
DEFAULT_TIMEOUT_S = 600.0
CPU_NPROC = 2
EXIT_USAGE = 2
EXIT_RENDEZVOUS = 3
DEFAULT_SHUTDOWN_TIMEOUT_S = 300
# What torchrun passes to the workers; SIGUSR1 is SLURM's `--signal=USR1@<seconds>` warning.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


class LaunchError(LmsysError):
    """A one-line problem for the user, with the exit status to leave with."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = code


# ----------------------------------------------------------------------------- what runs where


@dataclass(frozen=True)
class JobLayout:
    """What the launcher starts where: torchrun's processes on this node, the nodes, the rendezvous."""

    nproc: int
    nproc_source: str
    nnodes: int
    node_rank: int
    endpoint: str | None  # host:port of the c10d store; None: --standalone
    rdzv_id: str | None
    hosts_store: bool | None  # None: torchrun decides (standalone)
    timeout_s: float
    max_restarts: int
    module: str
    shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S  # the workers' time to save after a signal

    def torchrun_args(self, overrides: list[str]) -> list[str]:
        """torchrun's own command line (what `python -m torch.distributed.run` takes)."""
        args = [
            f"--nproc-per-node={self.nproc}",
            f"--max-restarts={self.max_restarts}",
            f"--signals-to-handle={FORWARDED_SIGNALS}",
            f"--shutdown-timeout={self.shutdown_timeout_s}",
        ]
        if self.endpoint is None:
            args += ["--standalone", "--nnodes=1"]
        else:
            conf = f"join_timeout={int(self.timeout_s)}"
            if self.hosts_store is not None:
                conf += f",is_host={str(self.hosts_store).lower()}"
            args += [
                f"--nnodes={self.nnodes}",
                f"--node-rank={self.node_rank}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={self.rdzv_id}",
                f"--rdzv-conf={conf}",
            ]
        return [*args, "-m", self.module, *overrides]

    def describe(self) -> str:
        where = (
            "standalone rendezvous"
            if self.endpoint is None
            else f"c10d rendezvous {self.endpoint} id {self.rdzv_id}"
            + (" (this node hosts the store)" if self.hosts_store else "")
        )
        return (
            f"{self.nnodes} node(s) x {self.nproc} process(es) ({self.nproc_source}), node rank "
            f"{self.node_rank}, {where}, max restarts {self.max_restarts}"
        )


def _int(value: str, name: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None
    if number < minimum:
        raise LaunchError(f"{name}={number} must be >= {minimum}")
    return number


def _first(*pairs: tuple[str, str | None]) -> tuple[str, str] | None:
    """The first (name, value) whose value is set and not empty."""
    for name, value in pairs:
        if value not in (None, ""):
            return name, value  # type: ignore[return-value]
    return None


def _option_or_env(
    value: int | None, option: str, env: Mapping[str, str], variable: str, minimum: int, default: int
) -> int:
    """An integer setting from its option, else its environment variable, else `default`."""
    source = _first((option, None if value is None else str(value)), (variable, env.get(variable)))
    return _int(source[1], source[0], minimum) if source else default


def visible_gpus(env: Mapping[str, str]) -> int:
    """GPUs this node can use: $CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L`, else 0."""
    if "CUDA_VISIBLE_DEVICES" in env:
        devices = [d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
        return 0 if not devices or devices[0].strip() in ("-1", "NoDevFiles") else len(devices)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def resolve_nproc(arg: int | None, env: Mapping[str, str]) -> tuple[int, str]:
    if arg is not None:
        return _int(str(arg), "--nproc", 1), "--nproc"
    if env.get("NPROC"):
        return _int(env["NPROC"], "NPROC", 1), "$NPROC"
    if env.get("SLURM_GPUS_ON_NODE") and int(env["SLURM_GPUS_ON_NODE"].split("(")[0] or 0) > 0:
        return int(env["SLURM_GPUS_ON_NODE"].split("(")[0]), "$SLURM_GPUS_ON_NODE"
    gpus = visible_gpus(env)
    if gpus > 0:
        return gpus, "GPUs visible"
    return CPU_NPROC, "no GPU: CPU default"


def parse_endpoint(text: str, source: str) -> tuple[str, int]:
    match = re.fullmatch(r"\[?([^\[\]]+?)\]?(?::(\d+))?", text.strip())
    if not match or not match.group(1):
        raise LaunchError(f"{source}={text!r} is not host:port")
    port = int(match.group(2)) if match.group(2) else DEFAULT_PORT
    if not 0 < port < 65536:
        raise LaunchError(f"{source}={text!r}: port {port} is not in 1..65535")
    return match.group(1), port


def slurm_head_node(env: Mapping[str, str]) -> str | None:
    """The first host of the allocation (`scontrol show hostnames $SLURM_JOB_NODELIST | head -n1`)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist or shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def _can_bind(address: str, port: int = 0) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def is_this_machine(host: str) -> bool:
    """Whether `host` names this machine: a loopback name, or it resolves to an address we can bind."""
    if host == "localhost" or host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        raise LaunchError(f"rendezvous host {host!r} does not resolve to an address") from None
    addresses = {info[4][0] for info in infos}
    return any(a.startswith("127.") or a == "::1" or _can_bind(a) for a in addresses)


def job_layout(args: argparse.Namespace, env: Mapping[str, str]) -> JobLayout:
    nproc, nproc_source = resolve_nproc(args.nproc, env)
    in_slurm = bool(env.get("SLURM_JOB_ID"))
    slurm_nodes_text = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    slurm_nodes = _int(slurm_nodes_text, "SLURM_JOB_NUM_NODES", 1) if in_slurm and slurm_nodes_text else None

    asked = _first(
        ("--nnodes", None if args.nnodes is None else str(args.nnodes)), ("NNODES", env.get("NNODES"))
    )
    if asked is not None:
        nnodes = _int(asked[1], asked[0], 1)
        if slurm_nodes is not None and nnodes != slurm_nodes:
            raise LaunchError(
                f"{asked[0]}={nnodes} does not match the SLURM allocation of job {env['SLURM_JOB_ID']}, "
                f"which has {slurm_nodes} node(s) (SLURM_JOB_NUM_NODES); submit with --nodes={nnodes} "
                f"or drop {asked[0]}"
            )
    else:
        nnodes = slurm_nodes or 1
    if in_slurm and nnodes > 1:
        step_tasks = env.get("SLURM_STEP_NUM_TASKS") or (
            env.get("SLURM_NTASKS") if env.get("SLURM_STEP_ID") else None
        )
        if not env.get("SLURM_STEP_ID"):
            raise LaunchError(
                f"the SLURM job has {nnodes} nodes but this launcher runs outside a job step, so the other "
                "nodes never join; start it with `srun --ntasks-per-node=1` (launch/slurm.sbatch does)"
            )
        if step_tasks and int(step_tasks) != nnodes:
            raise LaunchError(
                f"srun started {step_tasks} launchers for {nnodes} nodes; run exactly one per node "
                "(srun --ntasks-per-node=1 --ntasks=<nodes>)"
            )

    rank_src = _first(
        ("--node-rank", None if args.node_rank is None else str(args.node_rank)),
        ("NODE_RANK", env.get("NODE_RANK")),
        ("SLURM_NODEID", env.get("SLURM_NODEID") if in_slurm else None),
    )
    node_rank = _int(rank_src[1], rank_src[0], 0) if rank_src else 0
    if node_rank >= nnodes:
        raise LaunchError(f"node rank {node_rank} is not below the node count {nnodes}")

    endpoint_src = _first(
        ("--rdzv-endpoint", args.rdzv_endpoint), ("RDZV_ENDPOINT", env.get("RDZV_ENDPOINT"))
    )
    if endpoint_src is None and env.get("MASTER_ADDR"):
        endpoint_src = (
            "MASTER_ADDR:MASTER_PORT",
            f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT') or DEFAULT_PORT}",
        )
    if endpoint_src is None and in_slurm and nnodes > 1:
        head = slurm_head_node(env)
        if head:
            port = 20000 + int(env["SLURM_JOB_ID"].split("_")[0]) % 20000
            endpoint_src = ("SLURM_JOB_NODELIST", f"{head}:{port}")
    timeout_s = float(args.rdzv_timeout)
    if timeout_s <= 0:
        raise LaunchError(f"--rdzv-timeout={args.rdzv_timeout} must be > 0")
    max_restarts = _option_or_env(args.max_restarts, "--max-restarts", env, "MAX_RESTARTS", 0, 0)
    shutdown_s = _option_or_env(
        args.shutdown_timeout, "--shutdown-timeout", env, "SHUTDOWN_TIMEOUT", 1, DEFAULT_SHUTDOWN_TIMEOUT_S
    )

    if endpoint_src is None:
        if nnodes > 1:
            raise LaunchError(
                f"{nnodes} nodes need a rendezvous endpoint: --rdzv-endpoint host:port, RDZV_ENDPOINT, or "
                "MASTER_ADDR and MASTER_PORT (the host of node 0)"
            )
        return JobLayout(
            nproc, nproc_source, 1, 0, None, None, None, timeout_s, max_restarts, args.module, shutdown_s
        )

    host, port = parse_endpoint(endpoint_src[1], endpoint_src[0])
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    id_src = _first(
        ("--rdzv-id", args.rdzv_id),
        ("RDZV_ID", env.get("RDZV_ID")),
        ("SLURM_JOB_ID", env.get("SLURM_JOB_ID")),
    )
    rdzv_id = id_src[1] if id_src else "lmsys-" + re.sub(r"[^A-Za-z0-9]+", "-", endpoint).strip("-")
    hosts_store = node_rank == 0 and is_this_machine(host)
    return JobLayout(
        nproc,
        nproc_source,
        nnodes,
        node_rank,
        endpoint,
        rdzv_id,
        hosts_store,
        timeout_s,
        max_restarts,
        args.module,
        shutdown_s,
    )


# ----------------------------------------------------------------------------- checks before torchrun


def wait_for_endpoint(endpoint: str, timeout_s: float, say=print) -> None:
    """Return once something accepts TCP connections at `endpoint`; LaunchError after timeout_s."""
    host, port = parse_endpoint(endpoint, "endpoint")
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise LaunchError(
                f"rendezvous endpoint {endpoint} did not answer within {timeout_s:g} s; node 0 hosts it, "
                "so start node 0 too, or fix --rdzv-endpoint / RDZV_ENDPOINT / MASTER_ADDR:MASTER_PORT",
                EXIT_RENDEZVOUS,
            )
        if not announced:
            say(f"{PROG}: waiting up to {timeout_s:g} s for the rendezvous endpoint {endpoint} (node 0)")
            announced = True
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


# A c10d store client in a child process: it connects, pings, and reads a key. Run with a deadline,
# because a listener that accepts connections and never answers hangs torch's client in C++,
# beyond the reach of any timeout torch offers.
_STORE_PROBE = """
import sys
from datetime import timedelta
from torch.distributed import TCPStore
timeout = timedelta(seconds=float(sys.argv[3]))
store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=timeout, wait_for_workers=False)
store.check(["lmsys-launch-probe"])
"""
MIN_PROBE_S = 10.0  # room for the child's interpreter and torch import


def check_store_answers(endpoint: str, timeout_s: float) -> None:
    """LaunchError unless a c10d store answers at `endpoint` within max(timeout_s, MIN_PROBE_S)."""
    host, port = parse_endpoint(endpoint, "endpoint")
    limit = max(timeout_s, MIN_PROBE_S)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _STORE_PROBE, host, str(port), str(limit)],
            capture_output=True,
            text=True,
            timeout=limit,
        )
    except subprocess.TimeoutExpired:
        failure = f"did not answer as a c10d rendezvous store within {limit:g} s"
    else:
        if proc.returncode == 0:
            return
        failure = "answered, but not as a c10d rendezvous store"
    raise LaunchError(
        f"rendezvous endpoint {endpoint} accepts connections but {failure}; is another program "
        "listening on that port? Point --rdzv-endpoint at node 0's launcher",
        EXIT_RENDEZVOUS,
    )


def check_port_free(endpoint: str) -> None:
    host, port = parse_endpoint(endpoint, "endpoint")
    if not _can_bind("::" if ":" in host else "0.0.0.0", port):
        raise LaunchError(
            f"port {port} on this machine (node 0, the rendezvous host) is already in use; "
            "choose another port for the rendezvous endpoint",
            EXIT_RENDEZVOUS,
        )


def worker_threads(nproc: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // nproc)


# ----------------------------------------------------------------------------- running torchrun


def _patient_signals(elastic_api: Any) -> None:
    """torchrun's agent stops (raises its SignalException, passes the signal to the workers and
    waits for them) on the first signal; make it ignore repeats of SIGTERM / SIGUSR1 while the
    workers save, which would otherwise cut their grace period short: a scheduler may signal a
    job more than once (SLURM signals every process of a job step, and launch/slurm.sbatch passes
    the signal on too). torchrun installs `_terminate_process_handler` for each signal it handles
    when it starts the workers: it is replaced before that, and installed at once for the time
    before (imports, rendezvous). A second Ctrl-C still stops at once."""
    received: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if received and signum in (signal.SIGTERM, signal.SIGUSR1):
            return
        received.append(signum)
        sigval = signal.Signals(signum)
        raise elastic_api.SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)

    if hasattr(elastic_api, "_terminate_process_handler"):  # a private name of torch: checked
        elastic_api._terminate_process_handler = handler
    for name in FORWARDED_SIGNALS.split(","):
        signal.signal(getattr(signal, name), handler)


class _QuietShutdown(logging.Filter):
    """torchrun logs every signal it passes on ("Received SIGTERM death signal, shutting down
    workers", "Sending process N closing signal SIGTERM") and every worker that failed ("failed
    (exitcode: 2) local_rank: 0 (pid: N) of binary: ..."): the workers say what happens, once,
    and the launcher's own line names the worker that failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(said in message for said in ("death signal", "closing signal", "failed (exitcode"))


def _stopped(code: int, by: str) -> int:
    """The exit status of a launch stopped on request; the workers have said why in one line."""
    if code not in (EXIT_REQUEUE, EXIT_INTERRUPTED):
        print(f"{PROG}: stopped by {by}", file=sys.stderr, flush=True)
    return code


def check_training_config(overrides: list[str], world_size: int, nnodes: int = 1) -> None:
    """Compose lmsys.train's config and run the trainer's preflight for `world_size` ranks before
    any worker starts (lmsys.training.preflight): a mistake is then one line, not every rank's
    failure and torchrun's. On several nodes the data is checked where this node has it (a node
    may reach the rendezvous before its data is staged; the trainer checks it on every rank)."""
    # lmsys's config and checks import Hydra and torch: only for lmsys.train launches.
    from lmsys.core.config import compose
    from lmsys.training.preflight import check_run_dir_free, preflight

    cfg = compose(overrides)
    check_run_dir_free(cfg)  # a second launch into a running run's directory: one line, no workers
    preflight(cfg, world_size, data="required" if nnodes == 1 else "if_present")


def run_torchrun(layout: JobLayout, overrides: list[str]) -> int:
    """torchrun in this process (its agent handles signals itself); the exit status to leave with."""
    # torch is imported only here: --help, --dry-run and every argument check answer without it.
    from torch.distributed.elastic.multiprocessing import api as elastic_api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousError,
        RendezvousTimeoutError,
    )
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(layout.torchrun_args(overrides))
    for name in ("agent.server.api", "multiprocessing.api"):
        logging.getLogger(f"torch.distributed.elastic.{name}").addFilter(_QuietShutdown())

    # a stuck rank: the watchdog's line, every worker ended (launch/stuck.py); said at once when
    # torchrun may restart the workers after it
    def say(line: str) -> None:
        print(f"{PROG}: warning: {line}", file=sys.stderr, flush=True)

    relay = HangRelay.start(say if layout.max_restarts > 0 else None)
    try:
        _patient_signals(elastic_api)
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        stuck = relay.line()
        if stuck and failure.exitcode in (EXIT_STUCK_RANK, -signal.SIGKILL):  # the watchdog's doing
            print(f"{PROG}: error: {stuck}", file=sys.stderr, flush=True)
            return EXIT_STUCK_RANK
        if failure.exitcode in (EXIT_REQUEUE, EXIT_INTERRUPTED):  # a worker stopped on a signal, saved
            return _stopped(failure.exitcode, f"worker rank {rank}")
        if failure.exitcode < 0:
            how, code = f"was killed by signal {-failure.exitcode}", 128 - failure.exitcode
        else:
            how, code = f"exited with status {failure.exitcode}", failure.exitcode
        retries = f" after {layout.max_restarts} restart(s)" if layout.max_restarts else ""
        print(
            f"{PROG}: error: worker rank {rank} (pid {failure.pid}) {how}{retries}",
            file=sys.stderr,
            flush=True,
        )
        return min(max(code, 1), 255)
    except RendezvousTimeoutError:
        raise LaunchError(
            f"rendezvous {layout.endpoint} (id {layout.rdzv_id}) timed out after {layout.timeout_s:g} s: "
            f"not all {layout.nnodes} nodes joined; start every node with the same endpoint, id and node "
            "count",
            EXIT_RENDEZVOUS,
        ) from None
    except RendezvousConnectionError:
        raise LaunchError(
            f"lost or could not open the connection to the rendezvous store at {layout.endpoint}",
            EXIT_RENDEZVOUS,
        ) from None
    except RendezvousClosedError:
        raise LaunchError(
            f"rendezvous {layout.rdzv_id} at {layout.endpoint} is already closed (a finished run used this "
            "id); pass another --rdzv-id",
            EXIT_RENDEZVOUS,
        ) from None
    except RendezvousError as exc:
        raise LaunchError(f"rendezvous failed: {' '.join(str(exc).split())}", EXIT_RENDEZVOUS) from None
    except SignalException as exc:
        if exc.sigval in (signal.SIGTERM, signal.SIGUSR1):
            return _stopped(EXIT_REQUEUE, exc.sigval.name)
        if exc.sigval == signal.SIGINT:
            return _stopped(EXIT_INTERRUPTED, exc.sigval.name)
        return _stopped(128 + int(exc.sigval), f"signal {exc.sigval.name}")
    finally:
        relay.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch.torchrun",
        description="Run lmsys.train under torchrun on one node or many; the rest is Hydra overrides.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2] if __doc__ else None,
    )
    parser.add_argument("--nproc", type=int, help="processes on this node (default: one per GPU, 2 on CPU)")
    parser.add_argument(
        "--nnodes", type=int, help="number of nodes (default: $NNODES, the SLURM allocation, 1)"
    )
    parser.add_argument("--node-rank", type=int, help="this node's rank; rank 0 hosts the rendezvous store")
    parser.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous store (on node 0)")
    parser.add_argument("--rdzv-id", help="rendezvous id, the same on every node (default: $SLURM_JOB_ID)")
    parser.add_argument(
        "--rdzv-timeout",
        type=float,
        default=float(os.environ.get("RDZV_TIMEOUT", DEFAULT_TIMEOUT_S)),
        help="seconds to wait for the endpoint and for every node to join (default: $RDZV_TIMEOUT or 600)",
    )
    parser.add_argument(
        "--max-restarts", type=int, help="torchrun elastic restarts of the worker group (default 0)"
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=int,
        help="seconds the workers get to save after SIGTERM/SIGUSR1/SIGINT before they are killed "
        f"(default: $SHUTDOWN_TIMEOUT or {DEFAULT_SHUTDOWN_TIMEOUT_S})",
    )
    parser.add_argument(
        "--module", default="lmsys.train", help="python module the workers run (default lmsys.train)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides for the module")
    return parser


def main(argv: list[str] | None = None) -> int:
    launch_argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(launch_argv)
    overrides = list(args.overrides)
    if overrides and overrides[0] == "--":
        overrides = overrides[1:]

    def body() -> int:
        layout = job_layout(args, os.environ)
        if layout.module == "lmsys.train" and not any(o.startswith("-") for o in overrides):
            check_training_config(overrides, layout.nproc * layout.nnodes, layout.nnodes)
        command = [sys.executable, "-m", "torch.distributed.run", *layout.torchrun_args(overrides)]
        print(f"{PROG}: {layout.describe()}", flush=True)
        if args.dry_run:
            print(shlex.join(command), flush=True)
            return 0
        if layout.endpoint is not None:
            if layout.hosts_store:
                check_port_free(layout.endpoint)
            else:
                started = time.monotonic()
                wait_for_endpoint(layout.endpoint, layout.timeout_s)
                check_store_answers(layout.endpoint, layout.timeout_s - (time.monotonic() - started))
        os.environ.setdefault("OMP_NUM_THREADS", str(worker_threads(layout.nproc)))
        # what a worker stopped by a signal names as the command that continues the run
        os.environ.setdefault(
            LAUNCH_COMMAND_ENV, shlex.join(["python", "-m", "launch.torchrun", *launch_argv])
        )
        return run_torchrun(layout, overrides)

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
