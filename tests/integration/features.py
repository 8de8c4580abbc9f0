"""The integration tier's matrix of short real training runs, as torchtitan's
integration_tests/features.py keeps its own: LAUNCHES, a flat table of named override sets (each
one launch: a process count, its overrides, the cases it produces; a Hydra sweep, `-m`, produces
several cases in one launch and pays the start-up once), and its runner, RunCache, which launches
each at most once per session (for every xdist worker) and hands the runs to the tests by case
name (tests/integration/training/test_matrix.py and the modules beside it compare them). With the
process helpers the training tests share: child environments, launch commands, kill -9 at a
chosen moment.

Every run is the real CLI in a subprocess: `python -m lmsys.train` for one process,
`torchrun --nproc_per_node=2 -m lmsys.train` (on a free master port) for two. The model is the
tiny preset shrunk to d_model 32, 2 layers, vocabulary 512, sequences of 32 tokens; the global
batch is 8 sequences whatever the number of processes, so every run sees the same samples.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from filelock import FileLock

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
VOCAB = 512
SEQ = 32
MAX_STEPS = 6
FAKE_WANDB_KEY = "lmsys-test-not-a-real-key-0123456789abcdef"

# The shared shape of every matrix run (1 process: micro-batch 8; 2 processes: 4 each).
COMMON = [
    f"model.vocab_size={VOCAB}",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    f"model.max_seq_len={SEQ}",
    "model.ffn.d_ff=64",
    f"trainer.max_steps={MAX_STEPS}",
    f"trainer.global_batch_tokens={8 * SEQ}",
    "trainer.eval_interval=3",
    "trainer.eval_batches=2",
    "trainer.save_interval=2",
    "trainer.keep_last=3",
    "trainer.progress=false",
    "trainer.dist_timeout_s=120",
    "trainer.hang_timeout_s=100",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "logger=none",
    "logger.plot=false",  # loss.png: test_matrix.py::test_one_run_directory_with_everything
    "deepspeed.param_persistence_threshold=0",  # ZeRO-3 partitions even these small matrices
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # 2 processes on 2 cores; also keeps 1-process math comparable
    env["PYTHONUNBUFFERED"] = "1"
    # runs start in a scratch directory (Hydra's runs/.multirun lands there), lmsys from this checkout
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("WANDB_API_KEY", None)
    env["WANDB_MODE"] = "offline"  # belt and braces: no test ever talks to the network
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def start_job(command: list[str], cwd: Path, stdout: int = subprocess.PIPE) -> subprocess.Popen:
    """A command started in a session of its own, as a terminal's foreground job: its process
    group can be signalled or killed whole (stderr piped, text)."""
    return subprocess.Popen(
        command, cwd=cwd, env=child_env(), stdout=stdout, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def train_command(
    nproc: int, overrides: list[str], max_restarts: int = 0, module: str = "lmsys.train"
) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", module, *overrides]
    return [
        TORCHRUN,
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        f"--max_restarts={max_restarts}",
        "--monitor_interval=0.5",
        "-m",
        module,
        *overrides,
    ]


def wait_until(proc: subprocess.Popen, what: str, ready: Callable[[], bool], timeout_s: float = 300) -> None:
    """Poll ready() until it holds; the test fails (and the job is killed) if the job ends first or
    timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {what}:\n{proc.stderr.read() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no {what} within {timeout_s} s")
        time.sleep(0.02)


def kill9_when(
    overrides: list[str], root: Path, what: str, ready: Callable[[Path], bool], timeout_s: float = 300
) -> tuple[Path, list[int], list[int]]:
    """A 2-process run in root/run, and SIGKILL to its torchrun launcher's process group as soon as
    ready(run_dir) holds. torchrun starts each worker in its own session, so the workers only die
    because lmsys.train asks the kernel to kill them with their parent (PR_SET_PDEATHSIG); any
    survivor is killed here and reported to the caller.
    Returns (run_dir, steps logged before the kill, pids of workers that outlived the launcher)."""
    import psutil

    from lmsys.core.rundir import read_metrics

    run_dir = root / "run"
    command = train_command(2, [*overrides, f"trainer.run_dir={run_dir}"])
    proc = start_job(command, root, stdout=subprocess.DEVNULL)
    workers: list = []
    try:
        wait_until(proc, what, lambda: ready(run_dir), timeout_s)
        workers = psutil.Process(proc.pid).children(recursive=True)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    _, survivors = psutil.wait_procs(workers, timeout=20)
    for p in survivors:
        p.kill()
    psutil.wait_procs(survivors, timeout=20)
    steps = [r["step"] for r in read_metrics(run_dir, "train")]
    return run_dir, steps, [p.pid for p in survivors]


def kill9_after_checkpoint(
    overrides: list[str], root: Path, step: int = 4
) -> tuple[Path, list[int], list[int]]:
    """kill9_when checkpoint `step` is committed, the run slowed to 1 s per step so that the kill
    lands before the next one."""
    from lmsys.engine import checkpoint as ckpt

    def committed(run_dir: Path) -> bool:
        return (run_dir / ckpt.CHECKPOINTS / ckpt.tag_for(step) / ckpt.MARKER).exists()

    slowed = [*overrides, "debug.step_delay_s=1.0"]
    return kill9_when(slowed, root, f"checkpoint {step}", committed)


@dataclass
class Run:
    name: str
    run_dir: Path
    returncode: int
    stdout: str
    stderr: str
    overrides: list[str] = field(default_factory=list)

    def records(self, kind: str = "train") -> list[dict]:
        from lmsys.core.rundir import read_metrics

        return read_metrics(self.run_dir, kind)

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records("train")}

    def stats(self) -> dict:
        return json.loads((self.run_dir / "engine_stats.json").read_text())

    def check(self) -> Run:
        assert self.returncode == 0, f"{self.name} failed ({self.returncode})\n{self.stdout}\n{self.stderr}"
        return self


