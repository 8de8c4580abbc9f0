"""The linear cross-entropy benchmark: `python -m tools.bench ce [--n N --d D --v V] [--repeat R]
[--model]`.

Loss forward + backward at gpt2_124m's shapes (N = 8192 tokens, D = 768, V = 50,257 pieces) for:

    full     F.cross_entropy(h @ W.T) (the (N, V) logits, their log-softmax and gradient exist)
    chunked  the torch path of model.loss_impl=chunked (kernels/reference.py)
    fused    the Triton kernel of model.loss_impl=fused (CUDA only: the interpreter on a CPU would
             take hours at these shapes)

and, as baselines, torch's own F.linear_cross_entropy with each of its chunking options
(torch.nn.LinearCrossEntropyOptions):

    torch        options=None: torch's reference path (the logits exist, as in full)
    torch-auto   LinearCrossEntropyOptions(): its per-(device, dtype) automatic choice
    torch-ar1    chunking_method="aspect_ratio" (chunks of about D tokens)
    torch-ar2    chunking_method="aspect_ratio:2" (half that)
    torch-b1024  batch_chunk_size=1024 (fixed chunks of 1024 tokens)

Each variant runs in a fresh process, so its peak memory is its own: on a CPU the peak resident
set (VmHWM, reset through /proc/self/clear_refs once the inputs exist) minus the resident set
then; on a GPU torch.cuda.max_memory_allocated minus the memory allocated then. Time: the median
of R forward+backward passes after one warm-up. Ratios are against `full` measured in the same run:
memory ratio = full / variant (> 1: the variant needs less), time ratio = variant / full (< 1:
faster). fp32 on a CPU, bf16 inputs on a GPU (fp32 accumulation everywhere).

`--model` runs the end-to-end check instead: Transformer(gpt2_124m) `.loss(tokens,
weights)` on tokens (4, 1024), forward and backward, with model.loss_impl=chunked and =torch
(torch's op, automatic chunking) against full, each in its own process (peak memory and time as
above), and the losses and every gradient compared (max relative difference printed; the check
is 1e-5).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmsys.cli import run_cli

PROG = "tools.bench ce"
VARIANTS = ("full", "chunked", "fused")
# torch's F.linear_cross_entropy: variant -> its LinearCrossEntropyOptions keywords (None: options=None)
TORCH_VARIANTS: dict[str, dict | None] = {
    "torch": None,
    "torch-auto": {},
    "torch-ar1": {"chunking_method": "aspect_ratio"},
    "torch-ar2": {"chunking_method": "aspect_ratio:2"},
    "torch-b1024": {"chunking_method": None, "batch_chunk_size": 1024},
}
MEMORY_TARGET = {"cpu": 4.0, "cuda": 5.0}  # at least this much less peak memory than full
TIME_TARGET = {"cpu": 1.15, "cuda": 1.0}  # at most this many times full's time


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory:
    """Peak memory above what is in use when `start` is called: CUDA allocations, or the CPU
    resident set (Linux: VmHWM reset by writing 5 to /proc/self/clear_refs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = _rss_bytes("VmRSS")

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _rss_bytes("VmHWM") - self.base


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _loss_fn(variant: str):
    if variant == "full":

        def full(h, w, t):
            return torch.nn.functional.cross_entropy((h @ w.T).float(), t)

        return full
    if variant in TORCH_VARIANTS:
        keywords = TORCH_VARIANTS[variant]
        options = None if keywords is None else torch.nn.LinearCrossEntropyOptions(**keywords)

        def torch_op(h, w, t):
            return torch.nn.functional.linear_cross_entropy(h, w, t, options=options).float()

        return torch_op
    # Each variant runs in a process of its own and imports only what it runs: the fused kernel's
    # module imports triton, which the torch variants never need.
    if variant == "chunked":
        from kernels.reference import chunked_linear_cross_entropy

        return lambda h, w, t: chunked_linear_cross_entropy(h, w, t)
    from kernels.linear_cross_entropy import linear_cross_entropy

    return lambda h, w, t: linear_cross_entropy(h, w, t)


def worker_ops(variant: str, n: int, d: int, v: int, repeat: int) -> dict[str, float]:
    """One variant in this (fresh) process: peak memory and median time of forward+backward."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(n, d, generator=gen, device=device) * 0.5).to(dtype).requires_grad_()  # (N, D)
    w = (torch.randn(v, d, generator=gen, device=device) * 0.02).to(dtype).requires_grad_()  # (V, D)
    t = torch.randint(0, v, (n,), generator=gen, device=device)  # (N,)
    loss_fn = _loss_fn(variant)
    memory = PeakMemory(device)
    memory.start()
    times, loss = [], 0.0
    for i in range(repeat + 1):
        h.grad = w.grad = None
        _sync(device)
        start = time.perf_counter()
        out = loss_fn(h, w, t)
        out.backward()
        _sync(device)
        if i > 0:  # the first pass is the warm-up
            times.append(time.perf_counter() - start)
        loss = out.item()
    return {"peak_bytes": memory.peak(), "seconds": statistics.median(times), "loss": loss}


def worker_model(variant: str, out_dir: Path) -> dict[str, float]:
    """gpt2_124m's loss on tokens (4, 1024) with model.loss_impl=variant: peak memory, time, and
    the loss and gradients saved to out_dir for the comparison."""
    # the model only in this worker: the loss variants' processes measure the loss alone
    from lmsys.core.config import compose
    from lmsys.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(compose(["model=gpt2_124m", f"model.loss_impl={variant}"]).model)  # torch: torch's op
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (4, 1024), generator=gen)  # (B, S)
    weights = (torch.rand(4, 1024, generator=gen) > 0.05).float()  # (B, S)
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    start = time.perf_counter()
    loss = model.loss(tokens, weights)
    loss.backward()
    seconds = time.perf_counter() - start
    peak = memory.peak()
    grads = {name: p.grad for name, p in model.named_parameters()}
    torch.save({"loss": loss.detach(), "grads": grads}, out_dir / f"{variant}.pt")
    return {"peak_bytes": peak, "seconds": seconds, "loss": loss.item()}


def _run_worker(args: list[str]) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench.ce", "--worker", *args], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{PROG}: the {args[0]} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(results: dict[str, dict[str, float]]) -> str:
    base = results["full"]
    lines = [
        f"{'variant':<12}{'peak MiB':>10}{'time s':>9}{'loss':>10}{'memory vs full':>16}{'time vs full':>14}"
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<12}{r['peak_bytes'] / 2**20:>10.0f}{r['seconds']:>9.2f}{r['loss']:>10.4f}"
            f"{base['peak_bytes'] / max(r['peak_bytes'], 1):>15.1f}x{r['seconds'] / base['seconds']:>13.2f}x"
        )
    return "\n".join(lines)


def _device_line() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def bench_ops(n: int, d: int, v: int, repeat: int) -> int:
    on_gpu = torch.cuda.is_available()
    kind = "cuda" if on_gpu else "cpu"
    print(f"device: {_device_line()}")
    print(f"date:   {datetime.datetime.now().isoformat(timespec='seconds')}")
    dtype = "bf16" if on_gpu else "fp32"
    print(f"shape:  N={n:,} tokens, D={d}, V={v:,}; {dtype} inputs; loss forward+backward")
    print(f"each variant in a fresh process; time: median of {repeat} after a warm-up")
    print()
    variants = [*(VARIANTS if on_gpu else ("full", "chunked")), *TORCH_VARIANTS]
    results = {name: _run_worker([name, str(n), str(d), str(v), str(repeat)]) for name in variants}
    print(_table(results))
    ours = "fused" if on_gpu else "chunked"
    fastest = min(TORCH_VARIANTS, key=lambda name: results[name]["seconds"])
    time_ratio = results[fastest]["seconds"] / results[ours]["seconds"]
    memory_ratio = results[fastest]["peak_bytes"] / max(results[ours]["peak_bytes"], 1)
    print(
        f"torch's fastest ({fastest}) vs lmsys's {ours}: {time_ratio:.2f}x the time, {memory_ratio:.2f}x the "
        "peak memory (model.loss_impl=auto: docs/model.md)"
    )
    print()
    best = "fused" if on_gpu else "chunked"
    mem = results["full"]["peak_bytes"] / max(results[best]["peak_bytes"], 1)
    speed = results[best]["seconds"] / results["full"]["seconds"]
    print(
        f"target ({kind}, {best}): >= {MEMORY_TARGET[kind]:.0f}x less peak memory: {mem:.1f}x "
        f"[{'met' if mem >= MEMORY_TARGET[kind] else 'NOT met'}]; <= {TIME_TARGET[kind]:.2f}x the time: "
        f"{speed:.2f}x [{'met' if speed <= TIME_TARGET[kind] else 'NOT met'}]"
    )
    return 0


def bench_model() -> int:
    print(f"device: {_device_line()}")
    print(f"date:   {datetime.datetime.now().isoformat(timespec='seconds')}")
    print("gpt2_124m .loss(tokens (4, 1024), weights) forward+backward; each variant in a fresh process")
    print()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: _run_worker(["model", name, tmp]) for name in ("full", "chunked", "torch")}
        print(_table(results))
        full = torch.load(Path(tmp) / "full.pt")
        for name in ("chunked", "torch"):
            _compare_model(name, torch.load(Path(tmp) / f"{name}.pt"), full)
    return 0


def _compare_model(variant: str, chunked: dict, full: dict) -> None:
    """One variant's loss and gradients against full's, printed with the 1e-5 check."""
    loss_diff = abs(chunked["loss"].item() - full["loss"].item()) / abs(full["loss"].item())
    # A gradient that is zero in exact arithmetic (the attention key bias: softmax ignores a
    # constant added to a row of scores) is float noise on both sides: judged against the model's
    # largest gradient instead of its own.
    largest = max(g.abs().max().item() for g in full["grads"].values())
    grad_diff, noise = 0.0, []
    for name, g in full["grads"].items():
        scale = g.abs().max().item()
        if scale < 1e-6 * largest:
            noise.append(name)
            scale = largest
        grad_diff = max(grad_diff, (chunked["grads"][name] - g).abs().max().item() / scale)
    print()
    verdict = "met" if max(loss_diff, grad_diff) <= 1e-5 else "NOT met"
    print(
        f"{variant} vs full: loss rel. diff {loss_diff:.1e}, gradients max |diff| / max |grad| per "
        f"parameter {grad_diff:.1e} (check 1e-5: {verdict}); {len(noise)} parameters with a zero "
        f"gradient (below 1e-6 of the largest, e.g. {', '.join(noise[:2]) or '-'}) against the largest"
    )


def main(argv: list[str] | None = None) -> int:
    """The benchmark, or with --worker one variant in this process (a JSON line on stdout)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_cli(PROG, lambda: run(argv))


def run(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        if argv[1] == "model":
            result = worker_model(argv[2], Path(argv[3]))
        else:
            variant, n, d, v, repeat = argv[1], *map(int, argv[2:6])
            result = worker_ops(variant, n, d, v, repeat)
        print(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192, help="tokens (default: 8192)")
    parser.add_argument("--d", type=int, default=768, help="hidden width (default: 768)")
    parser.add_argument("--v", type=int, default=50257, help="vocabulary (default: 50,257)")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes per variant (default: 3)")
    parser.add_argument("--model", action="store_true", help="gpt2_124m's Transformer.loss, chunked vs full")
    args = parser.parse_args(argv)
    if min(args.n, args.d, args.v, args.repeat) < 1:
        parser.error("--n, --d, --v and --repeat must be >= 1")
    return bench_model() if args.model else bench_ops(args.n, args.d, args.v, args.repeat)


if __name__ == "__main__":
    sys.exit(main())
