"""Every PNG lmsys draws: a run's losses, an evaluation over checkpoints, a sweep's jobs.

matplotlib is imported when a plot is drawn, never at import: it costs about a second, which no
command should pay before it has something to draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmsys.core.rundir import LOSS_PLOT_FILE, EvalRecord, TrainRecord, read_records, read_run_file
from lmsys.engine.checkpoint import step_of


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files only (the Agg backend)."""
    import matplotlib  # the one place: see the module docstring

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def steps_axis(ax: Any) -> None:
    """An x axis of optimizer steps: labelled, ticks at whole steps only (a short run's axis
    would otherwise read 1.25, 1.50, ...)."""
    from matplotlib.ticker import MaxNLocator  # matplotlib is loaded by now (pyplot), see above

    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def resume_steps(run_dir: str | Path) -> list[int]:
    """The steps a run was resumed from, in launch order (run.json's launches)."""
    launches = read_run_file(Path(run_dir)).get("launches", [])
    found = (step_of(Path(launch["resumed_from"]).name) for launch in launches if launch.get("resumed_from"))
    return [step for step in found if step is not None]


def loss_figure(run_dir: str | Path) -> Any | None:
    """The figure of loss.png (None when the run has no loss yet): training and validation loss
    per step, a dashed line where a launch resumed."""
    train = [r for r in read_records(run_dir, TrainRecord) if r.loss is not None]
    evals = [r for r in read_records(run_dir, EvalRecord) if r.loss is not None]
    if not train and not evals:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot([r.step for r in train], [r.loss for r in train], label="train loss", lw=1.2)
    if evals:
        ax.plot([r.step for r in evals], [r.loss for r in evals], "o-", label="validation loss", lw=1.2)
    for i, step in enumerate(resume_steps(run_dir)):
        ax.axvline(step, color="grey", ls="--", lw=0.8, label="resumed" if i == 0 else None)
    steps_axis(ax)
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_losses(run_dir: str | Path) -> Path | None:
    """<run>/loss.png from metrics.jsonl and run.json (`loss_figure`)."""
    fig = loss_figure(run_dir)
    if fig is None:
        return None
    out = Path(run_dir) / LOSS_PLOT_FILE
    fig.savefig(out)
    pyplot().close(fig)
    return out


def plot_run(rows: list[dict], out: Path, title: str) -> Path:
    """lmsys-eval run=: loss and perplexity of every checkpoint against its step."""
    plt = pyplot()
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    ax1.plot(steps, [r["loss"] for r in rows], "o-")
    steps_axis(ax1)
    ax1.set_ylabel("loss (nats/token)")
    ax2.plot(steps, [r["perplexity"] for r in rows], "o-", color="tab:orange")
    steps_axis(ax2)
    ax2.set_ylabel("perplexity")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_sweep(jobs: Sequence[Any], labels: Sequence[str], path: Path, title: str) -> Path | None:
    """losses.png: training loss (left) and validation loss (right), every job on shared axes."""
    if not any(j.train or j.val for j in jobs):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (job, label) in enumerate(zip(jobs, labels)):
        color = colors[i % len(colors)]
        if job.train:
            axes[0].plot(*zip(*job.train), color=color, lw=1.2, label=label)
        if job.val:
            axes[1].plot(*zip(*job.val), "o-", color=color, lw=1.2, ms=3, label=label)
    for ax, name in zip(axes, ("training loss", "validation loss")):
        ax.set_title(name)
        steps_axis(ax)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cross-entropy (nats/token)")
    if not any(j.val for j in jobs):
        axes[1].text(0.5, 0.5, "no validation yet", ha="center", va="center", transform=axes[1].transAxes)
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="lower center", ncol=min(3, max(1, len(labels))), fontsize=8, frameon=False
    )
    fig.suptitle(title)
    rows_of_legend = math.ceil(len(labels) / 3) if labels else 0
    fig.tight_layout(rect=(0, min(0.4, 0.06 * rows_of_legend + 0.02), 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep_groups(groups: Sequence[Any], path: Path, title: str) -> Path | None:
    """losses.png of a sweep that repeats configurations over seeds: per configuration (a
    lmsys.sweep.stats.Group) the mean training (left) and validation (right) loss of its jobs at
    every step they all reached, with a band of +-1 standard deviation between them."""
    if not any(j.train or j.val for g in groups for j in g.jobs):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=110, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, group in enumerate(groups):
        color = colors[i % len(colors)]
        label = f"{group.label} (n={len(group.jobs)})"
        for ax, which in zip(axes, ("train", "val")):
            series = [dict(getattr(j, which)) for j in group.jobs if getattr(j, which)]
            if not series:
                continue
            steps = sorted(set.intersection(*(set(s) for s in series)))
            values = [[s[step] for s in series] for step in steps]
            mean = [sum(v) / len(v) for v in values]
            std = [math.sqrt(sum((x - m) ** 2 for x in v) / max(1, len(v) - 1)) for v, m in zip(values, mean)]
            ax.plot(steps, mean, "-" if which == "train" else "o-", color=color, lw=1.2, ms=3, label=label)
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=color, alpha=0.2, lw=0)  # fmt: skip
    for ax, name in zip(axes, ("training loss (mean, +-1 std over seeds)", "validation loss")):
        ax.set_title(name)
        steps_axis(ax)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cross-entropy (nats/token)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="lower center", ncol=min(3, max(1, len(labels))), fontsize=8, frameon=False
    )
    fig.suptitle(title)
    fig.tight_layout(rect=(0, min(0.4, 0.06 * math.ceil(len(labels) / 3) + 0.02), 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path
