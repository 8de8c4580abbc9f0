"""lmsys-import: a transformers GPT-2 checkpoint directory → an lmsys export.

    python -m lmsys.hf_import hf/gpt2 out=exports/gpt2          # OpenAI's GPT-2, saved locally
    lmsys-import my-gpt2 out=exports/mine tokenizer=tok/tokenizer.json dtype=bf16

`HF_DIR` is what `GPT2LMHeadModel.save_pretrained` writes: config.json (a GPT2Config) and the
weights, model.safetensors or pytorch_model.bin, one file or shards with an index. Nothing in a
pickle runs: safetensors, or torch.load(weights_only=True) (lmsys/interop/hf.py). The weights map onto
lmsys's Transformer with GPT-2's function, so the export's logits are transformers' logits.

The tokenizer is `tokenizer=` or HF_DIR's own: its tokenizer.model when lmsys wrote one (an
lmsys format=hf export), else its tokenizer.json (GPT-2's byte-level BPE, with the special
tokens of its tokenizer_config.json; lmsys/data/tokenizer.py); it must have the model's vocabulary.

The export (format=lmsys, lmsys/export.py) is written under a temporary name, loaded back and
compared with the weights read (verify=true), then renamed into place. From there:
    lmsys-prepare data.tokenizer=OUT ...           encode a corpus with the model's tokenizer
    lmsys-train model.init_from=OUT ...            fine-tune it (the run's model must compute
                                                   the same function, e.g. model=gpt2_124m)
    lmsys-export OUT out=OUT-hf format=hf          back to a transformers directory

Errors (not a GPT-2 checkpoint, a missing or unsafe weight file, a tokenizer of another size)
print one line `lmsys-import: error: ...` on stderr and exit 2; nothing is written.
"""

from __future__ import annotations

import sys

from lmsys.cli import Option, parse_options, run_cli
from lmsys.core.errors import UsageError
from lmsys.core.runtime import DTYPES, resolve_dtype
from lmsys.interop.exports import import_checkpoint

PROG = "lmsys-import"

OPTIONS = [
    Option("hf_dir", "str", None, "a transformers GPT-2 checkpoint directory (required)"),
    Option("out", "str", None, "the export directory to create (required)"),
    Option("tokenizer", "str", None, "tokenizer.json / tokenizer.model or its directory (default: HF_DIR's)"),
    Option("dtype", "choice", "fp32", "dtype of the stored weights", tuple(DTYPES)),
    Option("overwrite", "bool", False, "replace an existing out directory"),
    Option("verify", "bool", True, "load the export back and compare its logits with the weights read"),
]

SUMMARY = (
    "lmsys-import: turn a transformers GPT-2 checkpoint directory (GPT2LMHeadModel.save_pretrained)\n"
    "into an lmsys export: model.safetensors, config.json, its tokenizer and a model card.\n"
    "example: python -m lmsys.hf_import hf/gpt2 out=exports/gpt2"
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts = parse_options(PROG, argv, OPTIONS, SUMMARY, positional="hf_dir")
        if opts is None:
            return 0
        for key in ("hf_dir", "out"):
            if not opts[key]:
                raise UsageError(f"{key}= is required; run `{PROG} --help` for the options")
        path = import_checkpoint(
            opts["hf_dir"],
            opts["out"],
            tokenizer=opts["tokenizer"],
            dtype=resolve_dtype(opts["dtype"]),
            overwrite=opts["overwrite"],
            verify=opts["verify"],
        )
        size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
        print(f"{PROG}: wrote {path} (lmsys format, {opts['dtype']}, {size:.1f} MB)")
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
