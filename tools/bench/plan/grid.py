"""The plan against measured runs: `python -m tools.bench plan [smoke=true] [held_out=true]`.

Trains a grid of short real CPU runs on synthetic data and prints per row the plan's tensors per
rank beside the largest rank's traced peak through its second step (tensor_trace.py). A row is
named <preset>-w<ranks: 2 under torchrun>-z<ZeRO stage>[off: with offload]-mb<micro-batch>-T<tokens>
-<loss_impl>[-ckpt: activation checkpointing][-docs: packed documents]; its presets have
vocabularies of at most 8192, its steps accumulate 2 micro-batches. Frees on gloo's threads go
unseen, so a peak lies in [measured - unseen, measured]; a row is within 10% when the plan is within
10% of that range. held_out=true: five rows of smollm2_135m, a preset in no grid row; smoke=true:
three small rows; predict=true, context=true: docs/planning.md's GPU tables instead (no runs).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from itertools import product
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
SHRINK = {  # the shrunk presets: (vocabulary, overrides)
    "tiny": (2048, []), "llama_tiny": (2048, []),
    "seed_trax": (8192, []), "seed_postln": (8192, []), "seed_compact": (8192, []),
    "gpt2_124m": (8192, ["model.vocab_size=8192"]), "smollm2_135m": (8192, ["model.vocab_size=8192"]),
}  # fmt: skip
# The rows by name (the module docstring says how it reads), run in this order.
GRID = """
    tiny-w1-z0-mb8-T128-full tiny-w1-z0-mb8-T128-chunked tiny-w1-z1-mb4-T128-chunked
    tiny-w1-z2-mb4-T128-chunked-ckpt tiny-w1-z3-mb2-T128-chunked tiny-w2-z0-mb4-T128-chunked
    tiny-w2-z1-mb4-T128-full tiny-w2-z2-mb4-T128-chunked tiny-w2-z3-mb4-T128-chunked
    tiny-w2-z3off-mb4-T128-chunked tiny-w2-z3-mb1-T128-chunked-ckpt
    llama_tiny-w1-z0-mb8-T128-full llama_tiny-w1-z2-mb4-T128-chunked-ckpt llama_tiny-w2-z1-mb4-T128-chunked
    llama_tiny-w2-z3-mb2-T128-chunked llama_tiny-w2-z2-mb4-T128-chunked-docs
    seed_trax-w1-z0-mb2-T128-chunked seed_trax-w1-z2-mb4-T128-chunked-ckpt seed_trax-w2-z1-mb2-T128-chunked
    seed_trax-w2-z3-mb2-T128-chunked
    seed_postln-w1-z1-mb4-T128-full seed_postln-w2-z0-mb2-T128-chunked
    seed_postln-w2-z2-mb8-T128-chunked-ckpt seed_postln-w2-z3off-mb2-T128-chunked
    seed_compact-w1-z3-mb2-T128-chunked seed_compact-w2-z0-mb4-T128-full
    seed_compact-w2-z2-mb2-T256-chunked seed_compact-w2-z3-mb8-T128-chunked-ckpt
    gpt2_124m-w1-z0-mb1-T128-chunked gpt2_124m-w2-z3-mb2-T256-chunked-ckpt
""".split()
# A preset in no GRID row, of the family no CPU row was fitted to.
HELD_OUT = """
    smollm2_135m-w1-z0-mb2-T128-chunked smollm2_135m-w1-z3-mb1-T128-chunked-ckpt
    smollm2_135m-w2-z2-mb1-T128-full smollm2_135m-w2-z3off-mb1-T128-chunked
    smollm2_135m-w2-z1-mb2-T64-chunked-ckpt
""".split()
SMOKE = ["tiny-w1-z0-mb4-T64-full", "llama_tiny-w1-z2-mb4-T64-chunked-docs", "tiny-w1-z3-mb2-T64-chunked"]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
CONTEXT_STEP = 8192  # context_table's contexts are multiples of this many tokens


def row_run(row: str, data_root: Path) -> tuple[int, list[str]]:
    """The row's ranks and the overrides of its run, from its name."""
    preset, world, zero, micro, seq, loss_impl, *flags = row.split("-")
    ranks, micro_batch, seq_len = int(world[1:]), int(micro[2:]), int(seq[1:])
    vocab, extra = SHRINK[preset]
    return ranks, [
        f"model={preset}", *extra, f"data.dir={data_root / f'data{vocab}'}", f"data.seq_len={seq_len}",
        f"deepspeed={'zero3_offload' if zero == 'z3off' else f'zero{zero[1:]}'}",
        f"deepspeed.activation_checkpointing={str('ckpt' in flags).lower()}", f"model.loss_impl={loss_impl}",
        f"data.document_masking={str('docs' in flags).lower()}", f"trainer.micro_batch_size={micro_batch}",
        f"trainer.global_batch_tokens={micro_batch * ranks * seq_len * 2}",  # accumulation 2
        "trainer.eval_batches=1", "trainer.eval_interval=1000", "trainer.save_interval=1000",
        "trainer.keep_last=1", "trainer.progress=false", "optim.warmup_steps=1", "logger=none",
    ]  # fmt: skip


