"""A plan in words: lmsys-plan's report and lmsys-train's startup line."""

from __future__ import annotations

from lmsys.core.devices import GIB
from lmsys.planning.planner import Plan

MIB = 1 << 20


def mib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB" if abs(n) < 10 * GIB else f"{n / GIB:,.2f} GiB"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def evaluation_words(plan: Plan) -> str:
    """How long one evaluation takes and how many trainer.max_steps holds, as far as known."""
    if plan.evaluation_forwards is None:
        return "evaluation: the whole validation split (its size is read from data.dir, not prepared here)"
    micro = plan.batch.micro_batch_size
    words = f"evaluation: {plan.evaluation_forwards} forward(s) of micro-batch {micro} per rank"
    if plan.evaluation_s is None:
        return f"{words}, {plan.evaluations} in the run"
    each, every = duration(plan.evaluation_s), duration(plan.evaluation_s * plan.evaluations)
    return f"{words}, about {each} each; {plan.evaluations} in the run: {every}"


def evaluation_warning(plan: Plan) -> str | None:
    """A warning when the run's evaluations would take more compute than its training (a forward
    is about a third of a training step's FLOPs), with the setting that caps them."""
    if plan.evaluation_forwards is None or not plan.evaluations:
        return None
    evaluating = plan.evaluations * plan.evaluation_forwards
    training = 3 * plan.max_steps * plan.batch.grad_accum
    if evaluating <= training:
        return None
    return (
        f"evaluations would take about {evaluating / (evaluating + training):.0%} of the run's compute "
        f"({plan.evaluations} of {plan.evaluation_forwards} forwards per rank each); trainer.eval_batches=N "
        "caps each at N forwards, trainer.eval_interval spaces them"
    )


def startup_line(plan: Plan) -> str:
    """lmsys-train's line before its first step: the prediction its measured peak is held against."""
    time = f", about {plan.step_time_s:.3g} s per step" if plan.step_time_s is not None else ""
    return (
        f"memory: predicted {mib(plan.tensor_bytes)} of tensors per rank ({mib(plan.peak_bytes)} with the "
        f"allocator margin; {_verdict(plan.fits)} {mib(plan.device_bytes)}){time}; {evaluation_words(plan)} "
        "(lmsys-plan lists the components)"
    )


def _verdict(fits: bool) -> str:
    return "fits" if fits else "does NOT fit"


def report_lines(plan: Plan) -> list[str]:
    """The plan in words: components, the verdict, time, suggestions."""
    width = max(len(k) for k in plan.components)
    lines = [
        f"{plan.n_params:,} parameters, {plan.precision}, world {plan.world_size} on {plan.device.label} "
        f"({mib(plan.device_bytes)} per rank: {plan.device.memory_source}); {plan.batch.arithmetic()}",
        f"memory per rank, at the step's largest moment ({plan.peak_phase}):",
        *(f"  {name:<{width}}  {mib(value):>12}" for name, value in plan.components.items()),
        f"  {'peak':<{width}}  {mib(plan.peak_bytes):>12}",
        *(f"  host memory ({name}, offloaded): {mib(value)} per rank" for name, value in plan.host.items()),
    ]
    if plan.host and plan.host_capacity_bytes is not None:
        lines.append(
            f"  host memory {_verdict(plan.host_fits)}: {mib(sum(plan.host.values()))} of the node's "
            f"{mib(plan.host_capacity_bytes)} per rank ({plan.device.node})"
        )
    lines.append(
        f"{_verdict(plan.fits)}: {mib(plan.peak_bytes)} of {mib(plan.device_bytes)} per rank "
        f"(headroom {mib(plan.device_bytes - plan.peak_bytes)})"
    )
    if plan.step_time_s is not None and plan.run_time_s is not None:
        lines.append(
            f"time: {plan.step_time_s:.3g} s per step, {plan.tokens_per_s:,.0f} tokens/s, "
            f"MFU {plan.mfu:.0%}; trainer.max_steps={plan.max_steps} with its evaluations: "
            f"{duration(plan.run_time_s)} ({plan.time_source})"
        )
    else:
        lines.append(f"time: {plan.time_source}")
    lines.append(evaluation_words(plan))
    warning = evaluation_warning(plan)
    lines += [f"warning: {warning}"] if warning else []
    if plan.suggestions:
        lines.append("what lowers the peak (predicted peak per rank):")
        lines += [
            f"  {s.change}: {mib(s.peak_bytes)}{'' if s.fits else ' (still too large)'}"
            for s in plan.suggestions
        ]
    return lines
