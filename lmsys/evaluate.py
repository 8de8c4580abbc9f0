"""lmsys-eval: perplexity and bits per byte of a model on a text file or a prepared validation split.

    python -m lmsys.evaluate runs/tiny-x/export text=notes.txt
    python -m lmsys.evaluate model=runs/tiny-x data=data/default          # the validation split
    python -m lmsys.evaluate run=runs/tiny-x                              # every checkpoint: table + PNG
    python -m lmsys.evaluate exports/tiny harness=hellaswag,mytask include_path=tasks/   # lm_eval tasks

`model=` is an export directory or a checkpoint (run dir, checkpoints/ dir or tag dir); `run=`
evaluates every checkpoint tag of a run, prints a table and writes a plot of loss and
perplexity against the step (plot=, default <run>/eval.png). Without text= or data=, a
checkpoint is evaluated on the validation split of its own data.dir.

harness=TASK[,TASK...] runs lm-evaluation-harness tasks (names lm_eval knows, or tasks of the YAML
files under include_path=) on model= through lm_eval's `lmsys` model (lmsys/harness.py), and
prints lm_eval's results table: the shortcut of `python -m lmsys.harness --model lmsys
--model_args path=MODEL --tasks ... --include_path DIR`. batch_size, seq_len (the window), device,
dtype and tokenizer go to the model; num_fewshot and limit to lm_eval; json= gets lm_eval's
results. It needs the `eval` extra (pip install 'lmsys[eval]').

compile=auto|true|false (auto: on CUDA) compiles the model with torch.compile for perplexity runs;
every forward is then a full batch (the last one padded with copies of its last window): one graph.

What is measured, exactly: lmsys/inference/evaluation.py.

Errors print one line `lmsys-eval: error: ...` on stderr and exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from lmsys.cli import MODEL_LOADING_OPTIONS, Option, parse_options, run_cli
from lmsys.core.console import warn
from lmsys.core.errors import LmsysError, UsageError
from lmsys.core.rundir import CHECKPOINTS, EVAL_PLOT_FILE
from lmsys.core.runtime import resolve_device, resolve_dtype
from lmsys.engine.checkpoint import list_checkpoints, resolve
from lmsys.inference.evaluation import EvalError, EvalResult, evaluate_source, pick_source
from lmsys.inference.lengths import choose_window
from lmsys.interop.export_dir import load_model
from lmsys.model.compiling import compiled_for_cli
from lmsys.model.ops import prepare_kernels
from lmsys.training.plots import plot_run

PROG = "lmsys-eval"

# ----------------------------------------------------------------------------- CLI

OPTIONS = [
    Option("model", "str", None, "export directory or checkpoint to evaluate"),
    Option("run", "str", None, "run directory: evaluate every checkpoint (table + plot)"),
    Option("text", "str", None, "UTF-8 text file to evaluate on"),
    Option("data", "str", None, "prepared data directory (lmsys-prepare) to evaluate on"),
    Option("split", "choice", "val", "split of data=", ("val", "train")),
    Option("seq_len", "int", None, "window in tokens (default: the trained length, else max_seq_len)"),
    Option("batch_size", "int", 8, "windows per forward"),
    Option("max_tokens", "int", None, "evaluate only the first N tokens"),
    Option("plot", "str", None, "PNG for run= (default: <run>/eval.png)"),
    Option("json", "str", None, "also write the results as JSON to this file"),
    Option("harness", "str", None, "lm-evaluation-harness tasks to run on model=, comma-separated"),
    Option("include_path", "str", None, "directory of lm_eval task YAML files (harness=)"),
    Option("num_fewshot", "int", None, "few-shot examples per task (harness=; default: the task's)"),
    Option("limit", "float", None, "examples per task at most, or a fraction if < 1 (harness=)"),
    *MODEL_LOADING_OPTIONS,
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
    """compile= (lmsys.model.compiling.compiled_for_cli) for the evaluations of one call."""
    return compiled_for_cli(opts["compile"], device, PROG, "evaluation", lambda m: warn(PROG, m))


def _evaluate_model(opts: dict, device: torch.device, dtype: torch.dtype) -> None:
    path = Path(opts["model"])
    model, tok, meta = load_model(
        path, device, dtype, opts["tokenizer"], warn=lambda m: warn(PROG, m), kernels=opts["kernels"]
    )
    prepare_kernels(model.cfg.kernels, device, next(model.parameters()).dtype)
    source = pick_source(opts, meta.get("train_config"))
    opts = {**opts, "seq_len": choose_window(opts["seq_len"], model.cfg, meta, lambda m: warn(PROG, m))}
    with _compiling(opts, device) as compile_model:
        result = evaluate_source(model, tok, source, opts, full_batches=compile_model(model))
    print(f"{PROG}: {path} on {source.label}, windows of {opts['seq_len']} tokens")
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
    meta = {"train_config": newest.state.config}
    cfg = newest.state.model_config(newest.tag_dir)
    opts = {**opts, "seq_len": choose_window(opts["seq_len"], cfg, meta, lambda m: warn(PROG, m))}
    rows = []
    print(f"{PROG}: {run}: {len(tags)} checkpoint(s) on {source.label}, windows of {opts['seq_len']} tokens")
    print(f"{'step':>9} {'tokens':>10} {'loss':>9} {'ppl':>10} {'bits/byte':>10}  checkpoint")
    with _compiling(opts, device) as compile_model:  # every checkpoint's model: one graph serves all
        for tag_dir in tags:
            try:
                loaded = load_model(tag_dir, device, dtype, opts["tokenizer"], kernels=opts["kernels"])
            except LmsysError as exc:
                warn(PROG, f"skipping {tag_dir.name}: {exc}")
                continue
            model, tok, meta = loaded
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
        from lmsys.inference import lm_eval_model
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
    settings.update(dtype=opts["dtype"], tokenizer=opts["tokenizer"], kernels=opts["kernels"])
    model_args = {key: value for key, value in settings.items() if value is not None}
    results = lm_eval_model.run_tasks(
        opts["model"], tasks, opts["include_path"], opts["num_fewshot"], opts["limit"], model_args
    )
    print(f"{PROG}: {opts['model']} on lm_eval tasks {', '.join(tasks)}")
    print(lm_eval_model.results_table(results))
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