def child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def measure(row: str, root: Path, steps: int, timeout: int) -> dict[str, Any]:
    """One row: the plan, then the real run; the plan's tensors beside the largest rank's peak."""
    world, overrides = row_run(row, root)
    plan = plan_launch(compose(overrides), world, cpu_device(), suggest=False)
    result: dict[str, Any] = {"row": row, "predicted_bytes": plan.tensor_bytes, "peak_phase": plan.peak_phase}
    run_dir, probe = root / "runs" / row, root / "runs" / f"{row}.peak"
    launcher = [sys.executable] if world == 1 else [TORCHRUN, "--standalone", f"--nproc_per_node={world}"]
    args = ["-m", "tools.bench.plan.tensor_trace", str(probe), *overrides, f"trainer.max_steps={steps}"]
    proc = subprocess.run([*launcher, *args, f"trainer.run_dir={run_dir}"], env=child_env(), cwd=root,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    shutil.rmtree(run_dir, ignore_errors=True)  # its final checkpoint: 1.4 GB for gpt2_124m
    peaks = [json.loads(p.read_text()) for p in sorted(probe.parent.glob(f"{probe.name}.rank*"))]
    if proc.returncode != 0 or len(peaks) != world:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {**result, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    largest = max(peaks, key=lambda p: p["bytes"])
    measured, unseen = largest["bytes"], largest["unseen_bytes"]
    within = (measured - unseen) * 0.9 <= plan.tensor_bytes <= measured * 1.1
    return {**result, "measured_bytes": measured, "unseen_bytes": unseen, "within": within,
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
    if done := [r for r in rows if "error" not in r]:
        errors = [abs(r["memory_error"]) for r in done]
        lines.append(
            f"memory: worst {max(errors):.1%}, median {statistics.median(errors):.1%}, "
            f"{sum(e <= 0.10 for e in errors)} of {len(done)} rows within 10% of the measured peak, "
            f"{sum(r['within'] for r in done)} of {len(done)} within 10% of [measured - unseen, measured]"
        )
    return "\n".join(lines)


def markdown(header: str, rows: list[list[str]]) -> str:
    """A table as docs/planning.md holds it; `header`'s columns separated by ' | '."""
    columns = header.split(" | ")
    lines = ["| " + " | ".join(cells) + " |" for cells in [columns, *rows]]
    return "\n".join([lines[0], "|" + "---|" * len(columns), *lines[1:]])


def with_micro(cfg: Any, micro: int) -> Any:
    return replace(cfg, trainer=replace(cfg.trainer, micro_batch_size=micro))


def largest_micro(base: Any, world: int, device: Any) -> tuple[int, Any]:
    """The largest power-of-two micro-batch (<= 64, splitting the global batch) that fits, and its plan."""
    best: tuple[int, Any] = (0, None)
    for micro in (1, 2, 4, 8, 16, 32, 64):
        if (base.trainer.global_batch_tokens // base.data.seq_len) % (micro * world):
            break
        plan = plan_launch(with_micro(base, micro), world, device, suggest=False)
        if not plan.fits:
            break
        best = (micro, plan)
    return best


def prediction_table() -> str:
    """gpt2_124m..gpt2_1558m x ZeRO 0-3 x world 1/8/64 at T=1024 (trainer=gpt2's 524,288-token
    global batch): per-GPU peak at micro-batch 1, the largest micro-batch that fits, its tokens/s."""
    rows = []
    for model in ("gpt2_124m", "gpt2_350m", "gpt2_774m", "gpt2_1558m"):
        composed = compose([f"model={model}", "trainer=gpt2", "optim=gpt2"])
        for stage, world, name in product(range(4), (1, 8, 64), ("a100-80gb", "h100")):
            base = replace(composed, deepspeed=replace(composed.deepspeed, stage=stage))
            device = device_spec(name)
            at_one = plan_launch(with_micro(base, 1), world, device, suggest=False)
            micro, plan = largest_micro(base, world, device)
            there = ["none", "-", "-", "-"]
            if plan is not None:
                there = [f"{micro}", mib(plan.peak_bytes), f"{plan.tokens_per_s:,.0f}", f"{plan.mfu:.0%}"]
            rows.append([model, f"{stage}", f"{world}", name, mib(at_one.peak_bytes), *there])
    header = "model | ZeRO | world | device | peak per GPU at micro 1 | largest micro that fits | peak there"
    return markdown(f"{header} | predicted tokens/s (all GPUs) | MFU", rows)


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
    rows = []
    for model, size in product(("llama3_2_1b", "gpt2_350m"), (1, 2, 4, 8)):
        low, high = 0, 1
        while context_plan(model, size, high * CONTEXT_STEP).fits:
            low, high = high, 2 * high
        while high - low > 1:  # low fits (or is 0), high does not
            middle = (low + high) // 2
            fits = context_plan(model, size, middle * CONTEXT_STEP).fits
            low, high = (middle, high) if fits else (low, middle)
        if not (longest := low * CONTEXT_STEP):
            rows.append([model, f"{size}", "none", "-", "-", "-"])
            continue
        plan = context_plan(model, size, longest)
        cells = [f"{longest:,}", f"{plan.peak_bytes / 2**30:.2f} GiB", f"{plan.step_time_s:,.0f} s"]
        rows.append([model if size == 1 else "", f"{size}", *cells, f"{plan.tokens_per_s:,.0f}"])
    header = "model | P | longest T | predicted peak per GPU | predicted step time | tokens/s (all GPUs)"
    return markdown(header, rows)


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
        rows = [r for r in rows if not opts["only"] or opts["only"] in r]
        with tempfile.TemporaryDirectory(prefix="tools-bench-plan-") as scratch:
            root = Path(scratch)
            for vocab in sorted({SHRINK[r.split("-")[0]][0] for r in rows}):  # a name starts with its preset
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
