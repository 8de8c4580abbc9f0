"""A training launch on this rank, from the config to the last checkpoint: `train(cfg)`, which
lmsys-train (lmsys/train.py) calls on every rank.

The preflight first (every mistake in the batch or the data before the process group forms), then
the process group; rank 0 settles the run directory (trainer.run_dir, or
runs/<model.name>-<timestamp>) and the checkpoint it continues, and every rank receives them
(lmsys/training/preflight.py). Then the trainer (lmsys/training/trainer.py) and the components
that hook into its loop (lmsys/training/components.py), registered here in the order the loop
calls them. A plain run composes its config once, without Hydra's app; `-m` and Hydra's other
flags go through Hydra (which writes nothing: conf/config.yaml has no output subdir, no log files,
run dir ".").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from lmsys.core.config import Config
from lmsys.core.console import Console, warn
from lmsys.core.runtime import Setup, env_dist_info, oversubscription, split_batch
from lmsys.training.faults import Faults
from lmsys.training.health import Health
from lmsys.training.peak_memory import PeakMemory
from lmsys.training.preflight import StartingPoint, agree_on_start, elastic_ids, preflight, start_processes
from lmsys.training.reporter import Reporter
from lmsys.training.saving import Saves
from lmsys.training.stopping import StopRequest
from lmsys.training.trainer import Trainer
from lmsys.training.watchdog import Watchdog

PROG = "lmsys-train"


def register_components(trainer: Trainer, cfg: Config, memory: PeakMemory) -> None:
    """The run's components, in the order the loop calls them (lmsys/training/components.py)."""
    t, setup, report, run_dir = cfg.trainer, trainer.setup, trainer.report, trainer.run_dir
    # every rank, here: asynchronous saves form a process group of their own
    saves = Saves.of(t, setup, run_dir, report, pause_s=cfg.debug.save_delay_s)
    faults = Faults.of(cfg.debug, setup.rank, setup.world_size, elastic_ids()[1], finish_saves=saves.wait)
    health = Health(cfg, setup, run_dir, report, faults, finish_saves=saves.wait)
    watchdog = Watchdog(t.hang_timeout_s, setup.rank, setup.world_size, run_dir, PROG, report.warn)
    watching = [watchdog] if t.hang_timeout_s > 0 else []  # trainer.hang_timeout_s=0: no watchdog
    trainer.register(saves, *watching, memory, health, faults)


def train(cfg: Config, step_hook: Callable[[int], None] | None = None) -> Path:
    """Train according to `cfg` (validated). Every rank calls this. Returns the run directory.

    step_hook(step), if given, runs at the end of every step (see `Trainer.fit`)."""
    stop = StopRequest()  # from now on SIGTERM / SIGUSR1 stop the run after a step, with a checkpoint
    stop.install()
    start: StartingPoint | None = None
    try:
        # every mistake in the batch or the data is reported before the process group forms
        checked = preflight(cfg, env_dist_info().world_size, warn=lambda message: warn(PROG, message))
        data = checked.data
        assert data is not None
        rank = int(os.environ.get("RANK", "0"))  # torchrun's; the process group forms below
        console = Console(PROG, rank, cfg.trainer.progress, cfg.logger.console_interval)
        device, precision = start_processes(cfg, console)
        rank, world = dist.get_rank(), dist.get_world_size()
        # rank 0 settles the run directory and the checkpoint it continues (a resume's batch check first)
        start = agree_on_start(cfg, rank, world, data.tokenizer_sha256, console)
        crowded = oversubscription(device)
        if crowded:
            console.warn(crowded)
        setup = Setup(device, precision, rank, world, split_batch(cfg, world))
        report = Reporter(console, cfg.logger.log_interval, cfg.logger.plot)
        memory = PeakMemory(cfg.trainer, setup, checked.memory, report)  # before the model: its baseline
        try:
            trainer = Trainer(cfg, setup, data, start, report, stop)
        except BaseException:
            if start.lock is not None:  # refused before writing (e.g. model.init_from): no trace left
                start.lock.release_untouched()
            raise
        register_components(trainer, trainer.cfg, memory)
        trainer.open_run_dir()
        trainer.fit(step_hook)
    finally:
        stop.restore()
        if start is not None and start.lock is not None:
            start.lock.release()  # a sweep's next job in this process may need it
    return start.run_dir
