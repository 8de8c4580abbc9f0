"""lmsys-generate: continue prompts with a trained model (SPEC section 7).

    python -m lmsys.generate runs/tiny-x/export prompt="The module"           # streams to the terminal
    python -m lmsys.generate model=runs/tiny-x prompt="def " prompt="import " greedy=true
    python -m lmsys.generate model=exports/tiny prompts=prompts.txt temperature=0.8 top_p=0.95 seed=1
    python -m lmsys.generate exports/tiny chat=true prompt="What does the json module do?" greedy=true

`model=` (or the first argument) is an export directory (lmsys-export) or a training checkpoint
(run dir, checkpoints/ dir or tag dir). A prompt starts a document: it is preceded by eos, as
every document was in training (start_of_document=false feeds the bare text); a bos_shift model
also gets its bos_shift_id at position 0, as in its training loss. Decoding: greedy (or
temperature=0), else sampling from softmax(logits / temperature) restricted to the top_k most
likely tokens and then to the smallest set whose probability reaches top_p. Generation stops
at eos or after max_new_tokens.

chat=true treats each prompt as a user's message: it is rendered with the model's chat template
(the one its data was prepared with, kept with its tokenizer; lmsys's default, ChatML, for a
tokenizer without one: lmsys/data/chat.py), `system=` adding a system message before it, and
the generation prompt after it; the reply stops at the template's end-of-turn token (or eos) and
is printed alone.

compile=auto|true|false (auto: on CUDA) compiles the model with torch.compile and decodes through
a StaticKVCache, whose shapes never change: a prompt graph and a decode graph, none per token; a
finished row then stays in the batch, unread (lmsys/model/compiling.py).

How batches, long prompts and the KV cache behave: lmsys/inference/generation.py.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from lmsys.cli import MODEL_LOADING_OPTIONS, Option, parse_options, run_cli
from lmsys.core.console import warn as cli_warn
from lmsys.core.errors import UsageError
from lmsys.core.runtime import resolve_device, resolve_dtype
from lmsys.data.chat import ChatTemplate
from lmsys.inference.generation import (
    LONG_PROMPT,
    GenerationError,
    Sampling,
    cache_supported,
    fit_prompt,
    generate_batch,
    generate_one,
    prompt_ids,
)
from lmsys.inference.lengths import choose_window
from lmsys.interop.export_dir import load_model
from lmsys.model.compiling import compiled_for_cli
from lmsys.model.ops import prepare_kernels

PROG = "lmsys-generate"

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
    Option("chat", "bool", False, "a prompt is a user's message: the chat template, the reply alone"),
    Option("system", "str", None, "chat: a system message before each prompt"),
    Option("max_new_tokens", "int", 100, "new tokens per prompt at most"),
    Option("greedy", "bool", False, "always take the most likely token"),
    Option("temperature", "float", 1.0, "softmax temperature (0 = greedy)"),
    Option("top_k", "int", 0, "sample among the k most likely tokens (0 = all)"),
    Option("top_p", "float", 1.0, "sample from the smallest set with this much probability (1 = all)"),
    Option("seed", "int", 1234, "random seed of the sampler (none: a fresh one)"),
    Option("cache", "bool", True, "use the KV cache"),
    Option("batch_size", "int", 8, "prompts generated together, as one padded batch"),
    Option("seq_len", "int", None, "context window (default: the trained length, else max_seq_len)"),
    Option("on_long_prompt", "choice", "error", "a prompt longer than model.max_seq_len", LONG_PROMPT),
    Option("stream", "bool", True, "print tokens as they come (single prompt)"),
    Option("echo", "bool", True, "print the prompt before its continuation"),
    Option("output", "choice", "text", "text, or one JSON object per prompt", ("text", "jsonl")),
    *MODEL_LOADING_OPTIONS,
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
        if not lines:
            raise UsageError(f"prompts={path} is empty: write one prompt per line (or give prompt=TEXT)")
        for n, line in enumerate(lines, 1):
            if not line:
                raise GenerationError(f"prompts={path}: line {n} is empty; every line must be a prompt")
        prompts.extend(lines)
    if not prompts:
        raise UsageError(
            f"give prompt=TEXT (repeatable) or prompts=FILE; run `{PROG} --help` for the options"
        )
    return prompts


def _print_result(i: int, prompt: str, completion: str, n_tokens: int, opts: dict) -> None:
    if opts["output"] == "jsonl":
        record = {"prompt": prompt, "completion": completion, "new_tokens": n_tokens}
        print(json.dumps(record, ensure_ascii=False))
    else:
        if i > 0:
            print("-" * 40)
        print((prompt if opts["echo"] else "") + completion)
    sys.stdout.flush()


def _generate_and_print(
    model, tok, texts, planned, sampling: Sampling, use_cache: bool, static: bool, opts, stop_ids
) -> None:
    """One streamed prompt, or padded batches of batch_size prompts printed as each finishes."""
    if len(texts) == 1 and opts["stream"] and opts["output"] == "text":
        (ids, n_new), stream = planned[0], TextStream(tok)
        if opts["echo"]:
            sys.stdout.write(texts[0])
            sys.stdout.flush()
        generate_one(
            model, ids, n_new, sampling, stop_ids, opts["seed"], use_cache, stream, static_cache=static
        )
        stream.finish()
        sys.stdout.write("\n")
        return
    for start in range(0, len(planned), opts["batch_size"]):  # one padded batch at a time
        chunk = planned[start : start + opts["batch_size"]]
        news = generate_batch(
            model,
            [ids for ids, _ in chunk],
            [n for _, n in chunk],
            sampling,
            stop_ids,
            opts["seed"],
            use_cache,
            static_cache=static,
        )
        for i, new in enumerate(news, start):
            _print_result(i, texts[i], tok.decode(new), len(new), opts)


def _prompt_encoder(tok, opts: dict) -> tuple[Callable[[str], list[int]], tuple[int, ...]]:
    """(prompt text -> ids, the tokens that end a reply): the chat template's rendering of a user
    message and its end of turn with chat=true, else the text (after eos: start_of_document) and eos."""
    if not opts["chat"]:
        if opts["system"] is not None:
            raise UsageError("system= is a chat message: give chat=true with it")
        return (lambda text: prompt_ids(tok, text, opts["start_of_document"])), (tok.eos_id,)
    template = ChatTemplate(tok)
    system = [{"role": "system", "content": opts["system"]}] if opts["system"] else []
    stop_ids = (*template.end_of_turn, tok.eos_id)
    return (lambda text: template.prompt([*system, {"role": "user", "content": text}])), stop_ids


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
        if opts["batch_size"] is None or opts["batch_size"] < 1:
            raise UsageError(f"batch_size={opts['batch_size']} must be >= 1")
        sampling = Sampling(
            greedy=opts["greedy"], temperature=opts["temperature"], top_k=opts["top_k"], top_p=opts["top_p"]
        )
        sampling.check()
        for i, text in enumerate(texts):
            if text == "":
                label = "the prompt" if len(texts) == 1 else f"prompt {i + 1}"
                raise GenerationError(f"{label} is empty: give at least one character of text to continue")
        device = resolve_device(opts["device"])
        dtype, tokenizer, kernels = resolve_dtype(opts["dtype"]), opts["tokenizer"], opts["kernels"]
        model, tok, meta = load_model(opts["model"], device, dtype, tokenizer, warn=warn, kernels=kernels)
        prepare_kernels(model.cfg.kernels, device, next(model.parameters()).dtype)
        use_cache = opts["cache"]
        if use_cache and not cache_supported(model.cfg):
            warn("this model's attention is not causal row-softmax; generating without a KV cache")
            use_cache = False
        window = choose_window(opts["seq_len"], model.cfg, meta, warn)
        if not 1 <= window <= model.cfg.max_seq_len:
            raise UsageError(f"seq_len={window} must be in [1, {model.cfg.max_seq_len}] (model.max_seq_len)")
        encode, stop_ids = _prompt_encoder(tok, opts)
        if opts["chat"]:
            opts["echo"] = False  # the reply alone: the prompt is a message, not the reply's beginning
        # Every prompt is checked before anything is generated: a bad one fails the whole call.
        planned = []
        for i, text in enumerate(texts):
            label = "the prompt" if len(texts) == 1 else f"prompt {i + 1}"
            new = opts["max_new_tokens"]
            planned.append(
                fit_prompt(encode(text), model.cfg, new, opts["on_long_prompt"], warn, label, window)
            )
        with compiled_for_cli(opts["compile"], device, PROG, "generation", warn) as compile_model:
            static = compile_model(model)  # a compiled model decodes through a StaticKVCache
            _generate_and_print(model, tok, texts, planned, sampling, use_cache, static, opts, stop_ids)
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
