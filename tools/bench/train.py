"""Training benchmark: lmsys's train loop (DeepSpeed engine) against a plain PyTorch loop.

    python -m tools.bench train                                  # CPU: tiny preset, default batch
    python -m tools.bench train steps=20 deepspeed=zero1 trainer.micro_batch_size=4
    python -m tools.bench train                                  # on a GPU: gpt2_124m, T=1024, bf16

Both sides run in this one process on the same model (same preset, same seed), the same
batches (the same TokenLoader order, micro-batches and gradient accumulation), the same
optimizer (AdamW, weight decay on matrices, the same learning-rate schedule) and gradient
clipping; the plain loop has no DeepSpeed, no logging, no checkpoints. The lmsys side is the
real `lmsys.train.train` (the CLI's code path in one process: progress bar, metrics.jsonl,
per-step collectives and all). The two are interleaved step by step through train's
`step_hook`: after each lmsys step the hook runs one plain step, so both see the same load on
a shared machine. An lmsys step is timed from the hook's return to its next call, i.e. the
whole loop iteration with its logging; evaluation and the checkpoint come with one extra step
at the end, which is not timed. The figure to report is the ratio (docs/DESIGN.md: every benchmark
prints a ratio against a baseline measured in the same run).

On a GPU the plain loop is also run, after the interleaved part, as production-style code:
`torch.compile`, torch SDPA attention and LayerNorm (model.kernels=torch), bf16 autocast and
fused AdamW; tokens/s and MFU (6N + 12LHdT FLOPs per token against the device's dense bf16
peak) are printed for each. The eager plain loop on a GPU uses bf16 autocast and fused AdamW.

`compile=true` runs lmsys a second time with trainer.compile=true (inductor), again interleaved
with a plain eager loop of its own, and prints eager / compiled lmsys step time (the first steps,
which compile, are the untimed warm-up).

The options below are key=value; every other argument is a Hydra override of the training
config. threads=0 means 1 thread, what torchrun gives each worker of the main job (one thread also
keeps a shared machine's load from stalling OpenMP barriers); compiled=true on CPU needs a C++
compiler for inductor.

Data: the timing does not depend on the token values, so by default the benchmark writes a
synthetic prepared directory (lmsys-prepare's layout; its tokenizer.model is a placeholder that
nothing loads) sized for the preset's vocabulary; no corpus or tokenizer is needed.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmsys.cli import Option, parse_options, run_cli
from lmsys.core.config import compose, validate
from lmsys.core.devices import device_name, device_peak_flops, mfu
from lmsys.core.errors import UsageError
from lmsys.core.files import sha256_file
from lmsys.core.runtime import resolve_device, resolve_precision, seed_everything, split_batch
from lmsys.data.loader import TokenLoader
from lmsys.data.shards import PreparedData, ShardWriter, token_dtype, write_manifest
from lmsys.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, SENTENCEPIECE_FILE, UNK_ID
from lmsys.engine.zero import lr_at, param_groups
from lmsys.model.ops import prepare_kernels
from lmsys.model.transformer import Transformer
from lmsys.training.run import train

PROG = "tools.bench train"
OPTIONS = [
    Option("steps", "int", 12, "timed optimizer steps per side"),
    Option("warmup", "int", 2, "untimed steps before them"),
    Option("data", "str", "synthetic", "synthetic (random tokens, any vocabulary) or a prepared data.dir"),
    Option("compiled", "choice", "auto", "also time a torch.compile + SDPA loop (auto: on CUDA only)",
           ("auto", "true", "false")),
    Option("threads", "int", 0, "CPU threads (0: 1)"),
    Option("compile", "choice", "false",
           "also run lmsys with trainer.compile=true (its own interleaved plain loop) and print "
           "compiled / eager step time", ("true", "false")),
]  # fmt: skip
# GPT-2 small at T=1024 (its max_seq_len), 16 sequences per step, no accumulation.
GPU_DEFAULTS = ["model=gpt2_124m", "trainer.micro_batch_size=16", "trainer.global_batch_tokens=16384"]


@dataclass
class Timing:
    name: str
    times: list[float]  # seconds of each timed optimizer step
    tokens_per_step: int

    @property
    def step_s(self) -> float:
        """The median step: the figure reported."""
        return statistics.median(self.times)

    @property
    def best_s(self) -> float:
        """The fastest step: what a step costs when nothing else on the machine interferes."""
        return min(self.times)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str]) -> tuple[dict[str, Any] | None, list[str]]:
    """(benchmark options, Hydra overrides); None for the options after printing --help."""
    names = {o.name for o in OPTIONS}
    ours = [a for a in argv if a.partition("=")[0] in names or a in ("-h", "--help", "help")]
    opts = parse_options(PROG, ours, OPTIONS, __doc__ or PROG)
    overrides = [a for a in argv if a not in ours]
    if opts is None:
        return None, overrides
    if opts["steps"] is None or opts["steps"] < 2:
        raise UsageError(f"steps={opts['steps']} must be >= 2")
    if opts["warmup"] is None or opts["warmup"] < 1:
        raise UsageError(f"warmup={opts['warmup']} must be >= 1 (the first step builds optimizer state)")
    if opts["threads"] is None or opts["threads"] < 0:
        raise UsageError(f"threads={opts['threads']} must be >= 0")
    return opts, overrides


# ----------------------------------------------------------------------------- synthetic data


def write_synthetic_data(directory: Path, vocab_size: int, train_tokens: int, seed: int = 0) -> Path:
    """A prepared-data directory (lmsys.data.shards' format) of uniformly random tokens. Its
    tokenizer.model is a placeholder that nothing loads."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    counts = {"train": train_tokens, "val": max(4096, train_tokens // 20)}
    writers = {
        split: ShardWriter(directory, split, token_dtype(vocab_size), n) for split, n in counts.items()
    }
    for split, n in counts.items():
        tokens = rng.integers(0, vocab_size, size=n, dtype=np.int64)
        writers[split].add(tokens, np.array([n]), np.array([True]))
    tokenizer = directory / SENTENCEPIECE_FILE
    tokenizer.write_bytes(b"synthetic benchmark data: no tokenizer\n")
    tokenizer_section = {
        "file": tokenizer.name,
        "sha256": sha256_file(tokenizer),
        "vocab_size": vocab_size,
        "pad_id": PAD_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "unk_id": UNK_ID,
        "origin": "synthetic (tools.bench.train)",
    }
    write_manifest(directory, writers, tokenizer_section, {})
    return directory


# ----------------------------------------------------------------------------- the plain loop


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PlainLoop:
    """A plain PyTorch training loop, one `step()` at a time: no DeepSpeed, one process.

    compiled=False: the same math as lmsys on this device (fp32 on CPU; on CUDA bf16 autocast
    with fp32 weights and fused AdamW). compiled=True: additionally torch.compile of the loss and
    torch's SDPA/LayerNorm instead of the Triton kernels.
    """

    def __init__(self, cfg: Any, device: torch.device, *, compiled: bool = False) -> None:
        self.cfg, self.device = cfg, device
        self.plan = split_batch(cfg, 1)
        seed_everything(cfg.trainer.seed)
        model_cfg = replace(cfg.model, kernels="torch") if compiled else cfg.model
        self.model = Transformer(model_cfg).to(device)
        o = cfg.optim
        cuda = device.type == "cuda"
        # CPU: torch AdamW one tensor at a time, as lmsys builds it; CUDA: the fused kernel.
        opt_kwargs: dict[str, Any] = {"fused": True} if cuda else {"foreach": False}
        self.opt = torch.optim.AdamW(
            param_groups(self.model, o.weight_decay),
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            **opt_kwargs,
        )
        self.forward = torch.compile(self.model.loss) if compiled else self.model.loss
        self.autocast = cuda and cfg.deepspeed.precision != "fp32"
        self.loader = TokenLoader(
            PreparedData(cfg.data.dir),
            "train",
            tokens_per_sample=self.plan.tokens_per_sample,
            global_batch_size=self.plan.global_batch_sequences,
            micro_batch_size=self.plan.micro_batch_size,
            seed=cfg.trainer.seed,
            mask_doc_boundaries=cfg.data.mask_doc_boundaries,
        )
        self.step_number = 0

    def step(self) -> float:
        """One optimizer step; returns its seconds."""
        o, accum = self.cfg.optim, self.plan.grad_accum
        _sync(self.device)
        t0 = time.perf_counter()
        self.step_number += 1
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step_number, o, self.cfg.trainer.max_steps)
        for _ in range(accum):
            batch = self.loader.next_batch()
            tokens = batch.tokens.to(self.device, non_blocking=True)  # (B, S)
            weights = batch.weights.to(self.device, non_blocking=True)  # (B, S)
            with torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext():
                loss = self.forward(tokens, weights)
            (loss / accum).backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync(self.device)
        return time.perf_counter() - t0


