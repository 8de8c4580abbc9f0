"""Generation benchmark, two rows, each against a baseline measured in the same run:
tokens/s with the KV cache against without it (one prompt), and a batch of `batch` prompts
generated together (one padded batch, lmsys.generate.generate_batch) against the same prompts
generated one after another with the cache.

    python -m tools.bench generate                       # tiny preset, 16-token prompt, 112 new tokens
    python -m tools.bench generate preset=gpt2_124m new_tokens=256 device=cuda
    python -m tools.bench generate set=max_seq_len=1024 repeats=1   # a longer window: O(T) vs O(T^2)

Every run generates greedily from the same random-weight model, so both sides of a row produce
the same tokens (checked and printed); the ratios are the figures to report (docs/DESIGN.md:
every benchmark prints a ratio against a baseline measured in the same run), with the absolute
numbers and the device. The batch's prompts have different lengths (prompt_tokens * i / batch
tokens for i = 1..batch), so the batched run pays for its padding.

compile=true adds a third row: the same batch with the model compiled (torch.compile, inductor)
decoding through a StaticKVCache, against the eager batch of the second row (the untimed warm-up
call compiles; the graphs and the compile time are printed).
"""

from __future__ import annotations

import sys
import time

import torch

from lmsys.cli import DEVICE_OPTION, DTYPE_OPTION, Option, parse_options, run_cli
from lmsys.core.config import compose_model
from lmsys.core.devices import device_name
from lmsys.core.errors import UsageError
from lmsys.core.runtime import resolve_device, resolve_dtype
from lmsys.inference.generation import Sampling, generate_batch, generate_one
from lmsys.model.compiling import compile_module, compile_stats
from lmsys.model.ops import prepare_kernels
from lmsys.model.transformer import Transformer

PROG = "tools.bench generate"

OPTIONS = [
    Option("preset", "str", "tiny", "model preset (conf/model/)"),
    Option("set", "str", None, "model override of the preset, e.g. set=max_seq_len=1024", repeat=True),
    Option("prompt_tokens", "int", 16, "prompt length"),
    Option("new_tokens", "int", None, "tokens to generate (default: fill the context window)"),
    Option("repeats", "int", 3, "timed repetitions of each (the best is reported)"),
    Option("batch", "int", 8, "prompts of the batched row"),
    Option(
        "compile",
        "choice",
        "false",
        "also time the batch compiled (inductor, static KV cache)",
        ("true", "false"),
    ),
    DEVICE_OPTION,
    DTYPE_OPTION,
    Option("threads", "int", None, "CPU threads for torch (default: torch's choice)"),
]

SUMMARY = (
    "Generation benchmark: tokens/s with and without the KV cache, and a batch of prompts against the\n"
    "same prompts one at a time (greedy, random weights)."
)


def _timed(fn, device: torch.device) -> tuple[float, list[int]]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def _best(fn, repeats: int, device: torch.device) -> tuple[float, list]:
    """(the fastest of `repeats` timed calls, its output), after one untimed warm-up call."""
    fn()
    best, out = float("inf"), []
    for _ in range(max(1, repeats)):
        seconds, out = _timed(fn, device)
        best = min(best, seconds)
    return best, out


