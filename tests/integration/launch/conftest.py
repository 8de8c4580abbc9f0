"""Fixtures for the launch tests: a small prepared dataset, the tiny model's overrides, child
process environments, and the one-machine SLURM cluster (tests marked `slurm`; deselect them with
`-m "not slurm"`). Every training run is real: DeepSpeed on CPU with gloo, started through the
launchers under test, with free ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.launch.slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_installed, free_port
from tests.sharing import made_once
from tests.stdlib_text import write_docstring_files

REPO_ROOT = Path(__file__).resolve().parents[3]
VOCAB = 512
SEQ = 32
MAX_STEPS = 6

# The tiny preset shrunk: 2 layers of width 32, vocabulary 512, sequences of 32 tokens, a global
# batch of 8 sequences (micro-batches of 4: one per rank on 2 ranks, accumulation 2 on 1 rank).
TINY = [
    f"model.vocab_size={VOCAB}",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    f"model.max_seq_len={SEQ}",
    f"data.seq_len={SEQ}",
    f"trainer.max_steps={MAX_STEPS}",
    f"trainer.global_batch_tokens={8 * SEQ}",
    "trainer.micro_batch_size=4",
    "trainer.eval_interval=3",
    "trainer.eval_batches=2",
    "trainer.save_interval=3",
    "trainer.progress=false",
    "trainer.dist_timeout_s=120",
    "trainer.hang_timeout_s=100",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "deepspeed=zero2",
    "logger=none",
    "logger.plot=false",  # loss.png: test_matrix.py::test_one_run_directory_with_everything
]

# Variables of an outer launcher, cluster or shell that would change what the launchers decide.
_LEAKY = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RDZV_ENDPOINT",
    "RDZV_ID",
    "RDZV_TIMEOUT",
    "NNODES",
    "NODE_RANK",
    "NPROC",
    "MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "WANDB_API_KEY",
    "RUN_DIR",
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slurm: needs a one-machine SLURM cluster (apt-installed when missing)"
    )


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LEAKY and not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        CUDA_VISIBLE_DEVICES="",  # CPU ranks even where a GPU is present
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    env.update(extra)
    return env


def run(command: list[str], timeout: float = 300, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT):
    return subprocess.run(
        command, cwd=cwd, env=env or child_env(), capture_output=True, text=True, timeout=timeout
    )


def launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.torchrun", *args]


def read_records(run_dir: Path, kind: str = "train") -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir)}


def run_meta(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def assert_trained(run_dir: Path, world_size: int | None = None, proc=None) -> dict[int, float]:
    got = losses(run_dir)
    context = "" if proc is None else f"\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert sorted(got) == list(range(1, MAX_STEPS + 1)), f"steps {sorted(got)} in {run_dir}{context}"
    assert got[MAX_STEPS] < got[1] - 0.05, f"loss did not fall: {got}{context}"
    if world_size is not None:
        assert run_meta(run_dir)["launches"][-1]["world_size"] == world_size
    return got


def one_error_line(stderr: str, prefix: str) -> str:
    """The stderr of a failed command holds exactly one line, and it starts with `prefix`."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr
    return lines[0]


def _write_corpus(directory: Path) -> None:
    """~200 KB of English text: docstrings of some standard-library modules."""
    modules = ["json", "argparse", "collections", "functools", "pathlib", "re", "typing", "datetime"]
    write_docstring_files(directory, modules)


@pytest.fixture(scope="session")
def prepared_data(tmp_path_factory) -> Path:
    """A dataset prepared with `python -m lmsys.prepare` (vocabulary 512), once for every worker of
    the session (tests/sharing.py)."""

    def make(root: Path) -> None:
        corpus, out = root / "corpus", root / "prepared"
        _write_corpus(corpus)
        proc = run(
            [
                sys.executable,
                "-m",
                "lmsys.prepare",
                f"data.sources=[{corpus}]",
                f"data.dir={out}",
                f"model.vocab_size={VOCAB}",
                "data.val_fraction=0.1",
            ]
        )
        assert proc.returncode == 0, proc.stderr

    return made_once(tmp_path_factory, "launch_data", make) / "prepared"


@pytest.fixture(scope="session")
def tiny(prepared_data) -> list[str]:
    """The overrides of every training run in these tests."""
    return [f"data.dir={prepared_data}", *TINY]


@pytest.fixture(scope="session")
def one_node(tiny, tmp_path_factory) -> dict[int, float]:
    """The reference losses: 2 processes on one node through the launcher (standalone rendezvous),
    uninterrupted, run once for every worker of the session. Multi-node, restarted and requeued
    runs of the same config must match them."""

    def make(root: Path) -> None:
        run_dir = root / "run"
        proc = run(launcher("--nproc", "2", "--", *tiny, f"trainer.run_dir={run_dir}"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "standalone rendezvous" in proc.stdout
        assert_trained(run_dir, world_size=2, proc=proc)

    return assert_trained(made_once(tmp_path_factory, "one_node", make) / "run", world_size=2)


@pytest.fixture(scope="session")
def slurm():
    """A running one-machine SLURM cluster; skipped, with the reason, only where SLURM cannot be
    installed (not root, no apt-get, apt failing) or when LMSYS_SKIP_SLURM=1 asks for it (the
    fixture installs Debian's slurmctld, slurmd and munge with apt-get when run as root)."""
    if os.environ.get("LMSYS_SKIP_SLURM") == "1":
        pytest.skip("LMSYS_SKIP_SLURM=1: the SLURM tests were asked to be skipped")
    try:
        ensure_installed()
        cluster = SlurmCluster()
    except SlurmUnavailable as exc:
        print(f"SLURM tests skipped: {exc}")
        pytest.skip(f"no SLURM here: {exc}")
    try:
        cluster.start()  # installed but not starting is a failure, not a skip
        yield cluster
    finally:
        cluster.stop()


__all__ = ["free_port"]