# ----------------------------------------------------------------------------- interleaving


class Interleave:
    """train's step_hook: time the lmsys step that just ended, then run one plain step."""

    def __init__(self, plain: PlainLoop, device: torch.device, warmup: int, steps: int) -> None:
        self.plain, self.device = plain, device
        self.warmup, self.steps = warmup, steps
        self.lmsys_times: list[float] = []
        self.plain_times: list[float] = []
        self._resumed: float | None = None

    def __call__(self, step: int) -> None:
        _sync(self.device)
        now = time.perf_counter()
        timed = self.warmup < step <= self.warmup + self.steps
        if timed and self._resumed is not None:
            self.lmsys_times.append(now - self._resumed)
        if step <= self.warmup + self.steps:
            seconds = self.plain.step()
            if timed:
                self.plain_times.append(seconds)
        self._resumed = time.perf_counter()


# ----------------------------------------------------------------------------- the benchmark


def bench_config(opts: dict[str, Any], overrides: list[str], scratch: Path, device: torch.device) -> Any:
    """The training config: the composed one, with its run in `scratch`, warmup + steps + 1 steps
    (the last one evaluates and saves, untimed) and, by default, synthetic data."""
    base = GPU_DEFAULTS if device.type == "cuda" else []
    cfg = compose([*base, *overrides])
    total = opts["warmup"] + opts["steps"] + 1
    if opts["data"] == "synthetic":
        plan = split_batch(cfg, 1)
        # enough samples for every step of both loops without wrapping into a second epoch
        tokens = (total + 4) * plan.global_batch_sequences * plan.tokens_per_sample
        data_dir = write_synthetic_data(scratch / "data", cfg.model.vocab_size, tokens)
    else:
        data_dir = Path(opts["data"])
    trainer = replace(
        cfg.trainer,
        run_dir=str(scratch / "run"),
        max_steps=total,
        resume="never",
        eval_interval=total,
        save_interval=total,
        eval_batches=1,
        keep_last=1,
        device=device.type,
    )
    return validate(replace(cfg, data=replace(cfg.data, dir=str(data_dir)), trainer=trainer))


