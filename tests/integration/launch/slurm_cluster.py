"""A throwaway one-machine SLURM cluster for the launch tests: munged, slurmctld and slurmd from
Debian's packages, every file (config, state, spool, logs, munge socket and key) in one temporary
directory, ports chosen free, the daemons started in the foreground (-D / -F) as children of the
test and stopped by their process ids at the end.

Plugins that need neither systemd nor cgroups: proctrack/linuxproc, task/none, select/cons_tres
(CR_Core), no accounting. The node is this host (`hostname -s`) with the CPUs and memory that
`slurmd -C` reports. `ensure_installed` installs the packages with apt-get when they are missing
(root, apt available), or raises SlurmUnavailable with the reason to skip.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")
SBIN = ("/usr/sbin", "/sbin")
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


class SlurmUnavailable(RuntimeError):
    """SLURM cannot run here; the message says why (the tests skip with it)."""


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(Path(d, name)) for d in SBIN if Path(d, name).is_file() and os.access(Path(d, name), os.X_OK)),
        None,
    )


def _missing() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def ensure_installed(timeout_s: float = 240.0) -> None:
    """Install slurmctld, slurmd, slurm-client and munge with apt-get if any binary is missing."""
    if not _missing():
        return
    if os.name != "posix" or os.geteuid() != 0:
        raise SlurmUnavailable(
            f"SLURM is not installed ({', '.join(_missing())} missing) and we are not root"
        )
    apt = shutil.which("apt-get")
    if apt is None:
        raise SlurmUnavailable(
            f"SLURM is not installed ({', '.join(_missing())} missing) and apt-get is unavailable"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = [apt, "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    deadline = time.monotonic() + timeout_s
    last = ""
    for attempt in ("install", "update", "install"):
        command = install if attempt == "install" else [apt, "update", "-q"]
        left = deadline - time.monotonic()
        if left <= 5:
            break
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"`{' '.join(command)}` took longer than {timeout_s:.0f} s") from None
        last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [""])[-1]
        if attempt == "install" and proc.returncode == 0 and not _missing():
            return
    raise SlurmUnavailable(f"could not install {' '.join(PACKAGES)} with apt-get: {last}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_line(hostname: str) -> str:
    """NodeName=... CPUs=... RealMemory=... as slurmd -C sees this machine (memory: 90%)."""
    out = subprocess.run(
        [_which("slurmd") or "slurmd", "-C"], capture_output=True, text=True, timeout=60
    ).stdout
    first = next((ln for ln in out.splitlines() if ln.startswith("NodeName=")), "")
    fields = dict(re.findall(r"(\w+)=(\S+)", first))
    cpus = fields.get("CPUs", str(os.cpu_count() or 1))
    memory = int(int(fields.get("RealMemory", "2048")) * 0.9)
    topology = " ".join(
        f"{k}={fields[k]}"
        for k in ("Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
        if k in fields
    )
    # NodeAddr: the daemons talk over loopback even where the host name does not resolve
    return f"NodeName={hostname} NodeAddr=127.0.0.1 CPUs={cpus} {topology} RealMemory={memory} State=UNKNOWN"


class SlurmCluster:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="lmsys-slurm-"))
        self.root.chmod(0o755)  # munged wants its socket directory reachable by everyone
        self.hostname = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, Path] = {}

    # ------------------------------------------------------------------ daemons

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen:
        log = self.root / "log" / f"{name}.out"
        self._logs[name] = log
        with open(log, "wb") as handle:
            proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def _wait_for(self, what: str, check, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {proc.returncode}: {self.tail(name)}")
            if check():
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"{what} not ready after {timeout_s:.0f} s\n{self.tail()}")

    def start(self) -> SlurmCluster:
        for sub in ("log", "state", "spool", "munge"):
            (self.root / sub).mkdir()
        (self.root / "munge").chmod(0o755)
        key_dir = self.root / "munge-key"
        key_dir.mkdir(mode=0o700)
        key = key_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = self.root / "munge" / "munge.socket"
        self._spawn(
            "munged",
            [
                _which("munged") or "munged",
                "--foreground",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                "--num-threads=2",
            ],
        )
        self._wait_for("munged", socket_path.exists, 20)
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    f"ClusterName=lmsys{os.getpid()}",
                    f"SlurmctldHost={self.hostname}(127.0.0.1)",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={socket_path}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "SwitchType=switch/none",
                    "MpiDefault=none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "SchedulerType=sched/backfill",
                    "ReturnToService=2",
                    "MinJobAge=3600",
                    "KillWait=10",
                    node_line(self.hostname),
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        self._spawn("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-f", str(self.conf)])
        self._spawn("slurmd", [_which("slurmd") or "slurmd", "-D", "-f", str(self.conf)])
        self._wait_for("the SLURM node", self._node_idle, 60)
        return self

    def _node_idle(self) -> bool:
        proc = subprocess.run(
            [_which("sinfo") or "sinfo", "-h", "-o", "%t"],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        return proc.returncode == 0 and proc.stdout.strip().startswith("idle")

    def stop(self) -> None:
        try:
            if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
                subprocess.run(
                    [_which("scancel") or "scancel", "--user=root", "--full"],
                    env=self.env(),
                    capture_output=True,
                    timeout=30,
                )
                time.sleep(1)
        except (OSError, subprocess.SubprocessError):
            pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)

    def tail(self, name: str | None = None, lines: int = 15) -> str:
        names = [name] if name else list(self._logs)
        parts = []
        for n in names:
            for path in {self._logs.get(n), self.root / "log" / f"{n}.log"} - {None}:
                if path is not None and path.is_file():
                    text = path.read_text(errors="replace").splitlines()[-lines:]
                    parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # ------------------------------------------------------------------ jobs

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
        for key in list(env):  # a test run inside a SLURM job must not leak that job's identity
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_")) and key != "SLURM_CONF":
                env.pop(key)
        return env

    def sbatch(self, args: list[str], script: str | Path, script_args: list[str], env: dict[str, str]) -> str:
        proc = subprocess.run(
            [_which("sbatch") or "sbatch", "--parsable", *args, str(script), *script_args],
            env=self.env(env),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        proc = subprocess.run(
            [_which("scontrol") or "scontrol", "show", "job", "-o", job_id],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        command = [_which(args[0]) or args[0], *args[1:]]
        return subprocess.run(command, env=self.env(), capture_output=True, text=True, timeout=30)

    def signal_batch(self, job_id: str, signal_name: str) -> None:
        """Send a signal to the job's batch script only (what --signal=B:<sig>@<time> does)."""
        proc = self._run("scancel", f"--signal={signal_name}", "--batch", job_id)
        if proc.returncode != 0:
            raise RuntimeError(f"scancel --signal={signal_name} {job_id}: {proc.stderr.strip()}")

    def start_now(self, job_id: str, timeout_s: float = 60) -> None:
        """Make a requeued job eligible almost at once: SLURM holds one for about two minutes (its
        EligibleTime) before starting it again, so that the credential of its previous run, which
        slurmd revoked when it was killed, cannot be confused with the new one. Credentials carry
        their creation time in whole seconds: a start within the second of the revocation is
        refused ("Job credential revoked") and the job fails. So: wait for the job to be PENDING
        and the node idle (its previous run cleaned up), then for two more seconds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.job(job_id).get("JobState") == "PENDING" and self._node_idle():
                time.sleep(2)
                proc = self._run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
                if proc.returncode == 0:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} was not requeued within {timeout_s:.0f} s: {self.job(job_id)}")

    def wait(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """The job's fields once it reaches a terminal state (scontrol show job)."""
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in TERMINAL_STATES:
                return info
            time.sleep(1)
        subprocess.run(
            [_which("scancel") or "scancel", job_id], env=self.env(), capture_output=True, timeout=30
        )
        raise TimeoutError(f"job {job_id} did not finish in {timeout_s:.0f} s: {info}\n{self.tail()}")
