"""lmsys-plan: will this launch fit, and how long will it take? Memory and time per rank for any
config, world size and device, before anything starts.

    lmsys-plan model=gpt2_1558m trainer=gpt2 optim=gpt2 world=8 device=h100
    lmsys-plan model=gpt2_124m trainer=gpt2 deepspeed=zero3 world=32 device=a100-80gb json=true
    lmsys-plan model=llama3_2_1b trainer=gpt2 data.seq_len=1024 world=8 device=l40s check=true
    python -m lmsys.plan model=seed_trax trainer.global_batch_tokens=32768 world=2   # this machine's CPU

Arguments: the overrides lmsys-train takes (model=..., deepspeed=zero3, trainer.micro_batch_size=4,
model.init_from=EXPORT, ...), plus
  world=N               ranks (default 1); the global batch must split into them
  device=NAME           cpu (this machine; its memory shared by the ranks; no time), v100-16gb,
                        v100-32gb, a10g, l4, l40s, rtx3090, rtx4090, a6000, a100-40gb, a100-80gb,
                        h100, h200 (default: cpu)
  device_memory=BYTES   each rank's usable memory instead (another card, or a shared one;
                        trainer.plan_memory_bytes=BYTES, as lmsys-train takes it, does the same)
  json=true             one JSON object: peak_bytes, components (adding up to peak_bytes),
                        device_bytes, fits, host_bytes, step_time_s, run_time_s, suggestions, ...
  check=true            exit 3 when the launch is predicted not to fit (scripts: `|| ...`)

The memory comes from the model's own forward and backward traced on fake tensors, with ZeRO's
arithmetic over it; what each component counts, where the figures come from and how accurate
they were against measured runs: docs/planning.md.

Errors (an unknown device, a world size that does not split the global batch, a config that
cannot be built) print one line `lmsys-plan: error: ...` and exit 2.
"""

from __future__ import annotations

import json
import sys

from lmsys.cli import flag_as_override, run_cli
from lmsys.core.config import compose, config_keys
from lmsys.core.devices import device_spec
from lmsys.core.errors import UsageError
from lmsys.model.ops import prepare_kernels
from lmsys.planning.planner import plan_launch
from lmsys.planning.report import report_lines

PROG = "lmsys-plan"
OWN_KEYS = ("world", "device", "device_memory", "json", "check")
DOES_NOT_FIT = 3  # check=true's exit status for a launch predicted not to fit


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


def _int(key: str, text: str, least: int) -> int:
    try:
        value = int(float(text)) if "e" in text.lower() else int(text)
    except ValueError:
        raise UsageError(f"{key}={text!r} is not valid; it must be an integer") from None
    if value < least:
        raise UsageError(f"{key}={value} must be >= {least}")
    return value


def _bool(key: str, text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise UsageError(f"{key}={text!r} is not valid; use true or false")
    return text.lower() in ("true", "1")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if any(a in ("-h", "--help", "help") for a in argv):
            print(__doc__)
            return 0
        if any(a.startswith("-") for a in argv):  # `--world 8`: name the key=value it means
            flag_as_override(PROG, argv, [*OWN_KEYS, *config_keys()], set())
        own, overrides = split_arguments(argv)
        world = _int("world", own.get("world", "1"), 1)
        memory = _int("device_memory", own["device_memory"], 1) if "device_memory" in own else 0
        as_json, check = _bool("json", own.get("json", "false")), _bool("check", own.get("check", "false"))
        cfg = compose(overrides)
        device = device_spec(own.get("device", "cpu"), memory or cfg.trainer.plan_memory_bytes)
        prepare_kernels(cfg.model.kernels, device.kind)  # the trace runs the target's kernels' ops
        plan = plan_launch(cfg, world, device)
        if as_json:
            print(json.dumps(plan.as_json(), indent=None))
        else:
            print("\n".join(f"{PROG}: {line}" for line in report_lines(plan)))
        return DOES_NOT_FIT if check and not plan.fits else 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
