"""The plan against measured runs: `python -m tools.bench plan [smoke=true] [held_out=true]`.

Runs a grid of real short CPU trainings (`python -m lmsys.train`'s training, one process per rank
under `torchrun --nproc_per_node=2` for 2 ranks; presets tiny, llama_tiny, seed_trax, seed_postln,
seed_compact, gpt2_124m with vocabularies of at most 8192; ZeRO 0-3 and 3 with offload; micro-batches
1-8; activation checkpointing on and off; loss_impl full and chunked; packed documents; accumulation
2) and prints,
per row, the plan's tensors per rank (lmsys-plan on this machine's CPU) beside the peak of the
tensors the run allocated (`TensorPeak`, the largest rank's, through its second step), with the
error, the worst and the median. held_out=true runs five rows of smollm2_135m, a preset in no grid
row; smoke=true three small 1-rank rows. predict=true prints the GPT-2 GPU prediction table of
docs/planning.md instead (no runs), context=true its longest-context table under sequence
parallelism (no runs). Data: a synthetic prepared directory per vocabulary
(tools.bench.train's), so no corpus is needed.

The measurement is CUDA's max_memory_allocated on a CPU: torch's profiler reports every
allocation of c10's CPU allocator and every free made on a thread it follows (this one and the
autograd engine's); the running sum of the live blocks in time order gives the peak. A block a
gloo worker thread frees goes unseen: it counts until its address is allocated again, which bounds
the peak from above, and it cannot have been freed before the last op that read it, which bounds it
from below; a row is within 10% when the plan is within 10% of [measured - unseen, measured].
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lmsys.cli import Option, parse_options, run_cli
from lmsys.core.config import compose
from lmsys.core.devices import cpu_device, device_spec
from lmsys.planning.planner import plan_launch
from lmsys.planning.report import mib
from tools.bench.train import write_synthetic_data

PROG = "tools.bench plan"
OPTIONS = [
    Option("smoke", "bool", False, "three small 1-rank rows only"),
    Option("held_out", "bool", False, "the held-out rows instead: smollm2_135m, a preset in no grid row"),
    Option("steps", "int", 3, "optimizer steps per run (the trace takes steps 1-2)"),
    Option("only", "str", None, "run the rows whose name contains this"),
    Option("timeout", "int", 900, "seconds per run"),
    Option("predict", "bool", False, "print the GPU prediction table of docs/planning.md instead (no runs)"),
    Option("context", "bool", False, "print docs/planning.md's longest context per GPU instead (no runs)"),
]
# The shrunk presets: (vocabulary, overrides).
SHRINK = {
    "tiny": (2048, []),
    "llama_tiny": (2048, []),
    "seed_trax": (8192, []),
    "seed_postln": (8192, []),
    "seed_compact": (8192, []),
    "gpt2_124m": (8192, ["model.vocab_size=8192"]),
    "smollm2_135m": (8192, ["model.vocab_size=8192"]),
}


@dataclass(frozen=True)
class Row:
    preset: str
    world: int
    stage: int
    micro: int
    seq: int = 128
    checkpointing: bool = False
    loss_impl: str = "chunked"
    offload: bool = False
    documents: bool = False  # packed documents (data.document_masking)

    @property
    def name(self) -> str:
        stage = f"z{self.stage}{'off' if self.offload else ''}"
        bits = [self.preset, f"w{self.world}", stage, f"mb{self.micro}", f"T{self.seq}", self.loss_impl]
        bits += ["ckpt"] if self.checkpointing else []
        return "-".join(bits + (["docs"] if self.documents else []))

    def overrides(self, data_root: Path) -> list[str]:
        vocab, extra = SHRINK[self.preset]
        return [
            f"model={self.preset}",
            *extra,
            f"data.dir={data_root / f'data{vocab}'}",
            f"data.seq_len={self.seq}",
            f"deepspeed={'zero3_offload' if self.offload else f'zero{self.stage}'}",
            f"deepspeed.activation_checkpointing={str(self.checkpointing).lower()}",
            f"model.loss_impl={self.loss_impl}",
            f"data.document_masking={str(self.documents).lower()}",
            f"trainer.micro_batch_size={self.micro}",
            f"trainer.global_batch_tokens={self.micro * self.world * self.seq * 2}",  # accumulation 2
            "trainer.eval_batches=1",
            "trainer.eval_interval=1000",
            "trainer.save_interval=1000",
            "trainer.keep_last=1",
            "trainer.progress=false",
            "optim.warmup_steps=1",
            "logger=none",
        ]


GRID = [
    Row("tiny", 1, 0, 8, loss_impl="full"),
    Row("tiny", 1, 0, 8),
    Row("tiny", 1, 1, 4),
    Row("tiny", 1, 2, 4, checkpointing=True),
    Row("tiny", 1, 3, 2),
    Row("tiny", 2, 0, 4),
    Row("tiny", 2, 1, 4, loss_impl="full"),
    Row("tiny", 2, 2, 4),
    Row("tiny", 2, 3, 4),
    Row("tiny", 2, 3, 4, offload=True),
    Row("tiny", 2, 3, 1, checkpointing=True),
    Row("llama_tiny", 1, 0, 8, loss_impl="full"),
    Row("llama_tiny", 1, 2, 4, checkpointing=True),
    Row("llama_tiny", 2, 1, 4),
    Row("llama_tiny", 2, 3, 2),
    Row("llama_tiny", 2, 2, 4, documents=True),
    Row("seed_trax", 1, 0, 2),
    Row("seed_trax", 1, 2, 4, checkpointing=True),
    Row("seed_trax", 2, 1, 2),
    Row("seed_trax", 2, 3, 2),
    Row("seed_postln", 1, 1, 4, loss_impl="full"),
    Row("seed_postln", 2, 0, 2),
    Row("seed_postln", 2, 2, 8, checkpointing=True),
    Row("seed_postln", 2, 3, 2, offload=True),
    Row("seed_compact", 1, 3, 2),
    Row("seed_compact", 2, 0, 4, loss_impl="full"),
    Row("seed_compact", 2, 2, 2, seq=256),
    Row("seed_compact", 2, 3, 8, checkpointing=True),
    Row("gpt2_124m", 1, 0, 1),
    Row("gpt2_124m", 2, 3, 2, seq=256, checkpointing=True),
]
# A preset in no GRID row, of the family no CPU row was fitted to.
HELD_OUT = [
    Row("smollm2_135m", 1, 0, 2),
    Row("smollm2_135m", 1, 3, 1, checkpointing=True),
    Row("smollm2_135m", 2, 2, 1, loss_impl="full"),
    Row("smollm2_135m", 2, 3, 1, offload=True),
    Row("smollm2_135m", 2, 1, 2, seq=64, checkpointing=True),
]
SMOKE = [
    Row("tiny", 1, 0, 4, seq=64, loss_impl="full"),
    Row("llama_tiny", 1, 2, 4, seq=64, documents=True),
    Row("tiny", 1, 3, 2, seq=64),
]


def child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def command(world: int, probe: Path, overrides: list[str]) -> list[str]:
    """The probe (tensor_trace.py) on 1 rank, or on 2 under torchrun."""
    args = ["-m", "tools.bench.plan.tensor_trace", str(probe), *overrides]
    if world == 1:
        return [sys.executable, *args]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", f"--nproc_per_node={world}", *args]


def measure(row: Row, root: Path, steps: int, timeout: int) -> dict[str, Any]:
    """One row: the plan, then the real run; the plan's tensors beside the largest rank's peak."""
    overrides = row.overrides(root)
    plan = plan_launch(compose(overrides), row.world, cpu_device(), suggest=False)
    result: dict[str, Any] = {"row": row.name, "predicted_bytes": plan.tensor_bytes}
    result["peak_phase"] = plan.peak_phase
    run_dir, probe = root / "runs" / row.name, root / "runs" / f"{row.name}.peak"
    proc = subprocess.run(
        command(row.world, probe, [*overrides, f"trainer.max_steps={steps}", f"trainer.run_dir={run_dir}"]),
        env=child_env(),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    shutil.rmtree(run_dir, ignore_errors=True)  # its final checkpoint: 1.4 GB for gpt2_124m
    peaks = [json.loads(p.read_text()) for p in sorted(probe.parent.glob(f"{probe.name}.rank*"))]
    if proc.returncode != 0 or len(peaks) != row.world:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {**result, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    largest = max(peaks, key=lambda p: p["bytes"])
    measured, unseen = largest["bytes"], largest["unseen_bytes"]
    low = measured - unseen
    inside = low * 0.9 <= plan.tensor_bytes <= measured * 1.1
    return {**result, "measured_bytes": measured, "unseen_bytes": unseen, "within": inside,
            "memory_error": plan.tensor_bytes / measured - 1}  # fmt: skip


def report(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'row':<44} {'predicted':>11} {'measured':>11} {'unseen':>9} {'error':>7} {'at':<8}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['row']:<44} failed: {r['error']}")
            continue
        lines.append(
            f"{r['row']:<44} {mib(r['predicted_bytes']):>11} {mib(r['measured_bytes']):>11} "
            f"{mib(r['unseen_bytes']):>9} {r['memory_error']:>+7.1%} {r['peak_phase']:<8}"
        )
    done = [r for r in rows if "error" not in r]
    if done:
        errors = [abs(r["memory_error"]) for r in done]
        lines.append(
            f"memory: worst {max(errors):.1%}, median {statistics.median(errors):.1%}, "
            f"{sum(e <= 0.10 for e in errors)} of {len(done)} rows within 10% of the measured peak, "
            f"{sum(r['within'] for r in done)} of {len(done)} within 10% of [measured - unseen, measured]"
        )
    return "\n".join(lines)


PREDICT_MODELS = ("gpt2_124m", "gpt2_350m", "gpt2_774m", "gpt2_1558m")
PREDICT_DEVICES = ("a100-80gb", "h100")


def largest_micro(base: Any, world: int, device: Any) -> tuple[int, Any]:
    """The largest power-of-two micro-batch (<= 64, splitting the global batch) that fits, and its plan."""
    best: tuple[int, Any] = (0, None)
    for micro in (1, 2, 4, 8, 16, 32, 64):
        cfg = replace(base, trainer=replace(base.trainer, micro_batch_size=micro))
        if (cfg.trainer.global_batch_tokens // cfg.data.seq_len) % (micro * world):
            break
        plan = plan_launch(cfg, world, device, suggest=False)
        if not plan.fits:
            break
        best = (micro, plan)
    return best


def prediction_table() -> str:
    """gpt2_124m..gpt2_1558m x ZeRO 0-3 x world 1/8/64 at T=1024 (trainer=gpt2's 524,288-token
    global batch): per-GPU peak at micro-batch 1, the largest micro-batch that fits, its tokens/s."""
    lines = [
        "| model | ZeRO | world | device | peak per GPU at micro 1 | largest micro that fits | peak there "
        "| predicted tokens/s (all GPUs) | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model in PREDICT_MODELS:
        composed = compose([f"model={model}", "trainer=gpt2", "optim=gpt2"])
        for stage in range(4):
            base = replace(composed, deepspeed=replace(composed.deepspeed, stage=stage))
            for world in (1, 8, 64):
                for name in PREDICT_DEVICES:
                    device = device_spec(name)
                    one = replace(base, trainer=replace(base.trainer, micro_batch_size=1))
                    at_one = plan_launch(one, world, device, suggest=False)
                    micro, plan = largest_micro(base, world, device)
                    cells = [model, f"{stage}", f"{world}", name, mib(at_one.peak_bytes)]
                    if plan is None:
                        cells += ["none", "-", "-", "-"]
                    else:
                        speed = f"{plan.tokens_per_s:,.0f}"
                        cells += [f"{micro}", mib(plan.peak_bytes), speed, f"{plan.mfu:.0%}"]
                    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


CONTEXT_MODELS = ("llama3_2_1b", "gpt2_350m")
CONTEXT_STEP = 8192  # the table's contexts are multiples of this many tokens


def context_plan(model: str, size: int, length: int, world: int = 8) -> Any:
    """The plan of one sequence per group and step of `length` tokens on `world` H100s at
    sequence-parallel size `size`: ZeRO-3, activation checkpointing, the configured loss."""
    cfg = compose([f"model={model}", f"data.seq_len={length}", f"model.max_seq_len={length}",
                   f"trainer.sequence_parallel={size}", "trainer.micro_batch_size=1",
                   f"trainer.global_batch_tokens={world * length // size}", "deepspeed=zero3",
                   "deepspeed.activation_checkpointing=true"])  # fmt: skip
    return plan_launch(cfg, world, device_spec("h100"), suggest=False)


def context_table() -> str:
    """Per model and P = 1, 2, 4, 8 on 8 H100: the longest multiple of CONTEXT_STEP tokens whose
    predicted peak fits (a bisection over the plan's peak, which grows with the context)."""
    lines = [
        "| model | P | longest T | predicted peak per GPU | predicted step time | tokens/s (all GPUs) |",
        "|---|---|---|---|---|---|",
    ]
    for model in CONTEXT_MODELS:
        for size in (1, 2, 4, 8):
            low, high = 0, 1
            while context_plan(model, size, high * CONTEXT_STEP).fits:
                low, high = high, 2 * high
            while high - low > 1:  # low fits (or is 0), high does not
                middle = (low + high) // 2
                low, high = (
                    (middle, high) if context_plan(model, size, middle * CONTEXT_STEP).fits else (low, middle)
                )
            if low == 0:
                lines.append(f"| {model} | {size} | none | - | - | - |")
                continue
            plan = context_plan(model, size, low * CONTEXT_STEP)
            lines.append(
                f"| {model if size == 1 else ''} | {size} | {low * CONTEXT_STEP:,} | "
                f"{plan.peak_bytes / 2**30:.2f} GiB | {plan.step_time_s:,.0f} s | {plan.tokens_per_s:,.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts = parse_options(PROG, argv, OPTIONS, __doc__ or "")
        if opts is None:
            return 0
        if opts["predict"] or opts["context"]:
            print(prediction_table() if opts["predict"] else context_table())
            return 0
        rows = SMOKE if opts["smoke"] else HELD_OUT if opts["held_out"] else GRID
        rows = [r for r in rows if not opts["only"] or opts["only"] in r.name]
        with tempfile.TemporaryDirectory(prefix="tools-bench-plan-") as scratch:
            root = Path(scratch)
            for vocab in sorted({SHRINK[r.preset][0] for r in rows}):
                write_synthetic_data(root / f"data{vocab}", vocab, 300_000)
            results = []
            for row in rows:
                results.append(measure(row, root, opts["steps"], opts["timeout"]))
                print(f"{PROG}: {json.dumps(results[-1])}", flush=True)
        print(report(results))
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
