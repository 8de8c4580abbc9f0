"""The spellings of settings that take one of a few values, shared by the schema, the runtime and
the command-line options. Standard library only: the light commands (launchers, --help) list them
without importing torch or Hydra."""

from __future__ import annotations

import codecs

DTYPE_NAMES = ("fp32", "bf16", "fp16")  # compute and storage dtypes (lmsys.core.runtime.DTYPES)
COMPILE_CHOICES = ("auto", "true", "false")  # trainer.compile and the commands' compile=
KERNEL_CHOICES = ("auto", "triton", "torch")  # model.kernels and the commands' kernels=


def text_encoding(name: str) -> str | None:
    """Python's name of the text encoding `name` (data.encoding: `latin-1` is `iso8859-1`), or
    None when Python knows no text encoding by that name."""
    try:
        info = codecs.lookup(name)
    except LookupError:
        return None
    return info.name if getattr(info, "_is_text_encoding", True) else None
