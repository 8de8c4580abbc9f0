"""Checkpoint benchmark: how long a save stops the training loop, asynchronous against synchronous.

    python -m tools.bench checkpoint                         # 2 ranks, ZeRO-2 and ZeRO-3, CPU
    python -m tools.bench checkpoint stages=3 saves=6 model.n_layers=12

For each ZeRO stage, the real training command runs twice under torchrun on `nproc` ranks, the same
model, data and steps, a checkpoint every `interval` steps: once with trainer.async_save=true, once
with false. The default interval, 2 steps, lets a background write (about 1.5 s on 2 CPU cores) end
before the next save, as it does in a real run that saves every few hundred steps; a save that must
wait for the previous one counts the wait in its stall, and the benchmark says how many did
(interval=1 shows the case where writes cannot keep up). Each committed save records in
metrics.jsonl the loop's stall (from the save's start at the step boundary to the loop going on)
and the write time (files, sizes checked, hashed into the marker, committed); the benchmark prints
their medians over the saves (the first save is the untimed warm-up: it allocates the host
buffers), the state written per checkpoint, and the ratio async / sync stall (the target:
<= 0.1x; its anchor, PyTorch's asynchronous checkpointing of a 7B model, 148.8 s -> 6.3 s, 0.04x).
It also prints the whole loop's time of each run, since a background write competes with the loop
for the CPU (on a GPU it competes only for host memory bandwidth).

The model (d_model 512, 16 layers, vocabulary 2048: 26.3M parameters) is sized so that a
checkpoint holds >= 300 MB at either stage (fp32: weights, master weights and Adam's two moments).
Data: synthetic random tokens (tools.bench.train's), which the timing does not depend on.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lmsys.cli import Option, parse_options, run_cli
from lmsys.core.errors import UsageError
from lmsys.core.rundir import read_metrics
from tools.bench.train import write_synthetic_data

PROG = "tools.bench checkpoint"
OPTIONS = [
    Option("stages", "str", "2,3", "ZeRO stages to measure, comma-separated"),
    Option("saves", "int", 5, "timed saves per run (one more, the first, is the warm-up)"),
    Option("interval", "int", 2, "steps between saves (trainer.save_interval)"),
    Option("nproc", "int", 2, "ranks (torchrun --nproc_per_node)"),
    Option("keep", "str", "", "a directory to keep the runs in (default: a temporary one)"),
]
VOCAB = 2048
SEQ = 64
MODEL = [
    f"model.vocab_size={VOCAB}",
    "model.d_model=512",
    "model.n_layers=16",
    "model.n_heads=8",
    f"model.max_seq_len={SEQ}",
]


def run_one(
    stage: int, asynchronous: bool, opts: dict[str, Any], data: Path, root: Path, extra: list[str]
) -> dict[str, Any]:
    """One training run; its checkpoint rows and how long its loop took."""
    nproc, saves, interval = opts["nproc"], opts["saves"], opts["interval"]
    run_dir = root / f"zero{stage}-{'async' if asynchronous else 'sync'}"
    overrides = [
        *MODEL,
        f"data.dir={data}",
        f"deepspeed=zero{stage}",
        f"trainer.max_steps={(saves + 1) * interval}",
        f"trainer.save_interval={interval}",
        f"trainer.keep_last={saves + 1}",
        f"trainer.global_batch_tokens={nproc * SEQ}",
        "trainer.micro_batch_size=1",
        f"trainer.eval_interval={(saves + 1) * interval + 100}",
        "trainer.eval_batches=1",
        "trainer.progress=false",
        "logger=none",
        f"trainer.async_save={str(asynchronous).lower()}",
        f"trainer.run_dir={run_dir}",
        *extra,
    ]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--standalone", f"--nproc_per_node={nproc}", "-m", "lmsys.train", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise UsageError(f"the zero{stage} run failed (exit {proc.returncode}):\n{tail}")
    rows = read_metrics(run_dir, "checkpoint")
    done = [line for line in proc.stdout.splitlines() if ": done: steps" in line]
    loop_s = float(done[-1].split(" in ")[1].split(" s")[0]) if done else float("nan")
    marker = json.loads((Path(rows[-1]["path"]) / "lmsys_checkpoint.json").read_text())
    state_bytes = sum(f["bytes"] for f in marker["files"].values())
    timed = rows[1:]  # the first save allocates the host buffers
    waited = [r["waited_s"] for r in timed if r.get("waited_s", 0.0) > 0.01]
    return {
        "stall_s": statistics.median(r["stall_s"] for r in timed),
        "waited": len(waited),  # saves that waited for the previous one (stall_s includes the wait)
        "waited_s": statistics.median(waited) if waited else 0.0,
        "write_s": statistics.median(r["write_s"] for r in timed),
        "saves": len(timed),
        "loop_s": loop_s,
        "state_bytes": state_bytes,
    }


def run(opts: dict[str, Any], extra: list[str]) -> list[dict[str, Any]]:
    try:
        stages = [int(s) for s in opts["stages"].split(",")]
    except ValueError as exc:
        raise UsageError(f"stages={opts['stages']!r} must be comma-separated ZeRO stages, e.g. 2,3") from exc
    if any(s not in (0, 1, 2, 3) for s in stages):
        raise UsageError(f"stages={opts['stages']!r}: ZeRO stages are 0 to 3")
    if opts["saves"] is None or opts["saves"] < 1:
        raise UsageError(f"saves={opts['saves']} must be >= 1")
    if opts["interval"] is None or opts["interval"] < 1:
        raise UsageError(f"interval={opts['interval']} must be >= 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="tools-bench-ckpt-") as scratch:
        root = Path(opts["keep"]) if opts["keep"] else Path(scratch)
        data = write_synthetic_data(Path(scratch) / "data", VOCAB, train_tokens=200_000)
        for stage in stages:
            sync = run_one(stage, False, opts, data, root, extra)
            asyn = run_one(stage, True, opts, data, root, extra)
            results.append({"stage": stage, "sync": sync, "async": asyn})
    return results


def report(results: list[dict[str, Any]], nproc: int, interval: int) -> str:
    lines = []
    for r in results:
        s, a = r["sync"], r["async"]
        waits = (
            f"{a['waited']} of {a['saves']} asynchronous saves waited for the previous one "
            f"(median {a['waited_s']:.3f} s, in their stall)"
            if a["waited"]
            else "no save waited for the previous one"
        )
        lines.append(
            f"{PROG}: ZeRO-{r['stage']}, {nproc} ranks, {s['state_bytes'] / 1e6:,.0f} MB per checkpoint, "
            f"a save every {interval} steps, median of {a['saves']} saves: loop stall async "
            f"{a['stall_s']:.3f} s vs sync {s['stall_s']:.3f} s: "
            f"ratio {a['stall_s'] / s['stall_s']:.3f}x (target <= 0.1x); {waits}; write {a['write_s']:.2f} s "
            f"in the background vs {s['write_s']:.2f} s; "
            f"whole loop {a['loop_s']:.1f} s vs {s['loop_s']:.1f} s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        names = {o.name for o in OPTIONS}
        ours = [a for a in argv if a.partition("=")[0] in names or a in ("-h", "--help", "help")]
        opts = parse_options(PROG, ours, OPTIONS, __doc__ or PROG)
        if opts is None:
            return 0
        results = run(opts, [a for a in argv if a not in ours])
        print(report(results, opts["nproc"], opts["interval"]), flush=True)
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
