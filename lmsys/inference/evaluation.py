"""Evaluation: the log-likelihood of a token stream in consecutive windows, perplexity and bits
per byte, for lmsys-eval (lmsys/evaluate.py).

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lmsys.core.config import tokens_per_sample
from lmsys.core.errors import UsageError
from lmsys.data.shards import PreparedData
from lmsys.model.transformer import next_token_pairs

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
    """The tokens of a prepared data split (lmsys.data.loader.PreparedData, checked against its
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
