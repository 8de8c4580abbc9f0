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

What the model serves and how: lmsys/inference/harness.py.
"""

from __future__ import annotations

import sys

import lmsys.inference.harness  # noqa: F401  # registers lm_eval's model `lmsys`
from lmsys.cli import run_cli

PROG = "lmsys-harness"


def main(argv: list[str] | None = None) -> int:
    """lm_eval's command line with the `lmsys` model registered (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        from lm_eval.__main__ import cli_evaluate  # the executable's own function, run in this process

        sys.argv = ["lm_eval", *argv]
        cli_evaluate()
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
