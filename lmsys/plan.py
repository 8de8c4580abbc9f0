"""lmsys-plan: will this launch fit, and how long will it take? Memory and time per rank for any
config, world size and device, before anything starts.

    lmsys-plan model=gpt2_1558m trainer=gpt2 optim=gpt2 world=8 device=h100
    lmsys-plan model=gpt2_124m trainer=gpt2 deepspeed=zero3 world=32 device=a100-80gb json=true
    python -m lmsys.plan model=seed_trax trainer.global_batch_tokens=32768 world=2   # this machine's CPU

Arguments: the overrides lmsys-train takes (model=..., deepspeed=zero3, trainer.micro_batch_size=4,
...), plus
  world=N         ranks (default 1); the global batch must split into them
  device=NAME     cpu (this machine; its memory shared by the ranks), a100-40gb, a100-80gb,
                  h100 (SXM 80GB), h200 (default: cpu)
  json=true       one JSON object: peak_bytes, components (adding up to peak_bytes), device_bytes,
                  fits, step_time_s, tokens_per_s, mfu, suggestions, ...

What each component counts, where the figures come from and how accurate they were against
measured runs: docs/planning.md (the model: lmsys/training/planning.py).

Errors (an unknown device, a world size that does not split the global batch, a config that
cannot be built) print one line `lmsys-plan: error: ...` and exit 2.
"""

from __future__ import annotations

import json
import sys

from lmsys.cli import flag_as_override, run_cli
from lmsys.core.config import compose, config_keys
from lmsys.core.errors import UsageError
from lmsys.training.devices import device_spec
from lmsys.training.planning import plan_launch, report_lines

PROG = "lmsys-plan"
OWN_KEYS = ("world", "device", "json")


def split_arguments(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(lmsys-plan's own key=value arguments, the config overrides)."""
    own, overrides = {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in OWN_KEYS:
            own[key] = value
        else:
            overrides.append(arg)
    return own, overrides


def _int(key: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{key}={text!r} is not valid; it must be an integer") from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if any(a in ("-h", "--help", "help") for a in argv):
            print(__doc__)
            return 0
        if any(a.startswith("-") for a in argv):  # `--world 8`: name the key=value it means
            flag_as_override(PROG, argv, [*OWN_KEYS, *config_keys()], set())
        own, overrides = split_arguments(argv)
        world = _int("world", own.get("world", "1"))
        if world < 1:
            raise UsageError(f"world={world} must be >= 1")
        as_json = own.get("json", "false").lower()
        if as_json not in ("true", "false", "1", "0"):
            raise UsageError(f"json={as_json!r} is not valid; use true or false")
        device = device_spec(own.get("device", "cpu"))
        plan = plan_launch(compose(overrides), world, device)
        if as_json in ("true", "1"):
            print(json.dumps(plan.as_json(), indent=None))
        else:
            print("\n".join(f"{PROG}: {line}" for line in report_lines(plan)))
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
