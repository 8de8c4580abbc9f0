"""Fixtures for export / generate / eval tests.

Made once per session: a small prepared dataset (lmsys.prepare, vocabulary 512), a random-weight
export, real DeepSpeed checkpoints (tests/export/ds_checkpoints.py) of ZeRO stages 0-3 on 2
processes and of stages 2-3 on 1 process, each with the engine's own logits on fixed ids, and
one real training run through `torchrun -m lmsys.train` (the main job's shape: 2 processes,
ZeRO-2, the tiny preset with tied embeddings, shrunk). The three subprocess jobs start together
the first time any of them is needed, so their start-up costs overlap.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from tests.stdlib_text import write_docstring_files

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
VOCAB = 512
SEQ = 32
# The tiny preset (GPT-2's function, tied embeddings) shrunk to test size.
SMALL = [f"vocab_size={VOCAB}", "d_model=32", "n_layers=2", "n_heads=2", f"max_seq_len={SEQ}", "ffn.d_ff=64"]
# job name -> (world size, ZeRO stages checkpointed by ds_checkpoints.py, extra overrides)
DS_JOBS = {
    "w2": (2, "0,1,2,3", []),
    "w1": (1, "2,3", []),
    "w2-bf16": (2, "0,1,3", ["deepspeed.precision=bf16"]),  # GPU training's default precision
}
TRAIN_STEPS = 6
TRAIN_BATCH = 8  # sequences per optimizer step
SHORT_SEQ = 16  # short_run's data.seq_len, of model.max_seq_len=SEQ


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one token's forward is microseconds of work, and a second intra-op
    thread only adds synchronisation (badly so on a loaded 2-core machine). Restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    env["WANDB_MODE"] = "offline"
    env.pop("WANDB_API_KEY", None)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def cli_command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def run_cli(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m <module> args...` from the repository root."""
    return subprocess.run(
        cli_command(module, *args),
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


Name = TypeVar("Name", bound=Hashable)


def run_side_by_side(
    commands: dict[Name, tuple[list[str], dict[str, str]]], parallel: int = 4, timeout: float = 300
) -> dict[Name, subprocess.CompletedProcess]:
    """Several processes, up to `parallel` at a time so their start-up (importing torch) overlaps:
    {name: (argv, environment)} -> {name: result}."""
    pending = list(commands.items())
    running: dict[Name, subprocess.Popen] = {}
    results: dict[Name, subprocess.CompletedProcess] = {}
    while pending or running:
        while pending and len(running) < parallel:
            name, (argv, env) = pending.pop(0)
            running[name] = subprocess.Popen(
                argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        name = next(iter(running))
        proc = running.pop(name)
        out, err = proc.communicate(timeout=timeout)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def run_clis(
    calls: dict[str, list[str]], parallel: int = 4, timeout: float = 300
) -> dict[str, subprocess.CompletedProcess]:
    """Several CLI calls, each a fresh process as a user runs it, side by side:
    {name: [module, args...]} -> {name: result}."""
    commands = {name: (cli_command(*call), child_env()) for name, call in calls.items()}
    return run_side_by_side(commands, parallel, timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, prog: str, *fragments: str) -> str:
    """Exit status 2 and exactly one stderr line `prog: error: ...` containing the fragments."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert len(lines) == 1, f"expected one stderr line, got:\n{proc.stderr}"
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def small_config(preset: str = "tiny", extra: list[str] | None = None):
    from lmsys.core.config import compose_model

    return compose_model(preset, [*SMALL, *(extra or [])])


CORPUS_MODULES = ["json", "argparse", "collections", "functools", "itertools", "pathlib", "re", "os",
                  "textwrap", "string", "heapq", "bisect"]  # fmt: skip


def _write_corpus(directory: Path) -> None:
    write_docstring_files(directory, CORPUS_MODULES)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A prepared dataset (vocabulary 512, 20% validation) made by lmsys.prepare."""
    from lmsys.core.config import compose
    from lmsys.data.preparation import prepare

    root = tmp_path_factory.mktemp("export_data")
    corpus, out = root / "corpus", root / "prepared"
    _write_corpus(corpus)
    overrides = [f"data.sources=[{corpus}]", f"data.dir={out}", f"model.vocab_size={VOCAB}",
                 "data.val_fraction=0.2", "data.num_workers=1"]  # fmt: skip
    prepare(compose(overrides))
    return out


@pytest.fixture(scope="session")
def tokenizer_path(data_dir) -> Path:
    return data_dir / "tokenizer.model"


@pytest.fixture(scope="session")
def random_export(tmp_path_factory, tokenizer_path) -> Path:
    """An export (lmsys format) of a random-weight small tiny model."""
    from lmsys.interop.export_dir import write_export
    from lmsys.model.transformer import Transformer

    cfg = small_config()
    torch.manual_seed(0)
    model = Transformer(cfg)
    out = tmp_path_factory.mktemp("exports") / "random"
    return write_export(out, cfg, model.state_dict(), tokenizer_path, {"step": 0})


@pytest.fixture(scope="session")
def hf_export(tmp_path_factory, tokenizer_path) -> Path:
    """A format=hf export of a random-weight small tiny model with lmsys's SentencePiece tokenizer:
    config.json (GPT2Config), model.safetensors, tokenizer.model, tokenizer.json,
    tokenizer_config.json, generation_config.json, README.md."""
    from lmsys.interop.export_dir import write_export
    from lmsys.model.transformer import Transformer

    cfg = small_config()
    torch.manual_seed(3)
    model = Transformer(cfg)
    out = tmp_path_factory.mktemp("hf_exports") / "random-hf"
    return write_export(out, cfg, model.state_dict(), tokenizer_path, {"step": 0}, fmt="hf")


BPE_VOCAB = 384  # the byte-level BPE of hf_gpt2_dir: 256 bytes, 127 merges, <|endoftext|> last


@pytest.fixture(scope="session")
def hf_gpt2_dir(tmp_path_factory) -> Path:
    """A transformers GPT-2 directory as a user holds OpenAI's, at test size: a random
    GPT2LMHeadModel (n_embd 32, 2 layers, 2 heads, n_positions SEQ, every weight off its initial
    value) saved with save_pretrained, and a byte-level BPE trained with `tokenizers` on the test
    corpus's text (tokenizer.json, a tokenizer_config.json naming no special token)."""
    from tests.hf_files import random_gpt2, save_gpt2_directory, train_byte_level_bpe
    from tests.stdlib_text import module_docstrings

    texts = [doc for name in CORPUS_MODULES for doc in module_docstrings(name)]
    tokenizer = train_byte_level_bpe(texts, BPE_VOCAB)
    model = random_gpt2(BPE_VOCAB, tokenizer.token_to_id("<|endoftext|>"), n_positions=SEQ)
    out = tmp_path_factory.mktemp("hf_gpt2") / "gpt2-test"
    return save_gpt2_directory(out, model, tokenizer)


@pytest.fixture(scope="session")
def gpt2_import(tmp_path_factory, hf_gpt2_dir) -> Path:
    """`hf_gpt2_dir` imported by lmsys-import's function: an lmsys export of it."""
    from lmsys.interop.export_dir import import_checkpoint

    return import_checkpoint(hf_gpt2_dir, tmp_path_factory.mktemp("imports") / "gpt2-test")


# ----------------------------------------------------------------------------- subprocess jobs


@dataclass
class Job:
    name: str
    proc: subprocess.Popen
    out: Path
    result: tuple[int, str, str] | None = None

    def wait(self, timeout: float = 600) -> Path:
        if self.result is None:
            stdout, stderr = self.proc.communicate(timeout=timeout)
            self.result = (self.proc.returncode, stdout, stderr)
        code, stdout, stderr = self.result
        assert code == 0, f"{self.name} failed ({code}):\n{stdout[-3000:]}\n{stderr[-5000:]}"
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


JOB_FIXTURES = {"jobs", "ds_checkpoints", "trained_run", "short_run"}
HERE = Path(__file__).resolve().parent


def _mine(item) -> bool:
    return HERE in Path(item.path).resolve().parents


def _needs_jobs(item) -> bool:
    return bool(JOB_FIXTURES & set(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(session, config, items):
    """Within this directory's own slots of the session order (other directories' tests keep
    their places), run the tests that need no subprocess job first: they then run while the
    jobs, started by the first of them (_start_jobs_early), work in the background."""
    slots = [i for i, item in enumerate(items) if _mine(item)]
    mine = [items[i] for i in slots]
    ordered = [it for it in mine if not _needs_jobs(it)] + [it for it in mine if _needs_jobs(it)]
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


@pytest.fixture(scope="package", autouse=True)
def _start_jobs_early(request):
    """At this directory's first test (on the one worker that runs tests/export under xdist)."""
    if any(_mine(item) and _needs_jobs(item) for item in request.session.items):
        request.getfixturevalue("jobs")


@pytest.fixture(scope="session")
def jobs(tmp_path_factory, data_dir) -> dict[str, Job]:
    """Start the DeepSpeed checkpoint writers and the training run side by side."""
    root = tmp_path_factory.mktemp("ds_checkpoints")
    model = [f"model.{o}" for o in SMALL]
    started: dict[str, Job] = {}
    for name, (world, stages, extra) in DS_JOBS.items():
        out = root / name
        overrides = [
            *extra,
            *model,
            f"data.seq_len={SEQ}",
            "trainer.micro_batch_size=2",
            f"trainer.global_batch_tokens={4 * SEQ}",
        ]
        script = str(Path(__file__).with_name("ds_checkpoints.py"))
        proc = _torchrun(world, script, str(out), str(data_dir), stages, *overrides)
        started[name] = Job(f"ds_checkpoints.py {name} on {world} process(es)", proc, out)
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    overrides = [
        "model=tiny", *model, "deepspeed=zero2", f"data.dir={data_dir}", f"trainer.max_steps={TRAIN_STEPS}",
        f"trainer.global_batch_tokens={TRAIN_BATCH * SEQ}", "trainer.micro_batch_size=4",
        "trainer.eval_interval=3", "trainer.eval_batches=2", "trainer.save_interval=3",
        "trainer.progress=false", "trainer.dist_timeout_s=120", "trainer.hang_timeout_s=100",
        "optim.lr=3e-3", "optim.warmup_steps=2", "logger=none", "logger.plot=false",
        f"trainer.run_dir={run_dir}",
    ]  # fmt: skip
    started["train"] = Job("torchrun -m lmsys.train", _torchrun(2, "-m", "lmsys.train", *overrides), run_dir)
    short_dir = tmp_path_factory.mktemp("trained_short") / "run"
    short = [  # trained at data.seq_len=SHORT_SEQ of model.max_seq_len=SEQ positions (one process)
        "model=tiny", *model, f"data.seq_len={SHORT_SEQ}", f"data.dir={data_dir}", "trainer.max_steps=2",
        f"trainer.global_batch_tokens={4 * SHORT_SEQ}", "trainer.micro_batch_size=4",
        "trainer.eval_interval=2", "trainer.eval_batches=1", "trainer.save_interval=2",
        "trainer.progress=false", "logger=none", "logger.plot=false", f"trainer.run_dir={short_dir}",
    ]  # fmt: skip
    short_proc = _torchrun(1, "-m", "lmsys.train", *short)
    started["short"] = Job("python -m lmsys.train (short)", short_proc, short_dir)
    yield started
    for job in started.values():
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.communicate()


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
