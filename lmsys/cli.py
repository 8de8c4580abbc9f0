"""The command-line kit every lmsys command uses: `key=value` options, --help, and one exit path.

    def main(argv=None) -> int:
        def body() -> int:
            opts = parse_options(PROG, argv, OPTIONS, SUMMARY, positional="model")
            if opts is None:  # --help was printed
                return 0
            ...
            return 0
        return run_cli(PROG, body)

`run_cli` is the only place a command turns an exception into an exit status: an `LmsysError`
(lmsys.core.errors) prints one line `<prog>: error: <message>` on stderr and exits with its
`exit_code` (2 for bad input), an OSError (disk full, permission denied) one line and 2, Ctrl-C
one line and 130. In a distributed job every rank raises the same error; only rank 0 prints it.

Imports the standard library only: the light commands (sweep summaries, launchers) stay light.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmsys.core.choices import COMPILE_CHOICES, DTYPE_NAMES, KERNEL_CHOICES
from lmsys.core.console import is_reporting_rank, report_error, set_command
from lmsys.core.errors import LmsysError, UsageError
from lmsys.core.files import os_error_line


@dataclass
class Option:
    """One `key=value` argument of an lmsys command."""

    name: str
    kind: str  # str | int | float | bool | choice
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    repeat: bool = False  # may be given several times (collected into a list)


def parse_options(
    prog: str, argv: list[str], options: list[Option], summary: str, positional: str | None = None
) -> dict[str, Any] | None:
    """Parse `key=value` arguments. Returns None after printing --help. Raises UsageError.

    Values: bool takes true/false (also 1/0, yes/no); int/float as Python reads them; `none`
    (or an empty value) for an int/float/str option means "unset" (None). With `positional`,
    the first argument may be a bare value for that option (`lmsys-export runs/x` is
    `checkpoint=runs/x`); a path holding '=' can still be given as `key=value`."""
    by_name = {o.name: o for o in options}
    if any(a in ("-h", "--help", "help") for a in argv):
        print(format_help(prog, options, summary, positional))
        return None
    values: dict[str, Any] = {o.name: ([] if o.repeat else o.default) for o in options}
    if positional is not None and argv and "=" not in argv[0] and not argv[0].startswith("-"):
        argv = [f"{positional}={argv[0]}", *argv[1:]]
    for arg in argv:
        key, sep, raw = arg.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep:
            raise UsageError(f"argument {arg!r} is not key=value; run `{prog} --help` for the options")
        opt = by_name.get(key)
        if opt is None:
            raise UsageError(f"unknown option {key!r}; valid options: {', '.join(by_name)}")
        value = _convert(opt, raw)
        if opt.repeat:
            values[key].append(value)
        else:
            values[key] = value
    for o in options:
        if o.repeat and not values[o.name] and o.default:
            values[o.name] = list(o.default)
    return values


def _convert(opt: Option, raw: str) -> Any:
    text = raw.strip()
    if opt.kind == "str":
        return raw if raw != "" else None
    if opt.kind == "choice":
        if text not in opt.choices:
            raise UsageError(f"{opt.name}={raw!r} is not valid; choose one of: {', '.join(opt.choices)}")
        return text
    if opt.kind == "bool":
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise UsageError(f"{opt.name}={raw!r} is not valid; use true or false")
    if text.lower() in ("", "none", "null"):
        return None
    try:
        return int(text) if opt.kind == "int" else float(text)
    except ValueError:
        kind = "an integer" if opt.kind == "int" else "a number"
        raise UsageError(f"{opt.name}={raw!r} is not valid; it must be {kind}") from None


def format_help(prog: str, options: list[Option], summary: str, positional: str | None = None) -> str:
    usage = (
        f"usage: {prog} [{positional.upper()}] key=value ..."
        if positional
        else f"usage: {prog} key=value ..."
    )
    lines = [summary.rstrip(), "", usage, "", "options:"]
    width = max(len(o.name) for o in options) + 2
    for o in options:
        shown = str(o.default).lower() if isinstance(o.default, bool) else o.default
        default = "" if o.default in (None, [], "") else f" (default: {shown})"
        choices = f" [{'|'.join(o.choices)}]" if o.choices else ""
        repeat = " (repeatable)" if o.repeat else ""
        lines.append(f"  {o.name:<{width}}{o.help}{choices}{default}{repeat}")
    lines.append("")
    lines.append("Errors print one line `" + prog + ": error: ...` on stderr and exit with status 2.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- shared options

# The options several commands share: the device and dtype (lmsys.core.runtime resolves them),
# torch.compile (lmsys.model.compiling), a checkpoint's tokenizer (lmsys.interop.export_dir).
DEVICE_OPTION = Option("device", "str", "auto", "auto, cpu, cuda or cuda:N")
DTYPE_OPTION = Option("dtype", "choice", "fp32", "compute dtype", DTYPE_NAMES)
COMPILE_OPTION = Option(
    "compile", "choice", "auto", "torch.compile the model: auto (on CUDA), true, false", COMPILE_CHOICES
)
KERNELS_OPTION = Option(
    "kernels",
    "choice",
    None,
    "Triton kernels or torch ops: auto (Triton on CUDA), triton, torch (default: the model's model.kernels)",
    KERNEL_CHOICES,
)
TOKENIZER_OPTION = Option(
    "tokenizer", "str", None, "tokenizer file for a checkpoint (default: found from its data.dir)"
)
# What every command that loads a model for inference takes (lmsys-generate, lmsys-eval).
MODEL_LOADING_OPTIONS = [COMPILE_OPTION, DEVICE_OPTION, DTYPE_OPTION, KERNELS_OPTION, TOKENIZER_OPTION]


# ----------------------------------------------------------------------------- reporting


def run_cli(prog: str, body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run a command's body and return its exit status (see the module docstring)."""
    set_command(prog)
    try:
        return body()
    except LmsysError as exc:
        report_error(prog, exc)
        return exc.exit_code
    except OSError as exc:  # the machine refused (disk full, permissions): still one line
        report_error(prog, LmsysError(os_error_line(exc)))
        return 2
    except KeyboardInterrupt:
        if is_reporting_rank():
            print(f"{prog}: {interrupted}", file=sys.stderr, flush=True)
        return 130


# ----------------------------------------------------------------------------- --flags meant as keys


def flag_as_override(prog: str, argv: list[str], keys: list[str], known_flags: set[str]) -> None:
    """Raise UsageError for the first `--name value` (or `--name=value`) that is not one of
    `known_flags`, naming the key=value override it most likely means (an argparse habit: the
    Hydra commands take `trainer.max_steps=5`, not `--max_steps 5`). `keys`: the dotted keys."""
    for i, arg in enumerate(argv):
        flag, sep, value = arg.partition("=")
        if not arg.startswith("-") or flag in known_flags or _is_number(arg):
            continue
        if not sep and i + 1 < len(argv) and "=" not in argv[i + 1] and not argv[i + 1].startswith("-"):
            value = argv[i + 1]
        name = flag.lstrip("-").replace("-", "_")
        matches = [k for k in keys if k == name or k.rsplit(".", 1)[-1] == name]
        if not matches:
            leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
            matches = [leaves[c] for c in difflib.get_close_matches(name, list(leaves), n=1, cutoff=0.6)]
        shown = value if value else "VALUE"
        hint = " or ".join(f"{k}={shown}" for k in matches[:3])
        raise UsageError(
            f"unknown option {flag}; {prog} takes key=value overrides"
            + (f": did you mean {hint}?" if hint else f" (run `{prog} --help` for the keys)")
        )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