def _interleaved_train(
    cfg: Any, plain: PlainLoop, device: torch.device, warmup: int, steps: int
) -> Interleave:
    """lmsys.train.train on `cfg`, one plain step after each of its steps; the hook's timings."""
    hook = Interleave(plain, device, warmup, steps)
    with contextlib.redirect_stdout(io.StringIO()):  # train's own lines; the report is ours
        train(cfg, step_hook=hook)
    return hook


def run(opts: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    choice = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.device=")), "auto")
    device = resolve_device(choice, key="trainer.device")
    steps, warmup = opts["steps"], opts["warmup"]
    if device.type == "cpu":
        torch.set_num_threads(opts["threads"] or 1)
    with tempfile.TemporaryDirectory(prefix="tools-bench-train-") as tmp:
        cfg = bench_config(opts, overrides, Path(tmp), device)
        prepare_kernels(cfg.model.kernels, device)  # before DeepSpeed imports triton
        plan = split_batch(cfg, 1)
        precision = resolve_precision(cfg.deepspeed.precision, device)
        plain = PlainLoop(cfg, device)
        n_params = plain.model.num_parameters()
        flops_per_token = plain.model.flops_per_token(plan.seq_len)
        hook = _interleaved_train(cfg, plain, device, warmup, steps)
        del plain
        timings = [
            Timing("plain PyTorch loop", hook.plain_times, plan.tokens_per_step),
            Timing("lmsys (DeepSpeed)", hook.lmsys_times, plan.tokens_per_step),
        ]
        compiled_lmsys = None
        if opts["compile"] == "true":  # the same run with trainer.compile=true, against its own plain loop
            ccfg = bench_config(opts, [*overrides, "trainer.compile=true"], Path(tmp) / "compiled", device)
            chook = _interleaved_train(ccfg, PlainLoop(ccfg, device), device, warmup, steps)
            compiled_lmsys = Timing("lmsys, trainer.compile=true", chook.lmsys_times, plan.tokens_per_step)
            compiled_plain = Timing("plain loop beside it", chook.plain_times, plan.tokens_per_step)
            timings += [compiled_lmsys, compiled_plain]
        compiled = opts["compiled"] == "true" or (opts["compiled"] == "auto" and device.type == "cuda")
        if compiled:
            loop = PlainLoop(cfg, device, compiled=True)
            times = [loop.step() for _ in range(warmup + steps)][warmup:]
            timings.append(Timing("torch.compile + SDPA loop", times, plan.tokens_per_step))
    peak = device_peak_flops(device)
    return {
        "model": cfg.model.name,
        "params": n_params,
        "device": device_name(device),
        "precision": precision,
        "stage": cfg.deepspeed.stage,
        "arithmetic": plan.arithmetic(),
        "steps": steps,
        "timings": timings,
        "mfu": {t.name: mfu(flops_per_token, t.tokens_per_s, peak, 1) for t in timings},
        "ratio": timings[1].step_s / timings[0].step_s,
        "best_ratio": timings[1].best_s / timings[0].best_s,
        "compiled_ratio": timings[1].step_s / timings[-1].step_s if compiled else None,
        # eager lmsys step time / compiled lmsys step time (> 1: compiling is faster), and the same
        # with each normalised by the plain loop interleaved with it (the machine's load then)
        "compile_speedup": timings[1].step_s / compiled_lmsys.step_s if compiled_lmsys else None,
        "compile_speedup_normalised": (timings[1].step_s / timings[0].step_s)
        / (compiled_lmsys.step_s / timings[3].step_s)
        if compiled_lmsys
        else None,
    }


def report(r: dict[str, Any]) -> str:
    lines = [
        f"train {r['model']} ({r['params']:,} parameters) on {r['device']}, {r['precision']}, "
        f"ZeRO stage {r['stage']}, 1 process",
        f"  {r['arithmetic']}; median (best) of {r['steps']} interleaved steps per side",
    ]
    for t in r["timings"]:
        m = r["mfu"][t.name]
        mfu_text = f"   MFU {100 * m:5.1f}%" if m is not None else ""
        lines.append(
            f"  {t.name:27s} {t.step_s * 1000:9.1f} ms/step ({t.best_s * 1000:9.1f}) "
            f"{t.tokens_per_s:11,.0f} tokens/s{mfu_text}"
        )
    overhead = 100 * (r["ratio"] - 1)
    lines.append(
        f"  ratio lmsys/plain {r['ratio']:.3f} (framework overhead {overhead:+.1f}%; "
        f"best steps: {r['best_ratio']:.3f})"
    )
    if r["compiled_ratio"] is not None:
        lines.append(f"  ratio lmsys/compiled {r['compiled_ratio']:.3f}")
    if r["compile_speedup"] is not None:
        lines.append(
            f"  trainer.compile=true: eager/compiled lmsys step time {r['compile_speedup']:.3f} "
            f"(> 1: compiled faster; each against its interleaved plain loop: "
            f"{r['compile_speedup_normalised']:.3f})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts, overrides = parse_args(argv)
        if opts is None:
            return 0
        print(report(run(opts, overrides)), flush=True)
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
