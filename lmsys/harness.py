"""lm-evaluation-harness's model `lmsys`: lm_eval evaluates lmsys exports and checkpoints.

    python -m lmsys.harness --model lmsys --model_args path=EXPORT --tasks TASKS --include_path DIR
    lmsys-eval EXPORT harness=TASKS include_path=DIR      # the same in lmsys's key=value form
    lm_eval --model lmsys --model_args path=EXPORT ...    # lm_eval releases that load plugins

`python -m lmsys.harness ARGS` is lm_eval's own command line (the function the `lm_eval`
executable runs, every option, the same output and result files) with the model `lmsys`
registered first. lm_eval 0.4.13 finds models only in its own registry: the `lm_eval.models`
entry point that pyproject.toml declares is how lm_eval's plugin mechanism (merged upstream
after 0.4.13) finds `lmsys` when lmsys is installed; until a release has it, `lm_eval --model
lmsys` needs this module imported first (as `python -m lmsys.harness`, `lmsys-eval harness=` and
`import lmsys.harness` do).

A mistake lm_eval finds in its arguments (an unknown task or model) is one line
`lmsys-harness: error: lm_eval: ...`, as is a bad `--model_args` for the lmsys model.

What the model serves and how: lmsys/inference/lm_eval_model.py.
"""

from __future__ import annotations

import sys

import lmsys.inference.lm_eval_model  # noqa: F401  # registers lm_eval's model `lmsys`
from lmsys.cli import run_cli
from lmsys.core.console import one_line
from lmsys.core.errors import LmsysError, UsageError

PROG = "lmsys-harness"


def main(argv: list[str] | None = None) -> int:
    """lm_eval's command line with the `lmsys` model registered (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        from lm_eval.__main__ import cli_evaluate  # the executable's own function, run in this process

        sys.argv = ["lm_eval", *argv]
        try:
            cli_evaluate()
        except LmsysError:
            raise  # the lmsys model's own line (a bad model_args path=, ...)
        except ValueError as exc:  # lm_eval's checks of its arguments: an unknown task or model, ...
            raise UsageError(lm_eval_error(exc)) from None
        return 0

    return run_cli(PROG, body)


def lm_eval_error(exc: ValueError) -> str:
    """One line for a mistake lm_eval found in its arguments (its own message, folded), with
    where to look for the right names."""
    text = one_line(exc)
    if text.startswith("Tasks not found"):
        return (
            f"lm_eval: {text}; `python -m lmsys.harness ls tasks` lists them, and --include_path DIR adds "
            "the tasks of your own YAML files"
        )
    if "no model for this name" in text:
        return f"lm_eval: {text.split('!')[0]}; lmsys exports and checkpoints run as --model lmsys"
    return f"lm_eval: {text}"


if __name__ == "__main__":
    sys.exit(main())
