"""The export format, and lmsys-export: a training checkpoint → a self-contained model directory.

    python -m lmsys.export runs/tiny-20250101-120000          # newest checkpoint -> <run>/export
    python -m lmsys.export checkpoint=runs/tiny-20250101-120000 out=exports/tiny
    python -m lmsys.export checkpoint=runs/x/checkpoints/step_0000500 out=exports/x dtype=bf16
    python -m lmsys.export checkpoint=runs/x out=exports/x-hf format=hf      # GPT-2 and Llama-family models
    python -m lmsys.export checkpoint=exports/x out=exports/x-hf format=hf   # an export, converted

`checkpoint=` is a run directory or its `checkpoints/` directory (its newest complete, intact
checkpoint; newer damaged ones are reported and skipped: lmsys.engine.checkpoint's rule, the one resume
follows), or one checkpoint directory (`checkpoints/step_0000500`), of any ZeRO stage and world
size; or an export directory, written again in `format` (e.g. an lmsys-import as format=hf).
Without `out=`, a run's export goes to `<run dir>/export` (replacing an earlier export
there, so the command can be re-run after more training). The weights are consolidated by
DeepSpeed's own functions (lmsys.engine.zero.consolidated_state_dict), loading never runs code from
a pickle.

The format, and how it is written and loaded: lmsys/interop/export_dir.py.

format=hf writes the transformers architecture of the model's function: GPT2LMHeadModel, or for
the Llama family LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or MistralForCausalLM (an
import keeps its own; lmsys/interop/hf_llama.py).

Errors (a missing or corrupt checkpoint, a mismatching file, a config that format=hf cannot
express) print one line `lmsys-export: error: ...` on stderr and exit 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lmsys.cli import Option, parse_options, run_cli
from lmsys.core.errors import UsageError
from lmsys.core.rundir import EXPORT_DIR
from lmsys.core.runtime import DTYPES, resolve_dtype
from lmsys.engine.checkpoint import resolve
from lmsys.interop.export_dir import FORMATS, export_checkpoint, is_export_dir

PROG = "lmsys-export"

# ----------------------------------------------------------------------------- lmsys-export

OPTIONS = [
    Option(
        "checkpoint",
        "str",
        None,
        "run dir (its latest checkpoint), its checkpoints/ dir, or one tag dir (required)",
    ),
    Option("out", "str", None, "export directory to create (default: <run dir>/export, or export-hf)"),
    Option(
        "format",
        "choice",
        "lmsys",
        "lmsys: safetensors + config.json; hf: transformers directory (GPT-2, Llama, Qwen2, Qwen3, Mistral)",
        FORMATS,
    ),
    Option("dtype", "choice", "fp32", "dtype of the stored weights", tuple(DTYPES)),
    Option(
        "tokenizer", "str", None, "tokenizer.model to use (default: found from the checkpoint's data.dir)"
    ),
    Option(
        "overwrite",
        "bool",
        False,
        "replace an existing out directory (an earlier export of the same run and format is "
        "replaced anyway; a directory holding other files never is)",
    ),
    Option("verify", "bool", True, "load the export back and compare logits with the checkpoint"),
]

SUMMARY = (
    "lmsys-export: write a training checkpoint (any ZeRO stage and world size) as a self-contained\n"
    "directory: model.safetensors, config.json, tokenizer.model and a README.md model card.\n"
    "examples: python -m lmsys.export runs/tiny-x          # newest checkpoint -> runs/tiny-x/export\n"
    "          python -m lmsys.export checkpoint=runs/tiny-x out=exports/tiny-x dtype=bf16 format=hf"
)


def default_out(checkpoint: str | os.PathLike, fmt: str = "lmsys") -> Path:
    """<run dir>/export (format=lmsys) or <run dir>/export-hf (format=hf) for a checkpoint inside
    a run (run dir, checkpoints/ dir or tag dir)."""
    if is_export_dir(checkpoint):
        raise UsageError(f"out= is required: checkpoint={checkpoint} is an export directory, not a run")
    ckpt = resolve(checkpoint, check_hashes=False)
    if ckpt.run_dir is None:
        raise UsageError(f"out= is required: checkpoint={checkpoint} is not inside a run directory")
    return ckpt.run_dir / (EXPORT_DIR if fmt == "lmsys" else f"{EXPORT_DIR}-{fmt}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts = parse_options(PROG, argv, OPTIONS, SUMMARY, positional="checkpoint")
        if opts is None:
            return 0
        if not opts["checkpoint"]:
            raise UsageError(f"checkpoint= is required; run `{PROG} --help` for the options")
        dtype = resolve_dtype(opts["dtype"])
        out = opts["out"] or default_out(opts["checkpoint"], opts["format"])
        path = export_checkpoint(
            opts["checkpoint"],
            out,
            dtype=dtype,
            fmt=opts["format"],
            tokenizer=opts["tokenizer"],
            overwrite=opts["overwrite"],
            verify=opts["verify"],
        )
        size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
        print(f"{PROG}: wrote {path} ({opts['format']} format, {opts['dtype']}, {size:.1f} MB)")
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