def run_train(
    name: str,
    nproc: int,
    overrides: list[str],
    run_dir: Path,
    cwd: Path | None = None,
    timeout: float = 300,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
) -> Run:
    all_overrides = [
        *overrides,
        f"trainer.run_dir='{run_dir}'" if "${" in str(run_dir) else f"trainer.run_dir={run_dir}",
    ]
    proc = subprocess.run(
        train_command(nproc, all_overrides, max_restarts),
        cwd=cwd or REPO_ROOT,
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(name, run_dir, proc.returncode, proc.stdout, proc.stderr, all_overrides)


@dataclass(frozen=True)
class Launch:
    """One process launch; `sweep` launches run several matrix cases as one Hydra multirun
    (`-m`), which pays the start-up (imports, process group) once for all of them."""

    nproc: int
    overrides: tuple[str, ...]
    cases: tuple[str, ...]  # the case names it produces, in run_dir order
    run_dir: str  # a run_dir pattern relative to the cache root (may interpolate the sweep keys)


LAUNCHES: dict[str, Launch] = {
    "one": Launch(
        1,
        ("trainer.micro_batch_size=8", "logger=wandb_offline", "logger.log_interval=2", "logger.plot=true"),
        ("1proc",),
        "1proc",
    ),
    # 2 processes with ZeRO 0, 1, 2, 3 (micro-batches of 4: no accumulation)
    "zero": Launch(
        2,
        ("-m", "deepspeed=zero0,zero1,zero2,zero3", "trainer.micro_batch_size=4", "logger.plot=true"),
        ("2proc-zero0", "2proc-zero1", "2proc-zero2", "2proc-zero3"),
        "2proc-zero${deepspeed.stage}",
    ),
    # ZeRO-3 with optimizer state and parameters offloaded (DeepSpeed's offload path; on a CPU
    # device the memory stays where it was, but the partitioning and update code is the real one)
    "offload": Launch(
        2,
        ("deepspeed=zero3_offload", "trainer.micro_batch_size=4", "trainer.keep_last=1"),
        ("2proc-zero3-offload",),
        "2proc-zero3-offload",
    ),
    # gradient accumulation 2 (micro-batches of 2 on each of 2 ranks) with activation
    # checkpointing, at ZeRO-3, for the tiny preset and for seed_gpt (tied W_U = W_E, no norms)
    "accum": Launch(
        2,
        (
            "-m",
            "model=tiny,seed_gpt",
            "deepspeed=zero3",
            "trainer.micro_batch_size=2",
            "deepspeed.activation_checkpointing=true",
        ),
        ("2proc-zero3-accum2-actckpt-tiny", "2proc-zero3-accum2-actckpt-seed_gpt"),
        "2proc-zero3-accum2-actckpt-${model.name}",
    ),
}
# The fused Triton loss (under the interpreter on CPU) at ZeRO-0 and ZeRO-3 on 2 ranks, tied
# embeddings (tiny), and on 1 process; every other run uses model.loss_impl=auto (chunked on CPU).
LAUNCHES["fused"] = Launch(
    2,
    ("-m", "deepspeed=zero0,zero3", "trainer.micro_batch_size=4", "model.loss_impl=fused"),
    ("2proc-zero0-fused", "2proc-zero3-fused"),
    "2proc-zero${deepspeed.stage}-fused",
)
LAUNCHES["fused1"] = Launch(
    1, ("trainer.micro_batch_size=8", "model.loss_impl=fused"), ("1proc-fused",), "1proc-fused"
)
# torch.compile (inductor) on 2 ranks at ZeRO-2 (the loss module) and ZeRO-3 (each block), one
# sweep in one process per rank, against the eager 2proc-zero2 and 2proc-zero3 runs
LAUNCHES["compiled"] = Launch(
    2,
    ("-m", "deepspeed=zero2,zero3", "trainer.micro_batch_size=4", "trainer.compile=true"),
    ("2proc-zero2-compiled", "2proc-zero3-compiled"),
    "2proc-zero${deepspeed.stage}-compiled",
)
# optim=muon (DeepSpeed's MuonWithAuxAdam) at ZeRO 0-3 on 2 ranks, one sweep, against 1 process;
# with the warmup-stable-decay schedule (decaying over the last 3 of 6 steps)
MUON = ("optim=muon", "optim.schedule=wsd", "optim.decay_frac=0.5")
LAUNCHES["muon"] = Launch(
    2,
    ("-m", "deepspeed=zero0,zero1,zero2,zero3", "trainer.micro_batch_size=4", *MUON),
    ("2proc-zero0-muon", "2proc-zero1-muon", "2proc-zero2-muon", "2proc-zero3-muon"),
    "2proc-zero${deepspeed.stage}-muon",
)
# ... and on 1 process at ZeRO-2 (the reference) and ZeRO-3 with everything offloaded
LAUNCHES["muon1"] = Launch(
    1,
    ("-m", "deepspeed=zero2,zero3_offload", "trainer.micro_batch_size=8", *MUON),
    ("1proc-muon-zero2", "1proc-muon-zero3"),
    "1proc-muon-zero${deepspeed.stage}",
)
# data.document_masking=true (each packed document its own sequence) on 1 process, and on 2 ranks
# at ZeRO-2 and ZeRO-3 with activation checkpointing, one sweep
# (tests/integration/training/test_document_masking.py)
DOCUMENTS = ("data.document_masking=true",)
LAUNCHES["documents1"] = Launch(
    1, ("trainer.micro_batch_size=8", *DOCUMENTS), ("1proc-documents",), "1proc-documents"
)
LAUNCHES["documents"] = Launch(
    2,
    ("-m", "deepspeed=zero2,zero3", "trainer.micro_batch_size=4", "deepspeed.activation_checkpointing=true",
     *DOCUMENTS),
    ("2proc-zero2-documents", "2proc-zero3-documents"),
    "2proc-zero${deepspeed.stage}-documents",
)  # fmt: skip
# Ulysses sequence parallelism (tests/integration/training/test_sequence_parallel.py): one group of 2 ranks
# (trainer.sequence_parallel=2) at ZeRO-0 and ZeRO-3, for the GPT-2 family (tiny) and the Llama
# family (llama_tiny: rotary positions, RMS norm, SwiGLU, 4 query heads over 2 key/value heads),
# packed documents masked, one sweep, against 1 process (one sweep of both models)
ULYSSES = ("trainer.sequence_parallel=2", "model.n_heads=4", *DOCUMENTS)
LAUNCHES["ulysses"] = Launch(
    2,
    ("-m", "deepspeed=zero0,zero3", "model=tiny,llama_tiny", "trainer.micro_batch_size=8", *ULYSSES),
    ("ulysses-zero0-tiny", "ulysses-zero0-llama_tiny", "ulysses-zero3-tiny", "ulysses-zero3-llama_tiny"),
    "ulysses-zero${deepspeed.stage}-${model.name}",
)
LAUNCHES["ulysses1"] = Launch(
    1, ("-m", "model=tiny,llama_tiny", "model.n_heads=4", "trainer.micro_batch_size=8", *DOCUMENTS),
    ("1proc-documents-heads4-tiny", "1proc-documents-heads4-llama_tiny"),
    "1proc-documents-heads4-${model.name}",
)  # fmt: skip
# ... and 4 ranks: 2 groups of 2 (data parallel 2), accumulation 2, activation checkpointing,
# ZeRO-3 and optim=muon, against 1proc-muon-zero2
LAUNCHES["ulysses4"] = Launch(
    4,
    ("deepspeed=zero3", "trainer.micro_batch_size=2", "trainer.sequence_parallel=2",
     "deepspeed.activation_checkpointing=true", *MUON),
    ("ulysses4-zero3-accum2-actckpt-muon",),
    "ulysses4-zero3-accum2-actckpt-muon",
)  # fmt: skip
CASES = {case: launch for launch, spec in LAUNCHES.items() for case in spec.cases}


# Runs whose CPU tensors are traced, each rank's peak through its second step (the planner bench's
# probe, tools.bench.plan.tensor_trace): the activation memory per rank at P=1 and P=2, sequences
# of T=512 and 4T on 2 ranks, micro-batches of 1 sequence, ZeRO-0 (test_sequence_parallel.py)
MEMORY = ("model.d_model=64", "model.ffn.d_ff=128", "model.max_seq_len=2048", "trainer.max_steps=2",
          "trainer.micro_batch_size=1", "trainer.global_batch_tokens=4096", "trainer.eval_batches=1",
          "deepspeed=zero0")  # fmt: skip
TRACED = {
    f"ulysses-memory-p{p}-t{t}": (2, (*MEMORY, f"trainer.sequence_parallel={p}", f"data.seq_len={t}"))
    for p in (1, 2)
    for t in (512, 2048)
}


def data_overrides(data_dir: Path) -> list[str]:
    return [f"data.dir={data_dir}", *COMMON]


class RunCache:
    """Runs each launch at most once per session; tests share the results by case name."""

    def __init__(self, root: Path, data_dir: Path) -> None:
        self.root, self.data_dir = root, data_dir
        self._runs: dict[str, Run] = {}

    def overrides(self, case: str) -> list[str]:
        """The overrides of one case as a plain (non-sweep) run would take them."""
        spec = LAUNCHES[CASES[case]]
        plain = [o for o in spec.overrides if o != "-m" and "," not in o]
        if case.endswith("seed_gpt"):
            plain.append("model=seed_gpt")
        elif case.endswith("-tiny"):
            plain.append("model=tiny")
        elif case.endswith("-llama_tiny") and "model=llama_tiny" not in plain:
            plain.append("model=llama_tiny")
        for o in spec.overrides:
            if o.startswith("deepspeed=zero") and "," in o:  # a sweep over stages: this case's
                stage = re.search(r"zero(\d)", case)
                assert stage is not None
                plain.append("deepspeed=" + next(v for v in o[10:].split(",") if v[4] == stage.group(1)))
        return [*data_overrides(self.data_dir), *plain]

    def traced_peaks(self, case: str) -> list[dict[str, int]]:
        """Each rank's traced peak of a TRACED case, {"bytes", "unseen_bytes"} (the probe's), run
        once a session."""
        nproc, overrides = TRACED[case]
        probe = self.root / f"{case}.peak"
        with FileLock(self.root / f"{case}.lock"):
            if not list(self.root.glob(f"{probe.name}.rank*")):
                run_dir = self.root / case
                args = [str(probe), *self.traced_overrides(case), f"trainer.run_dir={run_dir}"]
                command = train_command(nproc, args, module="tools.bench.plan.tensor_trace")
                proc = subprocess.run(
                    command, cwd=self.root, env=child_env(), capture_output=True, text=True, timeout=300
                )
                assert proc.returncode == 0, f"{case} failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        peaks = [json.loads(p.read_text()) for p in sorted(self.root.glob(f"{probe.name}.rank*"))]
        assert len(peaks) == nproc, (case, peaks)
        return peaks

    def traced_overrides(self, case: str) -> list[str]:
        return [*data_overrides(self.data_dir), *TRACED[case][1]]

    def get(self, case: str) -> Run:
        if case not in self._runs:
            name = CASES[case]
            spec = LAUNCHES[name]
            # one launch for the whole session: the first worker to need it runs it, the others
            # wait for it and read its outcome (tests/conftest.py: shared_dir)
            with FileLock(self.root / f"{name}.lock"):
                outcome = self.root / f"{name}.outcome.json"
                if not outcome.is_file():
                    env = child_env()
                    env["WANDB_API_KEY"] = FAKE_WANDB_KEY  # must never reach a file or the output
                    flags = [o for o in spec.overrides if o.startswith("-")]  # Hydra's -m goes first
                    rest = [o for o in spec.overrides if not o.startswith("-")]
                    overrides = [*flags, *data_overrides(self.data_dir), *rest]
                    run = run_train(
                        name, spec.nproc, overrides, self.root / spec.run_dir, env=env, cwd=self.root
                    )
                    done = [run.returncode, run.stdout, run.stderr, run.overrides]
                    outcome.write_text(json.dumps(done), encoding="utf-8")
                returncode, stdout, stderr, overrides = json.loads(outcome.read_text(encoding="utf-8"))
            for c in spec.cases:
                self._runs[c] = Run(c, self.root / c, returncode, stdout, stderr, overrides)
        return self._runs[case]


def copy_run(run: Run, dest: Path) -> Path:
    shutil.copytree(run.run_dir, dest, ignore=shutil.ignore_patterns("wandb"))
    return dest
