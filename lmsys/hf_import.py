"""lmsys-import: a transformers checkpoint directory (GPT-2, Llama, Qwen2, Qwen3, Mistral) → an lmsys export.

    python -m lmsys.hf_import hf/gpt2 out=exports/gpt2          # OpenAI's GPT-2, saved locally
    python -m lmsys.hf_import hf/Qwen3-0.6B out=exports/qwen3   # Qwen3-0.6B, saved locally
    lmsys-import my-gpt2 out=exports/mine tokenizer=tok/tokenizer.json dtype=bf16

`HF_DIR` is what `save_pretrained` writes (GPT2LMHeadModel.save_pretrained, LlamaForCausalLM's,
Qwen2ForCausalLM's, Qwen3ForCausalLM's, MistralForCausalLM's): config.json and the weights,
model.safetensors or pytorch_model.bin, one file or shards with an index. Nothing in a pickle
runs: safetensors, or torch.load(weights_only=True) (lmsys/interop/hf.py). The weights map onto
lmsys's Transformer with the checkpoint's function (GPT-2's: lmsys/interop/hf.py; the Llama
family's: lmsys/interop/hf_llama.py), so the export's logits are transformers' logits. A function
lmsys cannot express (sliding-window attention in use, a rope scaling other than default and
llama3, another model_type) is refused, named.

The tokenizer is `tokenizer=` or HF_DIR's own: its tokenizer.model when lmsys wrote one (an
lmsys format=hf export), else its tokenizer.json (with the special tokens of its
tokenizer_config.json; lmsys/data/tokenizer.py). It must have the model's vocabulary, or fewer
pieces (Qwen pads its embedding past its tokenizer: the import records model.tokenizer_vocab_size).

The export (format=lmsys, lmsys/export.py) is written under a temporary name, loaded back and
compared with the weights read (verify=true), then renamed into place. From there:
    lmsys-prepare data.tokenizer=OUT model.init_from=OUT ...   encode a corpus with the model's tokenizer
    lmsys-train model.init_from=OUT ...                        continue training it (its own model,
                                                               or a preset of the same function)
    lmsys-export OUT out=OUT-hf format=hf                      back to a transformers directory

Errors (an unknown model_type, a missing or unsafe weight file, a tokenizer of another size)
print one line `lmsys-import: error: ...` on stderr and exit 2; nothing is written.
"""

from __future__ import annotations

import sys

from lmsys.cli import Option, parse_options, run_cli
from lmsys.core.errors import UsageError
from lmsys.core.runtime import DTYPES, resolve_dtype
from lmsys.interop.export_dir import import_checkpoint

PROG = "lmsys-import"

OPTIONS = [
    Option(
        "hf_dir",
        "str",
        None,
        "a transformers checkpoint directory: GPT-2, Llama, Qwen2, Qwen3, Mistral (required)",
    ),
    Option("out", "str", None, "the export directory to create (required)"),
    Option("tokenizer", "str", None, "tokenizer.json / tokenizer.model or its directory (default: HF_DIR's)"),
    Option("dtype", "choice", "fp32", "dtype of the stored weights", tuple(DTYPES)),
    Option("overwrite", "bool", False, "replace an existing out directory"),
    Option("verify", "bool", True, "load the export back and compare its logits with the weights read"),
]

SUMMARY = (
    "lmsys-import: turn a transformers checkpoint directory (GPT2LMHeadModel.save_pretrained, or a Llama,\n"
    "Qwen2, Qwen3 or Mistral model's) into an lmsys export: model.safetensors, config.json, its tokenizer\n"
    "and a model card.\n"
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
