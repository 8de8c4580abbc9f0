"""The plan against measured runs: `python -m tools.bench plan [smoke=true] [steps=5]`.

Runs a grid of real short CPU trainings (`python -m lmsys.train`, `torchrun --nproc_per_node=2`
for 2 ranks; presets tiny, seed_trax, seed_postln, seed_compact, gpt2_124m shrunk to short
sequences and a vocabulary of at most 8192; ZeRO 0-3 and 3 with offload; micro-batches 1-8;
activation checkpointing on and off; loss_impl full and chunked) and prints, per row, the
predicted and the measured peak memory per rank (the largest rank's, lmsys-train's `memory`
record with trainer.trace_memory=true: the peak of the tensors allocated after the baseline, from
torch's allocator events, against the plan's tensors; lmsys.training.metrics.TensorPeak), the
moment of the step the plan puts the peak at, and the predicted and measured step time (the
median of steps 3.. of metrics.jsonl: the trace runs through step 2), with the errors, the worst
and the median. The CPU FLOP rate the time prediction uses is measured here
first (lmsys.training.devices.cpu_flops, one thread: what torchrun gives each CPU worker).

host_adam=true runs no training: it times offload's host Adam against an in-place add
(host_adam_report), the premise of the plan's offload time on a GPU.

smoke=true runs three 1-rank rows of the tiny preset (the test's size). Data: a synthetic prepared
directory per vocabulary (tools.bench.train's), so no corpus is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lmsys.cli import Option, parse_options, run_cli
from lmsys.core.config import compose
from lmsys.core.rundir import read_metrics
from lmsys.training.devices import cpu_device, cpu_flops, device_spec
from lmsys.training.planning import cpu_overhead_s, mib, plan_launch
from tools.bench.train import write_synthetic_data

PROG = "tools.bench plan"
OPTIONS = [
    Option("smoke", "bool", False, "three small 1-rank rows only"),
    Option("held_out", "bool", False, "the held-out rows instead: seed_gpt, a preset in no grid row"),
    Option("steps", "int", 5, "optimizer steps per run (the trace takes steps 1-2)"),
    Option("only", "str", None, "run the rows whose name contains this"),
    Option("timeout", "int", 900, "seconds per run"),
    Option("predict", "bool", False, "print the GPU prediction table of docs/planning.md instead (no runs)"),
    Option("replay", "str", None, "a saved output of this bench: predict its measured rows again (no runs)"),
    Option("host_adam", "bool", False, "time offload's host Adam against a streaming add instead (no runs)"),
]
# The shrunk presets: (preset, vocabulary, overrides) at the row's sequence length.
SHRINK = {
    "tiny": (2048, []),
    "seed_trax": (8192, []),
    "seed_postln": (8192, []),
    "seed_compact": (8192, []),
    "gpt2_124m": (8192, ["model.vocab_size=8192"]),
    "seed_gpt": (8192, ["model.vocab_size=8192"]),
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

    @property
    def name(self) -> str:
        bits = [
            self.preset,
            f"w{self.world}",
            f"z{self.stage}{'off' if self.offload else ''}",
            f"mb{self.micro}",
        ]
        bits += [f"T{self.seq}", self.loss_impl] + (["ckpt"] if self.checkpointing else [])
        return "-".join(bits)

    def overrides(self, data_root: Path) -> list[str]:
        vocab, extra = SHRINK[self.preset]
        deepspeed = "zero3_offload" if self.offload else f"zero{self.stage}"
        return [
            f"model={self.preset}",
            *extra,
            f"data.dir={data_root / f'data{vocab}'}",
            f"data.seq_len={self.seq}",
            f"deepspeed={deepspeed}",
            f"deepspeed.activation_checkpointing={str(self.checkpointing).lower()}",
            f"model.loss_impl={self.loss_impl}",
            f"trainer.micro_batch_size={self.micro}",
            f"trainer.global_batch_tokens={self.micro * self.world * self.seq * 2}",  # accumulation 2
            "trainer.eval_batches=1",
            "trainer.eval_interval=1000",
            "trainer.save_interval=1000",
            "trainer.keep_last=1",
            "trainer.progress=false",
            "optim.warmup_steps=1",
            "logger=none",
            "trainer.trace_memory=true",
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
# A preset in no GRID row, checked after the model was fitted (held_out=true; docs/planning.md).
HELD_OUT = [
    Row("seed_gpt", 1, 0, 2),
    Row("seed_gpt", 1, 3, 1, checkpointing=True),
    Row("seed_gpt", 2, 2, 1, loss_impl="full"),
    Row("seed_gpt", 2, 3, 1, offload=True),
    Row("seed_gpt", 2, 1, 2, seq=64, checkpointing=True),
]
SMOKE = [
    Row("tiny", 1, 0, 4, seq=64, loss_impl="full"),
    Row("tiny", 1, 2, 4, seq=64),
    Row("tiny", 1, 3, 2, seq=64),
]


def child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def command(world: int, overrides: list[str]) -> list[str]:
    if world == 1:
        return [sys.executable, "-m", "lmsys.train", *overrides]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", f"--nproc_per_node={world}", "-m", "lmsys.train", *overrides]


def measure(row: Row, root: Path, steps: int, rate: float, timeout: int) -> dict[str, Any]:
    """One row: the plan, then the real run; predicted and measured figures."""
    overrides = row.overrides(root)
    cfg = compose(overrides)
    plan = plan_launch(cfg, row.world, cpu_device(), cpu_rate=rate, suggest=False)
    run_dir = root / "runs" / row.name
    started = time.perf_counter()
    proc = subprocess.run(
        command(row.world, [*overrides, f"trainer.max_steps={steps}", f"trainer.run_dir={run_dir}"]),
        env=child_env(),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    result: dict[str, Any] = {
        "row": row.name,
        "predicted_bytes": plan.tensor_bytes,
        "peak_phase": plan.peak_phase,
        "predicted_step_s": plan.step_time_s,
        "components": plan.components,
        "flops_per_step": plan.flops_per_step,
        "grad_accum": plan.batch.grad_accum,
        "overhead_s": cpu_overhead_s(cfg, row.world, cpu_device(), plan.batch),
        "wall_s": time.perf_counter() - started,
    }
    memory = read_metrics(run_dir, "memory")
    train = read_metrics(run_dir, "train")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the run's final save: 1.4 GB for gpt2_124m
    if proc.returncode != 0 or not memory:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {**result, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    measured = int(memory[-1]["measured_peak_bytes"])
    result.update(measured_by=memory[-1].get("measured_by"), peak_during=memory[-1].get("rank0_peak_during"))
    result["unconfirmed_bytes"] = int(memory[-1].get("measured_peak_unconfirmed_bytes") or 0)
    times = [float(r["step_time_s"]) for r in train if int(r["step"]) >= 3] or [
        float(train[-1]["step_time_s"])
    ]
    step_s = statistics.median(times)
    return {
        **result,
        "measured_bytes": measured,
        "measured_step_s": step_s,
        "memory_error": plan.tensor_bytes / measured - 1 if measured > 0 else float("nan"),
        "time_error": plan.step_time_s / step_s - 1,
    }


def report(rows: list[dict[str, Any]], rate: float, replayed: bool = False) -> str:
    lines = [
        ("replayed: memory predicted by the current model, the measurements as saved; " if replayed else "")
        + f"training FLOP rate calibrated on these rows (median): {rate / 1e9:.2f} GFLOP/s",
        f"{'row':<44} {'predicted':>11} {'measured':>11} {'unseen':>9} {'error':>7} {'at':<8}  "
        f"{'pred s':>7} {'meas s':>7} {'error':>7}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['row']:<44} failed: {r['error']}")
            continue
        lines.append(
            f"{r['row']:<44} {mib(r['predicted_bytes']):>11} {mib(r['measured_bytes']):>11} "
            f"{mib(r.get('unconfirmed_bytes', 0)):>9} {r['memory_error']:>+7.1%} "
            f"{r.get('peak_phase', ''):<8}  "
            f"{r['predicted_step_s']:>7.3f} {r['measured_step_s']:>7.3f} "
            f"{r['time_error']:>+7.1%}"
        )
    done = [r for r in rows if "error" not in r]
    for key, what in (("memory_error", "memory"), ("time_error", "step time")):
        errors = [abs(r[key]) for r in done]
        if errors:
            within = sum(e <= (0.10 if key == "memory_error" else 0.30) for e in errors)
            lines.append(
                f"{what}: worst {max(errors):.1%}, median {statistics.median(errors):.1%}, "
                f"{within} of {len(errors)} rows within {'10' if key == 'memory_error' else '30'}%"
            )
    # the trace's range: blocks a gloo thread freed (unseen) may have gone before the peak
    ranged = [r for r in done if r.get("unconfirmed_bytes")]
    if ranged:
        inside = sum(
            (r["measured_bytes"] - r.get("unconfirmed_bytes", 0)) * 0.9
            <= r["predicted_bytes"]
            <= r["measured_bytes"] * 1.1
            for r in done
        )
        lines.append(
            f"memory, against the traced range [measured - unseen frees, measured]: {inside} of {len(done)} "
            "rows within 10%"
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
                    fit = f"{micro}" if plan else "none"
                    peak = mib(plan.peak_bytes) if plan else "-"
                    speed = f"{plan.tokens_per_s:,.0f}" if plan else "-"
                    mfu = f"{plan.mfu:.0%}" if plan and plan.mfu else "-"
                    lines.append(
                        f"| {model} | {stage} | {world} | {name} | {mib(at_one.peak_bytes)} | {fit} | {peak} "
                        f"| {speed} | {mfu} |"
                    )
    return "\n".join(lines)


def replay(path: str) -> list[dict[str, Any]]:
    """The rows of a saved bench output (its `tools.bench plan: {...}` lines) with the memory
    predicted again by the current model: the measurements stay what they were; the step time is
    predicted again from the current non-FLOP model (cpu_overhead_s) and a FLOP rate calibrated on
    the rows, as in a live run."""
    rows = {r.name: r for r in (*GRID, *SMOKE)}
    root = Path(tempfile.gettempdir())
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.startswith(f"{PROG}: {{"):
            continue
        saved = json.loads(line[len(PROG) + 2 :])
        row = rows.get(saved["row"])
        if row is None or "measured_bytes" not in saved:
            out.append(saved if "error" in saved else {**saved, "error": "not a row of this grid"})
            continue
        cfg = compose(row.overrides(root))
        plan = plan_launch(cfg, row.world, cpu_device(), cpu_rate=1e9, suggest=False)
        measured = int(saved["measured_bytes"])
        # outputs from before the trace (2026-11-27) measured the peak RSS: tensors and runtime
        traced = saved.get("measured_by") == "traced_tensors"
        predicted = plan.tensor_bytes if traced else plan.allocated_bytes
        saved.update(predicted_bytes=predicted, memory_error=predicted / measured - 1)
        saved.update(peak_phase=plan.peak_phase)
        saved.update(flops_per_step=plan.flops_per_step, grad_accum=plan.batch.grad_accum)
        saved.update(overhead_s=cpu_overhead_s(cfg, row.world, cpu_device(), plan.batch))
        out.append(saved)
    return out


def calibrate_time(rows: list[dict[str, Any]]) -> float | None:
    """The CPU's effective training FLOP rate, calibrated on the rows themselves (the median of
    FLOPs / measured step time: on a shared machine the load of the moment, not the matmul rate,
    sets the pace), and every row's step time predicted with it."""
    done = [r for r in rows if "measured_step_s" in r]
    if not done:
        return None
    rates = [r["flops_per_step"] / max(r["measured_step_s"] - r["overhead_s"], 1e-6) for r in done]
    rate = statistics.median(rates)
    for r in done:
        r["predicted_step_s"] = r["flops_per_step"] / rate + r["overhead_s"]
        r["time_error"] = r["predicted_step_s"] / r["measured_step_s"] - 1
    return rate