def _batch_prompts(vocab_size: int, n_prompt: int, batch: int) -> list[list[int]]:
    """`batch` prompts of prompt_tokens * i / batch tokens, i = 1..batch."""
    g = torch.Generator().manual_seed(2)
    lengths = [max(1, n_prompt * (i + 1) // batch) for i in range(batch)]
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def batch_row(model, n_prompt: int, new: int, batch: int, repeats: int, device: torch.device) -> dict:
    """`batch` prompts of different lengths generated as one padded batch against one by one."""
    prompts = _batch_prompts(model.cfg.vocab_size, n_prompt, batch)
    greedy = Sampling(greedy=True)
    together, batched = _best(lambda: generate_batch(model, prompts, [new] * batch, greedy), repeats, device)
    alone, singles = _best(lambda: [generate_one(model, p, new, greedy) for p in prompts], repeats, device)
    tokens = sum(len(t) for t in batched)
    return {
        "batch": batch,
        "batch_tokens_per_s": tokens / together,
        "single_tokens_per_s": tokens / alone,
        "batch_ratio": alone / together,
        "batch_same_tokens": batched == singles,
        "batch_output": batched,
    }


def compile_row(model, n_prompt: int, new: int, batch: int, repeats: int, device: torch.device) -> dict:
    """batch_row's batch with the model compiled in place (inductor) and a StaticKVCache."""
    prompts = _batch_prompts(model.cfg.vocab_size, n_prompt, batch)
    start = compile_stats()
    compile_module(model, strict=True)
    run_once = lambda: generate_batch(model, prompts, [new] * batch, Sampling(greedy=True), static_cache=True)  # noqa: E731
    seconds, out = _best(run_once, repeats, device)
    stats = compile_stats(start)
    return {
        "compiled_tokens_per_s": sum(len(t) for t in out) / seconds,
        "compiled_output": out,
        "compile_graphs": stats.graphs,
        "compile_seconds": stats.seconds,
    }


def run(opts: dict) -> dict:
    device, dtype = resolve_device(opts["device"]), resolve_dtype(opts["dtype"])
    if opts.get("threads"):
        torch.set_num_threads(int(opts["threads"]))
    cfg = compose_model(opts["preset"], list(opts.get("set") or []))
    prepare_kernels(cfg.kernels, device, dtype)  # Triton's CPU interpreter for kernels=triton
    torch.manual_seed(0)
    model = Transformer(cfg).to(device=device, dtype=dtype).eval()
    n_prompt = opts["prompt_tokens"]
    window = cfg.max_seq_len if cfg.positions.kind != "none" else n_prompt + 256
    new = opts["new_tokens"] or (window - n_prompt)
    if n_prompt < 1 or new < 1 or n_prompt + new > window + 1:
        raise UsageError(
            f"prompt_tokens={n_prompt} + new_tokens={new} must fit the context window of {window} (+1)"
        )
    if opts["batch"] is None or opts["batch"] < 1:
        raise UsageError(f"batch={opts['batch']} must be >= 1")
    prompt = torch.randint(
        0, cfg.vocab_size, (n_prompt,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    greedy = Sampling(greedy=True)
    results = {}
    for name, use_cache in (("cached", True), ("uncached", False)):
        run_once = lambda uc=use_cache: generate_one(model, prompt, new, greedy, None, 0, uc)  # noqa: E731
        best, tokens = _best(run_once, opts["repeats"], device)
        results[name] = {"seconds": best, "tokens_per_s": len(tokens) / best, "tokens": tokens}
    same = results["cached"]["tokens"] == results["uncached"]["tokens"]
    batched = batch_row(model, n_prompt, new, opts["batch"], opts["repeats"], device)
    if opts.get("compile") == "true":  # last: the model is compiled in place
        compiled = compile_row(model, n_prompt, new, opts["batch"], opts["repeats"], device)
        batched |= compiled | {
            "compile_ratio": compiled["compiled_tokens_per_s"] / batched["batch_tokens_per_s"],
            "compiled_same_tokens": compiled["compiled_output"] == batched["batch_output"],
        }
    return {
        **batched,
        "preset": opts["preset"],
        "device": device_name(device),
        "dtype": opts["dtype"],
        "prompt_tokens": n_prompt,
        "new_tokens": new,
        "cached_tokens_per_s": results["cached"]["tokens_per_s"],
        "uncached_tokens_per_s": results["uncached"]["tokens_per_s"],
        "ratio": results["cached"]["tokens_per_s"] / results["uncached"]["tokens_per_s"],
        "same_tokens": same,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts = parse_options(PROG, argv, OPTIONS, SUMMARY)
        if opts is None:
            return 0
        r = run(opts)
        overrides = "".join(f" {o}" for o in opts["set"])
        same, batch_same = ("yes" if r[k] else "NO" for k in ("same_tokens", "batch_same_tokens"))
        shortest = max(1, r["prompt_tokens"] // r["batch"])
        print(
            f"generate {r['preset']}{overrides} on {r['device']}, {r['dtype']}: "
            f"prompt {r['prompt_tokens']} tokens, "
            f"{r['new_tokens']} new tokens (greedy)\n"
            f"  KV cache     {r['cached_tokens_per_s']:10.1f} tokens/s\n"
            f"  no cache     {r['uncached_tokens_per_s']:10.1f} tokens/s (baseline: full prefix each token)\n"
            f"  ratio        {r['ratio']:10.2f}x  (same tokens: {same})\n"
            f"batch of {r['batch']} prompts of {shortest}-{r['prompt_tokens']} tokens, "
            f"{r['new_tokens']} new tokens each (greedy, KV cache)\n"
            f"  one batch    {r['batch_tokens_per_s']:10.1f} tokens/s\n"
            f"  one by one   {r['single_tokens_per_s']:10.1f} tokens/s (baseline: {r['batch']} single runs)\n"
            f"  ratio        {r['batch_ratio']:10.2f}x  (same tokens: {batch_same})"
        )
        ok = r["same_tokens"] and r["batch_same_tokens"]
        if "compile_ratio" in r:
            compiled_same = "yes" if r["compiled_same_tokens"] else "NO"
            print(
                f"the same batch compiled (torch.compile, inductor; static KV cache): {r['compile_graphs']} "
                f"graph(s), {r['compile_seconds']:.1f} s compiling\n"
                f"  compiled     {r['compiled_tokens_per_s']:10.1f} tokens/s\n"
                f"  eager        {r['batch_tokens_per_s']:10.1f} tokens/s (baseline: the batch above)\n"
                f"  ratio        {r['compile_ratio']:10.2f}x  (same tokens: {compiled_same})"
            )
            ok = ok and r["compiled_same_tokens"]
        return 0 if ok else 1

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
