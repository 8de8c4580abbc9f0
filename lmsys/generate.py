"""lmsys-generate: continue prompts with a trained model (SPEC section 7).

    python -m lmsys.generate runs/tiny-x/export prompt="The module"           # streams to the terminal
    python -m lmsys.generate model=runs/tiny-x prompt="def " prompt="import " greedy=true
    python -m lmsys.generate model=exports/tiny prompts=prompts.txt temperature=0.8 top_p=0.95 seed=1

`model=` (or the first argument) is an export directory (lmsys-export) or a training checkpoint
(run dir, checkpoints/ dir or tag dir). A prompt starts a document: it is preceded by eos, as
every document was in training (start_of_document=false feeds the bare text); a bos_shift model
also gets its bos_shift_id at position 0, as in its training loss. Decoding: greedy (or
temperature=0), else sampling from softmax(logits / temperature) restricted to the top_k most
likely tokens and then to the smallest set whose probability reaches top_p. Generation stops
at eos or after max_new_tokens.

Batches: each prompt is generated on its own, with its own random generator seeded with
`seed`, so a prompt gives the same text alone or in a batch (no padding, no cross-talk).

Lengths. A model with positions sees at most model.max_seq_len tokens. A longer prompt is an
error (on_long_prompt=error, the default) or, with on_long_prompt=truncate, is cut from the left
with a warning to its last max(max_seq_len + 1 - max_new_tokens, max_seq_len // 2) tokens (so
the new tokens fit where they can). The prompt plus the new tokens may reach max_seq_len + 1
(the last token is never fed back); max_new_tokens is capped to fit, with a warning. An empty
prompt is an error. Models with positions.kind=none have no window.

The KV cache (cache=true, the default) makes each new token cost O(T) instead of re-running
the whole prefix; cached and uncached generation give the same tokens. Models whose outputs at
earlier positions depend on later tokens (attention.causal=false, attention.softmax=matrix)
cannot use a cache and are generated without one.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lmsys.cli import Option, parse_options, run_cli
from lmsys.cli import warn as cli_warn
from lmsys.errors import UsageError
from lmsys.export import TOKENIZER_OPTION, load_model
from lmsys.model import KVCache, context_prefix
from lmsys.ops import prepare_kernels
from lmsys.runtime import DEVICE_OPTION, DTYPE_OPTION, resolve_device, resolve_dtype

PROG = "lmsys-generate"
LONG_PROMPT = ("error", "truncate")


class GenerationError(UsageError):
    """Bad generation input (empty or too long prompt, bad sampling values); one line."""


# ----------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits of the last position."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k restriction
    top_p: float = 1.0  # 1.0: no nucleus restriction

    def check(self) -> None:
        if self.temperature < 0:
            raise GenerationError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.top_k < 0:
            raise GenerationError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p={self.top_p} must be in (0, 1] (1 disables it)")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits (..., V) with every token outside the top-k / top-p set at -inf.

    top_k keeps the k largest logits (ties at the k-th value are all kept). top_p keeps, in
    order of decreasing probability, the smallest prefix whose probability mass reaches top_p
    (at least one token): a token stays when the mass of the tokens strictly before it is
    below top_p. Applied in that order, top-p on the renormalised top-k distribution."""
    out = logits.clone()
    if top_k > 0 and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]  # (..., 1)
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits.double(), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token id from the last position's logits (V,).

    Sampling draws u ~ U[0, 1) from `generator` and inverts the CDF in float64 on the CPU, so
    the result depends only on the probabilities and the seed (not on the device)."""
    logits = logits.detach().float().cpu()
    if sampling.is_greedy:
        return int(torch.argmax(logits).item())
    filtered = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    probs = torch.softmax(filtered.double(), dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True).item())
    index = min(index, probs.shape[-1] - 1)
    while index > 0 and probs[index] == 0:  # defensive: never return a filtered-out token
        index -= 1
    return index


# ----------------------------------------------------------------------------- generation


def _context_window(cfg) -> int | None:
    return None if cfg.positions.kind == "none" else cfg.max_seq_len


def cache_supported(cfg) -> bool:
    """A KV cache is exact only when earlier positions never see later tokens."""
    return cfg.attention.causal and cfg.attention.softmax == "row"


def prompt_ids(tokenizer, text: str, start_of_document: bool = True) -> list[int]:
    """The token ids of a prompt text. With start_of_document the text is preceded by eos: in
    training every document follows the eos that ends the previous one, so this is the context
    in which the model saw document starts (GPT-2's <|endoftext|> prompt convention)."""
    ids = tokenizer.encode(text)
    return [tokenizer.eos_id, *ids] if start_of_document and ids else ids


def fit_prompt(
    ids: list[int],
    cfg,
    max_new_tokens: int,
    on_long_prompt: str = "error",
    warn: Callable[[str], None] | None = None,
    label: str = "the prompt",
) -> tuple[list[int], int]:
    """(the ids to feed the model, the number of new tokens that fit the context window).

    Models trained with bos_shift (seed 001) always saw bos_shift_id at position 0: it is
    prepended here (and counts against the window). A prompt longer than the window is refused
    or, with on_long_prompt=truncate, cut from the left with a warning."""
    warn = warn or (lambda message: warnings.warn(message, stacklevel=3))
    if on_long_prompt not in LONG_PROMPT:
        raise GenerationError(
            f"on_long_prompt={on_long_prompt!r} is not valid; choose one of: error, truncate"
        )
    if max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if len(ids) == 0:
        raise GenerationError(f"{label} is empty: give at least one character of text to continue")
    lead = context_prefix(cfg)
    window = _context_window(cfg)
    if window is None:
        return [*lead, *ids], max_new_tokens
    limit = window - len(lead)  # prompt tokens the window can hold
    if len(ids) > limit:
        if on_long_prompt == "error":
            raise GenerationError(
                f"{label} has {len(ids)} tokens, more than the model's context window allows "
                f"({limit} of model.max_seq_len={window}); shorten it or pass on_long_prompt=truncate"
            )
        keep = min(limit, max(limit // 2, limit + 1 - max_new_tokens, 1))
        warn(
            f"{label} has {len(ids)} tokens, more than model.max_seq_len={window} allows; kept its last "
            f"{keep} to leave room for new tokens"
        )
        ids = list(ids[-keep:])
    ids = [*lead, *ids]
    room = window + 1 - len(ids)  # the last new token is never fed back to the model
    if max_new_tokens > room:
        warn(
            f"max_new_tokens={max_new_tokens} capped to {room}: {label} ({len(ids)} tokens) plus the new "
            f"tokens cannot exceed model.max_seq_len={window} + 1"
        )
        max_new_tokens = room
    return ids, max_new_tokens


@torch.inference_mode()
def generate_one(
    model,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """New token ids after `prompt` (which must already fit the model: see fit_prompt).

    Stops after eos (not included) or max_new_tokens. With use_cache, the prompt is run once to
    fill a preallocated KV cache and each new token is one position's forward."""
    sampling.check()
    cfg = model.cfg
    if use_cache and not cache_supported(cfg):
        use_cache = False
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(int(seed))
    else:
        generator.seed()
    if max_new_tokens <= 0:
        return []
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # (1, T)
    cache = None
    if use_cache:
        capacity = ids.shape[1] + max_new_tokens - 1
        cache = KVCache.empty(cfg, 1, max(capacity, ids.shape[1]), device, dtype)
        logits = model(ids, cache)[0, -1]  # (V,)
    else:
        logits = model(ids)[0, -1]
    out: list[int] = []
    while True:
        token = next_token(logits, sampling, generator)
        if eos_id is not None and token == eos_id:
            break
        out.append(token)
        if on_token is not None:
            on_token(token)
        if len(out) >= max_new_tokens:
            break
        step = torch.tensor([[token]], dtype=torch.long, device=device)  # (1, 1)
        if cache is not None:
            logits = model(step, cache)[0, -1]
        else:
            ids = torch.cat([ids, step], dim=1)
            logits = model(ids)[0, -1]
    return out


def generate(
    model,
    prompts: torch.Tensor | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    on_long_prompt: str = "error",
    warn: Callable[[str], None] | None = None,
    on_token: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """New token ids for each prompt (a (B, T) tensor or a list of id lists of any lengths).

    Every prompt is generated on its own with a generator seeded with `seed`, so prompt i
    gives the same tokens alone or in a batch. `on_token(i, token)` sees each new token."""
    sampling = Sampling(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
    sampling.check()
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        prompts = prompts.tolist()
    results = []
    for i, prompt in enumerate(prompts):
        label = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
        ids, n_new = fit_prompt(list(prompt), model.cfg, max_new_tokens, on_long_prompt, warn, label)
        callback = (lambda tok, _i=i: on_token(_i, tok)) if on_token is not None else None
        results.append(generate_one(model, ids, n_new, sampling, eos_id, seed, use_cache, callback))
    return results


# ----------------------------------------------------------------------------- streaming text


class TextStream:
    """Prints the decoded continuation as tokens arrive. Decoding the whole continuation each
    time (not token by token) keeps multi-token characters (byte fallback) intact; text ending
    in an incomplete character (U+FFFD) waits for the next token."""

    def __init__(self, tokenizer, out=None) -> None:
        self.tokenizer = tokenizer
        self.out = out or sys.stdout
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self._emit(text)

    def _emit(self, text: str) -> None:
        if len(text) > self.printed:
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)

    def finish(self) -> None:
        self._emit(self.tokenizer.decode(self.ids))


# ----------------------------------------------------------------------------- CLI

OPTIONS = [
    Option("model", "str", None, "export directory or training checkpoint (required)"),
    Option("prompt", "str", None, "prompt text", repeat=True),
    Option("prompts", "str", None, "file with one prompt per line"),
    Option("start_of_document", "bool", True, "precede each prompt by eos, as documents were in training"),
    Option("max_new_tokens", "int", 100, "new tokens per prompt at most"),
    Option("greedy", "bool", False, "always take the most likely token"),
    Option("temperature", "float", 1.0, "softmax temperature (0 = greedy)"),
    Option("top_k", "int", 0, "sample among the k most likely tokens (0 = all)"),
    Option("top_p", "float", 1.0, "sample from the smallest set with this much probability (1 = all)"),
    Option("seed", "int", 1234, "random seed of the sampler (none: a fresh one)"),
    Option("cache", "bool", True, "use the KV cache"),
    Option("on_long_prompt", "choice", "error", "a prompt longer than model.max_seq_len", LONG_PROMPT),
    Option("stream", "bool", True, "print tokens as they come (single prompt)"),
    Option("echo", "bool", True, "print the prompt before its continuation"),
    Option("output", "choice", "text", "text, or one JSON object per prompt", ("text", "jsonl")),
    DEVICE_OPTION,
    DTYPE_OPTION,
    TOKENIZER_OPTION,
]

SUMMARY = (
    "lmsys-generate: continue prompts with a model (export directory or training checkpoint).\n"
    'examples: python -m lmsys.generate runs/tiny-x/export prompt="The module"\n'
    '          python -m lmsys.generate model=exports/tiny prompt="Return" temperature=0.8 top_k=40'
)


def read_prompts(opts: dict) -> list[str]:
    prompts = list(opts["prompt"] or [])
    prompts = ["" if p is None else p for p in prompts]
    if opts["prompts"]:
        path = Path(opts["prompts"])
        if not path.is_file():
            raise UsageError(f"prompts={path} does not exist")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise UsageError(f"prompts={path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        for n, line in enumerate(lines, 1):
            if not line:
                raise GenerationError(f"prompts={path}: line {n} is empty; every line must be a prompt")
        prompts.extend(lines)
    if not prompts:
        raise UsageError(
            f"give prompt=TEXT (repeatable) or prompts=FILE; run `{PROG} --help` for the options"
        )
    return prompts


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def warn(message: str) -> None:
        cli_warn(PROG, message)

    def body() -> int:
        opts = parse_options(PROG, argv, OPTIONS, SUMMARY, positional="model")
        if opts is None:
            return 0
        if not opts["model"]:
            raise UsageError(f"model= is required; run `{PROG} --help` for the options")
        texts = read_prompts(opts)
        sampling = Sampling(
            greedy=opts["greedy"], temperature=opts["temperature"], top_k=opts["top_k"], top_p=opts["top_p"]
        )
        sampling.check()
        for i, text in enumerate(texts):
            if text == "":
                label = "the prompt" if len(texts) == 1 else f"prompt {i + 1}"
                raise GenerationError(f"{label} is empty: give at least one character of text to continue")
        device = resolve_device(opts["device"])
        model, tok, _ = load_model(
            opts["model"], device, resolve_dtype(opts["dtype"]), opts["tokenizer"], warn=warn
        )
        prepare_kernels(model.cfg.kernels, device, next(model.parameters()).dtype)
        use_cache = opts["cache"]
        if use_cache and not cache_supported(model.cfg):
            warn("this model's attention is not causal row-softmax; generating without a KV cache")
            use_cache = False
        # Every prompt is checked before anything is generated: a bad one fails the whole call.
        planned = []
        for i, text in enumerate(texts):
            label = "the prompt" if len(texts) == 1 else f"prompt {i + 1}"
            ids = prompt_ids(tok, text, opts["start_of_document"])
            planned.append(
                fit_prompt(ids, model.cfg, opts["max_new_tokens"], opts["on_long_prompt"], warn, label)
            )
        single_stream = len(texts) == 1 and opts["stream"] and opts["output"] == "text"
        for i, (text, (ids, n_new)) in enumerate(zip(texts, planned)):
            stream = TextStream(tok) if single_stream else None
            if single_stream and opts["echo"]:
                sys.stdout.write(text)
                sys.stdout.flush()
            new = generate_one(model, ids, n_new, sampling, tok.eos_id, opts["seed"], use_cache, stream)
            completion = tok.decode(new)
            if stream is not None:
                stream.finish()
                sys.stdout.write("\n")
            elif opts["output"] == "jsonl":
                print(
                    json.dumps(
                        {"prompt": text, "completion": completion, "new_tokens": len(new)}, ensure_ascii=False
                    )
                )
            else:
                if i > 0:
                    print("-" * 40)
                print((text if opts["echo"] else "") + completion)
            sys.stdout.flush()
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