def host_adam_report(n_params: int = 50_000_000, threads: int = 2) -> str:
    """Offload's premise on this CPU (lmsys.training.planning.offload_time_s): DeepSpeed's CPU Adam,
    which ZeRO-Offload runs, streams memory as fast as an in-place add does. Both over fp32 tensors
    of n_params elements, the best of 5: Adam moves 28 bytes a parameter here (reads the weight,
    gradient and two moments, writes three; the plan adds the 2-byte half copy of a GPU run), the
    add 12 (reads two, writes one)."""
    import torch  # late: only this benchmark needs torch at once
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # late: builds its C++ op on first use

    def best_s(step: Any, *args: Any) -> float:
        step(*args)  # warm: first touch of the pages, the op's build
        times = []
        for _ in range(5):
            start = time.perf_counter()
            step(*args)
            times.append(time.perf_counter() - start)
        return min(times)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        add_s = best_s(torch.rand(n_params).add_, torch.rand(n_params))
        weight = torch.nn.Parameter(torch.randn(n_params))
        weight.grad = torch.randn(n_params)
        adam_s = best_s(DeepSpeedCPUAdam([weight], lr=1e-4).step)
    finally:
        torch.set_num_threads(previous)
    add_rate, adam_rate = 12 * n_params / add_s, 28 * n_params / adam_s
    return (
        f"{PROG}: host Adam (DeepSpeedCPUAdam, {n_params:,} fp32 parameters, {threads} threads): "
        f"{adam_s:.4f} s, {adam_rate / 1e9:.1f} GB/s at 28 bytes a parameter\n"
        f"{PROG}: in-place add (baseline, the same size): {add_s:.4f} s, "
        f"{add_rate / 1e9:.1f} GB/s at 12 bytes\n"
        f"{PROG}: ratio {adam_rate / add_rate:.2f} (1.00: Adam streams memory as fast as the add, as the "
        "plan models it; the plan's 70% of the DRAM's peak is that streaming rate's share, not measured here)"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts = parse_options(PROG, argv, OPTIONS, __doc__ or "")
        if opts is None:
            return 0
        if opts["predict"]:
            print(prediction_table())
            return 0
        if opts["host_adam"]:
            print(host_adam_report())
            return 0
        if opts["replay"]:
            replayed = replay(opts["replay"])
            print(report(replayed, calibrate_time(replayed) or float("nan"), replayed=True))
            return 0
        rows = SMOKE if opts["smoke"] else HELD_OUT if opts["held_out"] else GRID
        if opts["only"]:
            rows = [r for r in rows if opts["only"] in r.name]
        rate = cpu_flops(threads=1, seconds=1.0)
        with tempfile.TemporaryDirectory(prefix="tools-bench-plan-") as scratch:
            root = Path(scratch)
            for vocab in sorted({SHRINK[r.preset][0] for r in rows}):
                write_synthetic_data(root / f"data{vocab}", vocab, 300_000)
            results = []
            for row in rows:
                results.append(measure(row, root, opts["steps"], rate, opts["timeout"]))
                print(
                    f"{PROG}: {json.dumps({k: v for k, v in results[-1].items() if k != 'components'})}",
                    flush=True,
                )
        print(f"{PROG}: CPU matmul rate {rate / 1e9:.1f} GFLOP/s (1 thread)")
        print(report(results, calibrate_time(results) or float("nan")))
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
