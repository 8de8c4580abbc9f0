"""lm-evaluation-harness's model `lmsys` (registered when this module is imported), and running
lm_eval tasks on an lmsys export or checkpoint (lmsys-eval harness=).

model_args: path (an export directory or a training checkpoint, required), device (default: CUDA
when there is one; a CUDA device asked for where none exists falls back to the CPU, as lm_eval's
hf model does with the CLI's default cuda:0), dtype (fp32, bf16, fp16), batch_size (an integer;
in --model_args it wins over --batch_size), max_length (the window, default the length the model
was trained at, else model.max_seq_len), max_gen_toks (256), seed (of each sampled generation,
1234), tokenizer (for a checkpoint, as in lmsys-eval).

The requests are served as lm_eval's hf model serves a causal LM: contexts are encoded without
eos (an empty context, and a document's first rolling window, start from eos, lm_eval's prefix
token), a sequence longer than the window is cut from the left, and a bos_shift model also reads
its bos_shift_id first (lmsys.model.transformer.next_token_pairs). So `--model hf` on a format=hf export gives
the same numbers with its prefix token set to eos (`--model_args pretrained=DIR,prefix_token_id=2`
for lmsys's SentencePiece ids): by default it takes the tokenizer's bos, which lmsys models never
saw (documents follow eos in training; with GPT-2's tokenizer bos is eos anyway).
- loglikelihood: lmsys.inference.scoring.loglikelihoods, batched, each distinct context run once through the
  KV cache for all of its continuations (the choices of a multiple-choice question).
- loglikelihood_rolling: lm_eval's rolling windows of max_length tokens, each document on its
  own, scored the same way; equal to lmsys-eval's perplexity of the document (same windows).
- generate_until: lmsys.generate.generate_batch, batch_size contexts as one left-padded batch
  with the KV cache; a row stops at eos, max_gen_toks or a stop string (`until`), and the text is
  cut before the first stop string. Greedy unless do_sample (then temperature, top_k, top_p).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  # lm_eval's own names first: get_model loads them only into an empty registry
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import (
    get_rolling_token_windows,
    make_disjoint_window,
    make_table,
    simple_parse_args_string,
)

from lmsys.core.choices import KERNEL_CHOICES
from lmsys.core.config import context_prefix, tokens_per_sample
from lmsys.core.errors import UsageError
from lmsys.core.runtime import resolve_device, resolve_dtype
from lmsys.inference.generation import Sampling, fit_prompt, generate_batch
from lmsys.inference.lengths import choose_window
from lmsys.inference.scoring import loglikelihoods
from lmsys.interop.export_dir import load_model
from lmsys.model.ops import prepare_kernels

MODEL_NAME = "lmsys"
log = logging.getLogger(__name__)


class HarnessError(UsageError):
    """A bad model argument or request for the lm_eval model; one line."""


def _device(choice: str | None) -> torch.device:
    if choice and choice.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device=%s but no CUDA device is available: running on the CPU", choice)
        return torch.device("cpu")
    return resolve_device(choice or "auto")


def _batch_size(value: int | str) -> int:
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise HarnessError(
            f"batch_size={value!r} is not valid; give a number >= 1 (lmsys does not probe 'auto')"
        )
    return int(text)


@register_model(MODEL_NAME)
class LmsysLM(TemplateLM):
    """An lmsys model (export directory or checkpoint) behind lm_eval's LM interface."""

    def __init__(
        self,
        path: str | None = None,
        device: str | None = None,
        dtype: str = "fp32",
        batch_size: int | str = 1,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        seed: int | None = 1234,
        tokenizer: str | None = None,
        kernels: str | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        unknown.pop("max_batch_size", None)  # lm_eval's auto-batching bound: unused without batch_size=auto
        if unknown:
            valid = "path, device, dtype, batch_size, max_length, max_gen_toks, seed, tokenizer, kernels"
            raise HarnessError(f"unknown model_args {', '.join(sorted(unknown))}; valid: {valid}")
        if not path or not Path(path).exists():
            given = f"path={path} does not exist" if path else "model_args path= is required"
            raise HarnessError(f"{given} (expected an lmsys export directory or a training checkpoint)")
        self.path, self.batch_size = str(path), _batch_size(batch_size)
        self._device = _device(device)
        if kernels is not None and kernels not in KERNEL_CHOICES:
            valid = ", ".join(KERNEL_CHOICES)
            raise HarnessError(f"kernels={kernels!r} is not valid; choose one of: {valid}")
        self.model, self.tok, self.meta = load_model(
            path, self._device, resolve_dtype(dtype), tokenizer, kernels=kernels
        )
        prepare_kernels(self.model.cfg.kernels, self._device, next(self.model.parameters()).dtype)
        cfg = self.model.cfg
        window = cfg.max_seq_len
        if max_length is not None and not 1 <= int(max_length) <= window:
            raise HarnessError(f"max_length={max_length} must be in [1, {window}] (model.max_seq_len)")
        asked = int(max_length) if max_length is not None else None
        self.max_length = choose_window(asked, cfg, self.meta, log.warning, key="max_length")
        self.max_gen_toks, self.seed = int(max_gen_toks), seed
        self.lead = context_prefix(cfg)  # what every model input starts with (bos_shift_id or nothing)

    # lm_eval passes its own batch_size (the CLI's, 1 by default), max_batch_size and device beside
    # the parsed --model_args: the same key in both would be "multiple values for keyword argument".
    # What --model_args names wins (`--model_args path=X,batch_size=16`); lm_eval's fill the rest.
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LmsysLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> LmsysLM:
        given = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**given, **arg_dict})

    # -- tokens ------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    def get_model_info(self) -> dict[str, Any]:
        return {
            "lmsys_model": self.path,
            "lmsys_format": self.meta.get("format"),
            "max_length": self.max_length,
            "lmsys_batch_size": self.batch_size,  # the one used (lm_eval's config shows its CLI's)
        }

    def _fit(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[list[int], list[int]]:
        """The (context, continuation) the model reads: cut from the left to the window (the last
        tokens_per_sample tokens), as lm_eval's hf model does; the continuation must fit whole."""
        span = tokens_per_sample(self.model.cfg, self.max_length)  # tokens of max_length inputs
        sample = [*context, *continuation][-span:]
        predicted = len(sample) - (span - self.max_length)  # all but a first token that is only context
        if len(continuation) > predicted:
            raise HarnessError(
                f"a continuation of {len(continuation)} tokens does not fit the window of "
                f"max_length={self.max_length} tokens"
            )
        return sample[: len(sample) - len(continuation)], list(continuation)

    # -- lm_eval's requests --------------------------------------------------------------------

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) strings, context ids, continuation ids), from
        TemplateLM.loglikelihood (which encodes them as lm_eval's hf model does)."""
        pairs = [self._fit(context, continuation) for _, context, continuation in requests]
        results = loglikelihoods(self.model, pairs, self.batch_size)
        for (strings, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs, document = [], []
        for index, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            windows = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                # context[0] is the token before the window (eos first): a bos_shift model reads
                # its bos_shift_id there instead, as lmsys-eval's windows and its training loss do
                pairs.append(self._fit(context[len(self.lead) :], continuation))
                document.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(document, loglikelihoods(self.model, pairs, self.batch_size)):
            totals[index] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}  # one sampling setting per batch
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        for members in groups.values():
            sampling, until, max_gen = self._generation_settings(requests[members[0]].args[1])
            prompts = {i: self._prompt(requests[i].args[0], max_gen) for i in members}
            members.sort(key=lambda i: -len(prompts[i]))  # similar lengths together: little padding
            for start in range(0, len(members), self.batch_size):
                batch = members[start : start + self.batch_size]
                texts = self._generate(sampling, until, max_gen, [prompts[i] for i in batch])
                for i, text in zip(batch, texts):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    def _generation_settings(self, gen_kwargs: dict) -> tuple[Sampling, list[str], int]:
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until, max_gen = kwargs.pop("until"), int(kwargs.pop("max_gen_toks"))
        do_sample = bool(kwargs.pop("do_sample"))
        temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))  # transformers' default
        top_k, top_p = int(kwargs.pop("top_k", 0) or 0), float(kwargs.pop("top_p", 1.0) or 1.0)
        if kwargs:
            raise HarnessError(
                f"generation_kwargs {', '.join(sorted(kwargs))} are not supported by the lmsys model; "
                "it takes until, max_gen_toks, do_sample, temperature, top_k, top_p"
            )
        sampling = Sampling(greedy=not do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
        sampling.check()
        return sampling, [u for u in ([until] if isinstance(until, str) else until) if u], max_gen

    def _prompt(self, context: str, max_gen: int) -> list[int]:
        """The context's ids with room for max_gen new tokens: cut from the left as lm_eval's hf
        model does (the window minus max_gen_toks), then the model's lead (fit_prompt)."""
        ids = self.tok_encode(context) or [self.prefix_token_id]
        if self.model.cfg.positions.kind != "none":
            room = self.max_length - len(self.lead) - max_gen + 1  # the last new token is never fed back
            if room < 1:
                raise HarnessError(
                    f"max_gen_toks={max_gen} leaves no room for a context in max_length={self.max_length}"
                )
            ids = ids[-room:]
        return fit_prompt(ids, self.model.cfg, max_gen)[0]

    def _generate(
        self, sampling: Sampling, until: list[str], max_gen: int, prompts: list[list[int]]
    ) -> list[str]:
        def stop(row: int, tokens: list[int]) -> bool:
            text = self.tok.decode(tokens)
            return any(u in text for u in until)

        new = generate_batch(
            self.model, prompts, [max_gen] * len(prompts), sampling, self.tok.eos_id, self.seed, stop=stop
        )
        return [postprocess_generated_text(self.tok.decode(ids), until, None) for ids in new]


# ----------------------------------------------------------------------------- running tasks


def run_tasks(
    path: str,
    tasks: list[str],
    include_path: str | None = None,
    num_fewshot: int | None = None,
    limit: float | None = None,
    model_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """lm_eval.simple_evaluate of the model at `path` on `tasks` (names, or tasks of the YAML files
    under include_path): lm_eval's results dictionary. Unknown tasks are one HarnessError."""
    # lm_eval's evaluator and task manager (datasets, about a second) load when tasks run, as in lm_eval
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise HarnessError(f"include_path={include_path} is not a directory (of lm_eval task YAML files)")
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        hint = "" if include_path else "; give include_path=DIR for tasks of your own YAML files"
        raise HarnessError(f"lm_eval has no task {', '.join(unknown)}{hint}")
    return simple_evaluate(
        model=MODEL_NAME,
        model_args={"path": str(path), **(model_args or {})},
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
    )


def results_table(results: dict[str, Any]) -> str:
    """lm_eval's own tables of a results dictionary: the tasks, then the groups if any."""
    table = make_table(results)
    return table + ("\n" + make_table(results, "groups") if results.get("groups") else "")
