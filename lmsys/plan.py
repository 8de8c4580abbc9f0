"""lmsys-plan: will this launch fit, and how long will it take? Memory and time per rank for any
config, world size and device, before anything starts.

    lmsys-plan model=gpt2_1558m trainer=gpt2 optim=gpt2 world=8 device=h100
    lmsys-plan model=gpt2_124m trainer=gpt2 deepspeed=zero3 world=32 device=a100-80gb json=true
    lmsys-plan model=llama3_2_1b trainer=gpt2 data.seq_len=1024 world=8 device=l40s check=true
    python -m lmsys.plan model=seed_trax trainer.global_batch_tokens=32768 world=2   # this machine's CPU

Takes the overrides lmsys-train takes (model=..., deepspeed=zero3, trainer.micro_batch_size=4,
model.init_from=EXPORT, ...) beside its options. The memory comes from the model's own forward
and backward traced on fake tensors, with ZeRO's arithmetic over it; what each component counts,
where the figures come from and how accurate they were against measured runs: docs/planning.md.
"""

from __future__ import annotations

import json
import sys

from lmsys.cli import Option, flag_as_override, parse_options, run_cli
from lmsys.core.config import compose, config_keys
from lmsys.core.devices import DEVICE_NAMES, device_spec
from lmsys.core.errors import UsageError
from lmsys.model.ops import prepare_kernels
from lmsys.planning.planner import plan_launch
from lmsys.planning.report import report_lines

PROG = "lmsys-plan"
OPTIONS = [
    Option("world", "int", 1, "ranks; the global batch must split into them"),
    Option(
        "device", "choice", "cpu", "cpu: this machine, its memory shared by the ranks, no time", DEVICE_NAMES
    ),
    Option("device_memory", "int", None, "each rank's usable memory in bytes (as trainer.plan_memory_bytes)"),
    Option(
        "json", "bool", False, "one JSON object: peak_bytes, components, fits, step_time_s, suggestions, ..."
    ),
    Option("check", "bool", False, "exit 3 when the launch is predicted not to fit"),
]
DOES_NOT_FIT = 3  # check=true's exit status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        if any(a.startswith("-") and a not in ("-h", "--help") for a in argv):  # `--world 8`: name world=8
            flag_as_override(PROG, argv, [*(o.name for o in OPTIONS), *config_keys()], set())
        own = [
            a
            for a in argv
            if a.partition("=")[0] in {o.name for o in OPTIONS} or a in ("-h", "--help", "help")
        ]
        opts = parse_options(PROG, own, OPTIONS, __doc__ or "")
        if opts is None:
            return 0
        for key in ("world", "device_memory"):
            if opts[key] is not None and opts[key] < 1:
                raise UsageError(f"{key}={opts[key]} must be >= 1")
        cfg = compose([a for a in argv if a not in own])
        device = device_spec(opts["device"], opts["device_memory"] or cfg.trainer.plan_memory_bytes)
        prepare_kernels(cfg.model.kernels, device.kind)  # the trace runs the target's kernels' ops
        plan = plan_launch(cfg, opts["world"], device)
        if opts["json"]:
            print(json.dumps(plan.as_json(), indent=None))
        else:
            print("\n".join(f"{PROG}: {line}" for line in report_lines(plan)))
        return DOES_NOT_FIT if opts["check"] and not plan.fits else 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
