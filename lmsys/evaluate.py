"""lmsys-eval: perplexity and bits per byte of a model on a text file or a prepared validation split.

    python -m lmsys.evaluate runs/tiny-x/export text=notes.txt
    python -m lmsys.evaluate model=runs/tiny-x data=data/default          # the validation split
    python -m lmsys.evaluate run=runs/tiny-x                              # every checkpoint: table + PNG
    python -m lmsys.evaluate exports/tiny harness=hellaswag,mytask include_path=tasks/   # lm_eval tasks

`model=` is an export directory or a checkpoint (run dir, checkpoints/ dir or tag dir); `run=`
evaluates every checkpoint tag of a run, prints a table and writes a plot of loss and
perplexity against the step (plot=, default <run>/eval.png). Without text= or data=, a
checkpoint is evaluated on the validation split of its own data.dir.

What is measured. The evaluated token stream (the text file encoded, or the split's tokens,
documents separated by eos) is cut into consecutive windows of seq_len tokens (default
model.max_seq_len); every token is predicted exactly once, from the tokens before it in its
window. The first token of the stream is predicted from eos (the document separator that
precedes every document in training); a window's first token from the last token of the
previous window. When seq_len does not divide the stream, the last window ends at the stream's
end with a full seq_len tokens of context and scores only the tokens not scored yet (the
training loader's last sequence, and lm-evaluation-harness's rolling windows, do the same).
Models with bos_shift (seed 001) predict each window's first token from bos_shift_id, as in
their training loss. Then, with N tokens and a total negative log-likelihood of NLL nats:
    loss = NLL / N (nats/token),  perplexity = exp(NLL / N),  bits/token = NLL / N / ln 2,
    bits per byte = NLL / ln 2 / B,
where B is the number of UTF-8 bytes of the evaluated text: the file's bytes, or for a data
split the bytes of its decoded tokens (eos decodes to nothing). Bits per byte compares models
with different tokenizers; perplexity only models that share one.

harness=TASK[,TASK...] runs lm-evaluation-harness tasks (names lm_eval knows, or tasks of the YAML
files under include_path=) on model= through lm_eval's `lmsys` model (lmsys/harness.py), and
prints lm_eval's results table: the shortcut of `python -m lmsys.harness --model lmsys
--model_args path=MODEL --tasks ... --include_path DIR`. batch_size, seq_len (the window), device,
dtype and tokenizer go to the model; num_fewshot and limit to lm_eval; json= gets lm_eval's
results. It needs the `eval` extra (pip install 'lmsys[eval]').

compile=auto|true|false (auto: on CUDA) compiles the model with torch.compile for perplexity runs;
every forward is then a full batch (the last one padded with copies of its last window): one graph.

Errors print one line `lmsys-eval: error: ...` on stderr and exit 2.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lmsys.checkpoint import list_checkpoints, resolve
from lmsys.cli import Option, parse_options, run_cli, warn
from lmsys.compiling import COMPILE_OPTION, compiled_for_cli
from lmsys.errors import LmsysError, UsageError
from lmsys.export import TOKENIZER_OPTION, load_model
from lmsys.model import next_token_pairs, tokens_per_sample
from lmsys.ops import prepare_kernels
from lmsys.plots import plot_run
from lmsys.rundir import CHECKPOINTS, EVAL_PLOT_FILE
from lmsys.runtime import DEVICE_OPTION, DTYPE_OPTION, resolve_device, resolve_dtype
from lmsys.shards import PreparedData

PROG = "lmsys-eval"
LN2 = math.log(2.0)


class EvalError(UsageError):
    """Bad evaluation input; one line."""


@dataclass
class EvalResult:
    tokens: int  # predicted tokens N
    bytes: int  # UTF-8 bytes B of the evaluated text
    nll: float  # total negative log-likelihood, nats

    @property
    def loss(self) -> float:
        return self.nll / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))

    @property
    def bits_per_token(self) -> float:
        return self.loss / LN2

    @property
    def bits_per_byte(self) -> float:
        return self.nll / LN2 / self.bytes if self.bytes else float("nan")

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "loss": self.loss,
            "perplexity": self.perplexity,
            "bits_per_token": self.bits_per_token,
            "bits_per_byte": self.bits_per_byte,
        }


# ----------------------------------------------------------------------------- scoring


@torch.inference_mode()
def token_nll(
    model,
    tokens: Sequence[int] | np.ndarray | torch.Tensor,
    seq_len: int | None = None,
    batch_size: int = 8,
    first_context: int = 2,
    full_batches: bool = False,
) -> torch.Tensor:
    """Negative log-likelihood (nats, float64) of every token of `tokens` (1-D), in windows of
    `seq_len` (see the module docstring for the context each window's first token gets).
    full_batches=True (a compiled model) pads every forward to batch_size windows, repeating
    the last one, so that every forward has the same shape (one graph)."""
    cfg = model.cfg
    seq_len = seq_len or cfg.max_seq_len
    if seq_len < 1:
        raise EvalError(f"seq_len={seq_len} must be >= 1")
    if cfg.positions.kind != "none" and seq_len > cfg.max_seq_len:
        raise EvalError(
            f"seq_len={seq_len} is longer than the model's context (model.max_seq_len={cfg.max_seq_len})"
        )
    device = next(model.parameters()).device
    stream = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    n = stream.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.float64)
    # A window's targets are stream[s : s + L]; the model's objective (next_token_pairs) reads them
    # from a sample that starts `lead` tokens earlier: 1 with the usual shift (the token before
    # the window, first_context for the stream's first token), 0 under bos_shift.
    lead = tokens_per_sample(cfg, seq_len) - seq_len
    padded = torch.cat([torch.tensor([first_context]), stream])  # (n + 1,): padded[i + 1] = stream[i]
    out = torch.empty(n, dtype=torch.float64)
    n_full = n // seq_len
    starts = list(range(0, n_full * seq_len, seq_len))
    for b in range(0, len(starts), batch_size):
        group = starts[b : b + batch_size]
        samples = torch.stack([padded[s + 1 - lead : s + 1 + seq_len] for s in group])  # (B, lead + L)
        rows = batch_size if full_batches else len(group)
        out[group[0] : group[-1] + seq_len] = _window_nll(model, samples, device, rows).flatten()
    s = n_full * seq_len
    if s < n:  # the rest: a window ending at the stream's end, with as much context as it holds
        first = max(0, n - seq_len) + 1 - lead  # in padded
        rows = batch_size if full_batches else 1
        out[s:] = _window_nll(model, padded[first:][None], device, rows).flatten()[s - n :]
    return out


def _window_nll(model, samples: torch.Tensor, device: torch.device, rows: int) -> torch.Tensor:
    """NLL (B, S) of the windows samples (B, lead + S), run as a batch of `rows` >= B windows
    (the last one repeated)."""
    filled = torch.cat([samples, samples[-1:].expand(rows - len(samples), -1)])  # (rows, lead + S)
    inputs, targets, _ = next_token_pairs(model.cfg, filled)  # (rows, S) each
    logits = model(inputs.to(device)).float()  # (rows, S, V)
    nll = F.cross_entropy(logits.flatten(0, 1), targets.to(device).flatten(), reduction="none")
    return nll.view_as(targets)[: len(samples)].double().cpu()


def decoded_bytes(tokenizer, tokens: np.ndarray, eos_id: int, chunk: int = 1 << 20) -> int:
    """UTF-8 bytes of the decoded tokens, decoding in pieces cut after an eos (exact: no
    multi-token character spans a document boundary)."""
    total, start, n = 0, 0, len(tokens)
    while start < n:
        end = min(n, start + chunk)
        if end < n:
            eos = np.flatnonzero(np.asarray(tokens[start:end]) == eos_id)
            if eos.size:
                end = start + int(eos[-1]) + 1
        total += len(tokenizer.decode(np.asarray(tokens[start:end]).tolist()).encode("utf-8"))
        start = end
    return total


def evaluate_tokens(
    model,
    tokenizer,
    tokens: np.ndarray,
    seq_len: int | None = None,
    batch_size: int = 8,
    n_bytes: int | None = None,
    full_batches: bool = False,
) -> EvalResult:
    nll = token_nll(model, tokens, seq_len, batch_size, tokenizer.eos_id, full_batches)
    if n_bytes is None:
        n_bytes = decoded_bytes(tokenizer, np.asarray(tokens), tokenizer.eos_id)
    return EvalResult(tokens=int(nll.numel()), bytes=int(n_bytes), nll=float(nll.sum().item()))


def evaluate_text(
    model,
    tokenizer,
    text: str,
    seq_len: int | None = None,
    batch_size: int = 8,
    max_tokens: int | None = None,
    full_batches: bool = False,
) -> EvalResult:
    """Score a text: its tokens (the whole text, or its first max_tokens tokens)."""
    tokens = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if len(tokens) == 0:
        raise EvalError("the text is empty: nothing to evaluate")
    n_bytes = len(text.encode("utf-8"))
    if max_tokens and max_tokens < len(tokens):
        tokens = tokens[:max_tokens]
        n_bytes = None  # the decoded prefix's bytes
    return evaluate_tokens(model, tokenizer, tokens, seq_len, batch_size, n_bytes, full_batches)


def split_tokens(data_dir: str | Path, tokenizer, split: str = "val") -> np.ndarray:
    """The tokens of a prepared data split (lmsys.data.PreparedData, checked against its
    manifest), in shard order: documents each followed by eos. The data's tokenizer must be the
    model's."""
    if not Path(data_dir).is_dir():
        raise EvalError(f"data={data_dir} does not exist (expected a directory written by lmsys-prepare)")
    data = PreparedData(data_dir)
    if data.tokenizer_sha256 != tokenizer.sha256:
        raise EvalError(
            f"the tokenizer does not match the model: data={data_dir} was encoded with tokenizer sha256 "
            f"{data.tokenizer_sha256[:12]}, the model's is {tokenizer.sha256[:12]}"
        )
    tokens = data.split(split)
    if len(tokens) == 0:
        raise EvalError(f"data={data_dir} has no {split} tokens")
    return tokens.read(0, len(tokens)).astype(np.int64)


# ----------------------------------------------------------------------------- sources


@dataclass
class Source:
    kind: str  # text | data
    path: Path
    label: str


def pick_source(opts: dict, checkpoint_config: dict | None) -> Source:
    if opts["text"] and opts["data"]:
        raise UsageError("give text= or data=, not both")
    if opts["text"]:
        path = Path(opts["text"])
        if not path.is_file():
            raise EvalError(f"text={path} does not exist")
        return Source("text", path, f"{path}")
    if opts["data"]:
        return Source("data", Path(opts["data"]), f"{opts['data']} ({opts['split']} split)")
    data_dir = ((checkpoint_config or {}).get("data") or {}).get("dir")
    if data_dir:
        return Source("data", Path(data_dir), f"{data_dir} ({opts['split']} split, the run's data.dir)")
    raise UsageError("give text=FILE or data=DIR (a prepared data directory) to evaluate on")


def evaluate_source(model, tokenizer, source: Source, opts: dict, full_batches: bool = False) -> EvalResult:
    """The model on the source, as opts say; full_batches for a compiled model (token_nll)."""
    if source.kind == "text":
        try:
            text = source.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise EvalError(f"text={source.path} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
        return evaluate_text(
            model, tokenizer, text, opts["seq_len"], opts["batch_size"], opts["max_tokens"], full_batches
        )
    tokens = split_tokens(source.path, tokenizer, opts["split"])
    if opts["max_tokens"]:
        tokens = tokens[: opts["max_tokens"]]
    return evaluate_tokens(model, tokenizer, tokens, opts["seq_len"], opts["batch_size"], None, full_batches)


# ----------------------------------------------------------------------------- CLI

OPTIONS = [
    Option("model", "str", None, "export directory or checkpoint to evaluate"),
    Option("run", "str", None, "run directory: evaluate every checkpoint (table + plot)"),
    Option("text", "str", None, "UTF-8 text file to evaluate on"),
    Option("data", "str", None, "prepared data directory (lmsys-prepare) to evaluate on"),
    Option("split", "choice", "val", "split of data=", ("val", "train")),
    Option("seq_len", "int", None, "window length in tokens (default: model.max_seq_len)"),
    Option("batch_size", "int", 8, "windows per forward"),
    Option("max_tokens", "int", None, "evaluate only the first N tokens"),
    Option("plot", "str", None, "PNG for run= (default: <run>/eval.png)"),
    Option("json", "str", None, "also write the results as JSON to this file"),
    Option("harness", "str", None, "lm-evaluation-harness tasks to run on model=, comma-separated"),
    Option("include_path", "str", None, "directory of lm_eval task YAML files (harness=)"),
    Option("num_fewshot", "int", None, "few-shot examples per task (harness=; default: the task's)"),
    Option("limit", "float", None, "examples per task at most, or a fraction if < 1 (harness=)"),
    COMPILE_OPTION,
    DEVICE_OPTION,
    DTYPE_OPTION,
    TOKENIZER_OPTION,
]

SUMMARY = (
    "lmsys-eval: perplexity and bits per byte of a model (export or checkpoint) on a text file or a\n"
    "prepared data split; run= evaluates every checkpoint of a run.\n"
    "example: python -m lmsys.evaluate model=exports/tiny text=notes.txt"
)


def _summary_line(result: EvalResult) -> str:
    return (
        f"loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f}, "
        f"{result.bits_per_token:.4f} bits/token, {result.bits_per_byte:.4f} bits/byte "
        f"({result.tokens:,} tokens, {result.bytes:,} bytes)"
    )


def _compiling(opts: dict, device: torch.device):
    """compile= (lmsys.compiling.compiled_for_cli) for the evaluations of one call."""
    return compiled_for_cli(opts["compile"], device, PROG, "evaluation", lambda m: warn(PROG, m))


def _evaluate_model(opts: dict, device: torch.device, dtype: torch.dtype) -> None:
    path = Path(opts["model"])
    model, tok, meta = load_model(path, device, dtype, opts["tokenizer"], warn=lambda m: warn(PROG, m))
    prepare_kernels(model.cfg.kernels, device, next(model.parameters()).dtype)
    source = pick_source(opts, meta.get("train_config"))
    with _compiling(opts, device) as compile_model:
        result = evaluate_source(model, tok, source, opts, full_batches=compile_model(model))
    print(f"{PROG}: {path} on {source.label}")
    print(f"{PROG}: {_summary_line(result)}")
    if opts["json"]:
        report = {"model": str(path), "source": source.label, **result.as_dict()}
        Path(opts["json"]).write_text(json.dumps(report, indent=1) + "\n")


def _evaluate_run(opts: dict, device: torch.device, dtype: torch.dtype) -> None:
    """Every checkpoint of a run, oldest first: a table, a plot, optionally JSON. A damaged
    checkpoint is skipped with a warning."""
    run = Path(opts["run"])
    if not run.is_dir():
        raise EvalError(f"run directory {run} does not exist")
    tags = [path for _, path in reversed(list_checkpoints(run / CHECKPOINTS))]
    if not tags:
        raise EvalError(f"{run} holds no checkpoints (no {CHECKPOINTS}/step_* directories)")
    newest = resolve(run, check_hashes=False)
    source = pick_source(opts, newest.state.config)
    rows = []
    print(f"{PROG}: {run}: {len(tags)} checkpoint(s) on {source.label}")
    print(f"{'step':>9} {'tokens':>10} {'loss':>9} {'ppl':>10} {'bits/byte':>10}  checkpoint")
    with _compiling(opts, device) as compile_model:  # every checkpoint's model: one graph serves all
        for tag_dir in tags:
            try:
                model, tok, meta = load_model(tag_dir, device, dtype, opts["tokenizer"])
            except LmsysError as exc:
                warn(PROG, f"skipping {tag_dir.name}: {exc}")
                continue
            prepare_kernels(model.cfg.kernels, device, next(model.parameters()).dtype)
            result = evaluate_source(model, tok, source, opts, full_batches=compile_model(model))
            row = {"step": int(meta.get("step") or 0), "checkpoint": tag_dir.name, **result.as_dict()}
            rows.append(row)
            print(
                f"{row['step']:>9,} {result.tokens:>10,} {result.loss:>9.4f} {result.perplexity:>10.3f} "
                f"{result.bits_per_byte:>10.4f}  {tag_dir.name}",
                flush=True,
            )
    if not rows:
        raise EvalError(f"no checkpoint of {run} could be loaded")
    plot = Path(opts["plot"]) if opts["plot"] else run / EVAL_PLOT_FILE
    plot_run(rows, plot, f"{run.name}: {source.label}")
    print(f"{PROG}: plot: {plot}")
    if opts["json"]:
        report = {"run": str(run), "source": source.label, "rows": rows}
        Path(opts["json"]).write_text(json.dumps(report, indent=1) + "\n")


def _evaluate_harness(opts: dict) -> None:
    """harness=: lm_eval's tasks on model= (module docstring)."""
    try:  # lm_eval is the optional `eval` extra: imported only when harness= asks for it
        from lmsys import harness
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("lm_eval"):
            raise
        raise EvalError("harness= needs lm-evaluation-harness: pip install 'lmsys[eval]'") from None
    if opts["run"] or opts["text"] or opts["data"]:
        raise UsageError("harness= evaluates model= on lm_eval tasks; it takes no run=, text= or data=")
    tasks = [task.strip() for task in opts["harness"].split(",") if task.strip()]
    if not tasks:
        raise UsageError(
            f"harness={opts['harness']!r} names no task; give lm_eval task names, comma-separated"
        )
    settings = {"batch_size": opts["batch_size"], "max_length": opts["seq_len"], "device": opts["device"]}
    settings.update(dtype=opts["dtype"], tokenizer=opts["tokenizer"])
    model_args = {key: value for key, value in settings.items() if value is not None}
    results = harness.run_tasks(
        opts["model"], tasks, opts["include_path"], opts["num_fewshot"], opts["limit"], model_args
    )
    print(f"{PROG}: {opts['model']} on lm_eval tasks {', '.join(tasks)}")
    print(harness.results_table(results))
    if opts["json"]:
        Path(opts["json"]).write_text(json.dumps(results, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts = parse_options(PROG, argv, OPTIONS, SUMMARY, positional="model")
        if opts is None:
            return 0
        if opts["harness"] is not None:
            if not opts["model"]:
                raise UsageError(f"harness= needs model=; run `{PROG} --help` for the options")
            if opts["compile"] == "true":
                raise UsageError(
                    "compile=true compiles perplexity runs; harness= runs lm_eval's requests eager"
                )
            _evaluate_harness(opts)
            return 0
        if bool(opts["model"]) == bool(opts["run"]):
            raise UsageError(f"give exactly one of model= or run=; run `{PROG} --help` for the options")
        if opts["batch_size"] is None or opts["batch_size"] < 1:
            raise UsageError(f"batch_size={opts['batch_size']} must be >= 1")
        if opts["max_tokens"] is not None and opts["max_tokens"] < 1:
            raise UsageError(f"max_tokens={opts['max_tokens']} must be >= 1")
        device, dtype = resolve_device(opts["device"]), resolve_dtype(opts["dtype"])
        if opts["model"]:
            _evaluate_model(opts, device, dtype)
        else:
            _evaluate_run(opts, device, dtype)
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
