"""Generation: sampling, fitting prompts to the window, and batched decoding through the KV caches
(lmsys/model/kv_cache.py), for lmsys-generate (lmsys/generate.py) and the lm_eval model.

Batches: up to batch_size prompts (default 8) are generated together, as one batch padded on
the left, through one KV cache. Each row has its own positions (the padding is not counted),
never attends to padding or to another row, and has its own random generator seeded with
`seed`; a row that stops (eos, max_new_tokens) leaves the batch without changing the others. So
a prompt gives the same text alone or in a batch; the only difference is float rounding (a
batched matrix product may sum in another order than the same row alone), which changes a
token only at a near-tie of two logits (greedy) or of a sampled CDF boundary (README,
"Generation"). batch_size=1 generates the prompts one after another.

Lengths. A model with positions sees at most model.max_seq_len tokens; lmsys-generate's window
(seq_len) is by default the length the model was trained at (lmsys/inference/lengths.py). A
longer prompt is an error (on_long_prompt=error, the default) or, with on_long_prompt=truncate,
is cut from the left with a warning to its last max(max_seq_len + 1 - max_new_tokens,
max_seq_len // 2) tokens (so the new tokens fit where they can). The prompt plus the new tokens
may reach max_seq_len + 1 (the last token is never fed back); max_new_tokens is capped to fit,
with a warning. An empty prompt is an error. Models with positions.kind=none have no window.

The KV cache (cache=true, the default) makes each new token cost O(T) instead of re-running
the whole prefix; cached and uncached generation give the same tokens. Models whose outputs at
earlier positions depend on later tokens (attention.causal=false, attention.softmax=matrix)
cannot use a cache and are generated without one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lmsys.core.config import autoregressive, context_prefix
from lmsys.core.errors import UsageError
from lmsys.model.compiling import vary
from lmsys.model.kv_cache import KVCache, StaticKVCache

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
    return autoregressive(cfg)


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
    window: int | None = None,
) -> tuple[list[int], int]:
    """(the ids to feed the model, the number of new tokens that fit the context window: `window`
    tokens, lmsys-generate's seq_len, else model.max_seq_len).

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
    name = "model.max_seq_len" if window is None else "seq_len"
    window = window if _context_window(cfg) is not None and window is not None else _context_window(cfg)
    if window is None:
        return [*lead, *ids], max_new_tokens
    limit = window - len(lead)  # prompt tokens the window can hold
    if len(ids) > limit:
        if on_long_prompt == "error":
            raise GenerationError(
                f"{label} has {len(ids)} tokens, more than the model's context window allows "
                f"({limit} of {name}={window}); shorten it or pass on_long_prompt=truncate"
            )
        keep = min(limit, max(limit // 2, limit + 1 - max_new_tokens, 1))
        warn(
            f"{label} has {len(ids)} tokens, more than {name}={window} allows; kept its last "
            f"{keep} to leave room for new tokens"
        )
        ids = list(ids[-keep:])
    ids = [*lead, *ids]
    room = window + 1 - len(ids)  # the last new token is never fed back to the model
    if max_new_tokens > room:
        warn(
            f"max_new_tokens={max_new_tokens} capped to {room}: {label} ({len(ids)} tokens) plus the new "
            f"tokens cannot exceed {name}={window} + 1"
        )
        max_new_tokens = room
    return ids, max_new_tokens


def _generator(seed: int | None) -> torch.Generator:
    """The sampler's own random stream: seeded, or fresh when seed is None."""
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(int(seed))
    else:
        generator.seed()
    return generator


def _left_padded(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (B, T_max): every prompt ends in the last column, so the next token of
    every row goes to the same cache slot; mask is False on the padding (id 0, never attended)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = True
    return ids.to(device), mask.to(device)


def _static_cache(model, ids: torch.Tensor, mask: torch.Tensor, slots: int) -> StaticKVCache:
    """A StaticKVCache of `slots` slots for the batch `ids` (B, T), whose width and length
    torch.compile is told vary (one prompt graph for every batch of this size)."""
    device, dtype = ids.device, next(model.parameters()).dtype
    cache = StaticKVCache.empty(model.cfg, ids.shape[0], slots, device, dtype)
    for tensor in (*cache.keys, *cache.values):
        vary(tensor, 2)
    for tensor in (cache.real, ids, mask):
        vary(tensor, 1)
    return cache


@torch.inference_mode()
def generate_batch(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    sampling: Sampling = Sampling(),
    eos_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    on_token: Callable[[int, int], None] | None = None,
    stop: Callable[[int, list[int]], bool] | None = None,
    static_cache: bool = False,
) -> list[list[int]]:
    """New token ids after each prompt (each already fitted to the model: see fit_prompt).

    The prompts run as one batch, padded on the left, through one KV cache: the prompt forward,
    then one position per step for every row still generating. Row i gets its own random
    generator seeded with `seed`, its own positions, and never sees another row's tokens, so it
    gives the tokens prompts[i] gives alone (the README's "Generation" says where float rounding
    can differ). A row stops after eos (not included; `eos_id` may name several tokens, e.g. a
    chat template's end of turn and the eos), after max_new_tokens[i] tokens, or when
    stop(i, its tokens) is true, and then leaves the batch. `on_token(i, token)` sees each new
    token. Without a cache (use_cache=False, or a model that cannot use one) the prompts are
    generated one after another, each re-running its whole prefix per token.

    static_cache=True (a compiled model: lmsys.model.compiling) keeps every shape of a decode step
    fixed: a StaticKVCache, and a row that stops stays in the batch (its tokens are not read),
    so one compiled graph serves every step."""
    sampling.check()
    generators = [_generator(seed) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    stop_ids = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())

    def take(row: int, token: int) -> bool:
        """Record row's next token; whether the row goes on."""
        if token in stop_ids:
            return False
        outputs[row].append(token)
        if on_token is not None:
            on_token(row, token)
        return len(outputs[row]) < max_new_tokens[row] and not (stop is not None and stop(row, outputs[row]))

    active = [row for row in range(len(prompts)) if max_new_tokens[row] > 0]  # batch slot -> row
    if not active:
        return outputs
    device = next(model.parameters()).device
    if not (use_cache and cache_supported(model.cfg)):
        for row in active:  # one prompt at a time, its whole sequence each step
            ids = torch.tensor([list(prompts[row])], dtype=torch.long, device=device)  # (1, T)
            while take(row, next_token(model(ids)[0, -1], sampling, generators[row])):
                ids = torch.cat([ids, ids.new_tensor([[outputs[row][-1]]])], dim=1)  # (1, T + 1)
        return outputs
    ids, mask = _left_padded([prompts[row] for row in active], device)  # (B, T)
    slots = ids.shape[1] + max(max_new_tokens[row] for row in active) - 1  # the last token is not fed
    if static_cache:
        cache: KVCache | StaticKVCache = _static_cache(model, ids, mask, slots)
        logits = model(ids, cache, mask)[:, -1]  # (B, V)
    else:
        cache = KVCache.empty(model.cfg, len(active), slots, device, next(model.parameters()).dtype)
        logits = model(ids, cache, None if bool(mask.all()) else mask)[:, -1]  # (B, V)
    live = list(range(len(active)))  # the batch slots still generating
    while True:
        last = logits.float().cpu()  # (B, V): one transfer per step
        live = [
            slot
            for slot in live
            if take(active[slot], next_token(last[slot], sampling, generators[active[slot]]))
        ]
        if not live:
            return outputs
        if not static_cache and len(live) < len(active):  # finished rows leave; the others do not see them
            cache = cache.select(torch.tensor(live, device=device))
            active, live = [active[slot] for slot in live], list(range(len(live)))
        going = set(live)
        step = [[outputs[row][-1] if slot in going else 0] for slot, row in enumerate(active)]
        logits = model(torch.tensor(step, dtype=torch.long, device=device), cache)[:, -1]  # (B, V)


def generate_one(
    model,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    on_token: Callable[[int], None] | None = None,
    static_cache: bool = False,
) -> list[int]:
    """New token ids after one prompt (which must already fit the model: see fit_prompt): a batch
    of one. Stops after eos (not included) or max_new_tokens. With use_cache, the prompt is run
    once to fill a preallocated KV cache and each new token is one position's forward."""
    callback = (lambda _row, token: on_token(token)) if on_token is not None else None
    return generate_batch(
        model,
        [prompt],
        [max_new_tokens],
        sampling,
        eos_id,
        seed,
        use_cache,
        callback,
        static_cache=static_cache,
    )[0]


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
    batch_size: int = 8,
    on_long_prompt: str = "error",
    warn: Callable[[str], None] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    static_cache: bool = False,
) -> list[list[int]]:
    """New token ids for each prompt (a (B, T) tensor or a list of id lists of any lengths), in
    batches of `batch_size` prompts (generate_batch; static_cache=True for a compiled model).

    Every prompt has its own generator seeded with `seed`, so prompt i gives the same tokens
    alone or in a batch. `on_token(i, token)` sees each new token."""
    sampling = Sampling(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
    sampling.check()
    if batch_size < 1:
        raise GenerationError(f"batch_size={batch_size} must be >= 1")
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        prompts = prompts.tolist()
    planned = []  # every prompt is checked before anything is generated
    for i, prompt in enumerate(prompts):
        label = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
        planned.append(fit_prompt(list(prompt), model.cfg, max_new_tokens, on_long_prompt, warn, label))
    results: list[list[int]] = []
    for start in range(0, len(planned), batch_size):
        chunk = planned[start : start + batch_size]
        callback = (lambda row, token, _s=start: on_token(_s + row, token)) if on_token is not None else None
        ids, n_new = [ids for ids, _ in chunk], [n for _, n in chunk]
        results += generate_batch(
            model, ids, n_new, sampling, eos_id, seed, use_cache, callback, static_cache=static_cache
        )
    return results
