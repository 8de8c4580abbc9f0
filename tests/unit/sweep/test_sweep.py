"""Sweeps, in this process: the expansion matches Hydra's cartesian product, a multirun's world size,
the sweep plots' whole-step ticks, and the one sweep directory of a launch's ranks. Real sweeps:
tests/integration/launch/test_sweep.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml

from lmsys.sweep.multirun import expand_sweep, multirun_world_size


def test_expansion_is_hydras_cartesian_product():
    jobs = expand_sweep(["optim.lr=1e-3,3e-4", "model=tiny,seed_trax", "trainer.max_steps=5"])
    assert jobs == [
        ["optim.lr=0.001", "model=tiny", "trainer.max_steps=5"],
        ["optim.lr=0.001", "model=seed_trax", "trainer.max_steps=5"],
        ["optim.lr=0.0003", "model=tiny", "trainer.max_steps=5"],
        ["optim.lr=0.0003", "model=seed_trax", "trainer.max_steps=5"],
    ]
    assert expand_sweep(["trainer.seed=range(1,4)"]) == [[f"trainer.seed={i}"] for i in (1, 2, 3)]
    assert ["model=seed_gpt"] in expand_sweep(["model=glob(seed_*)"])


def test_multirun_world_size():
    assert multirun_world_size(["optim.lr=1e-3,3e-4"], {}) == 1
    assert multirun_world_size(["optim.lr=1e-3"], {"WORLD_SIZE": "4"}) == 4  # under torchrun
    slurm = ["hydra/launcher=slurm", "hydra.launcher.tasks_per_node=8", "hydra.launcher.nodes=2"]
    assert multirun_world_size(slurm, {}) == 16
    assert multirun_world_size(["hydra/launcher=joblib"], {}) is None


@pytest.mark.parametrize("seeds", [1, 2], ids=["jobs", "seed-groups"])
def test_sweep_plots_tick_whole_steps(tmp_path, monkeypatch, seeds):
    """Runs of 3 steps: both kinds of losses.png mark whole optimizer steps only, never 1.25."""
    from matplotlib.figure import Figure

    from lmsys.sweep.summary import summarize

    ticks: list[list[float]] = []
    save = Figure.savefig

    def recording(self, *args, **kwargs):
        self.canvas.draw()
        ticks.extend(list(ax.get_xticks()) for ax in self.axes)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording)
    for num in range(2 * seeds):
        _fake_job(tmp_path, num, 1e-3 if num % 2 else 3e-4, "tiny", [6.0, 5.5, 5.2], [5.3])
        if seeds == 2:  # jobs 0, 1 and 2, 3 repeat a configuration with another seed
            config = yaml.safe_load((tmp_path / str(num) / "config.yaml").read_text())
            config["trainer"]["seed"] = 1 + num // 2
            (tmp_path / str(num) / "config.yaml").write_text(yaml.safe_dump(config))
    summarize(tmp_path, out=io.StringIO())
    assert len(ticks) == 2 and all(ticks), ticks
    assert all(float(t).is_integer() for axis in ticks for t in axis), ticks


def test_shared_sweep_dir_is_the_one_the_first_rank_set(monkeypatch):
    """Under torchrun the ranks agree on hydra.sweep.dir through the launcher's store: a rank
    that asks after another one gets that one's directory, whatever its own clock says."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from lmsys.sweep.multirun import SWEEP_DIR_KEY, default_sweep_dir, shared_sweep_dir

    argv = ["-m", "optim.lr=1e-3,3e-4"]
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert shared_sweep_dir(argv) == argv  # not under torchrun: Hydra resolves ${now:...} itself
    assert default_sweep_dir().startswith("runs/multirun-") and "${" not in default_sweep_dir()

    agent_store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    first = shared_sweep_dir(argv)
    assert first[:2] == argv and first[2].startswith("hydra.sweep.dir=runs/multirun-")
    agent_store.set(SWEEP_DIR_KEY, "runs/multirun-set-by-rank-0")  # as if another rank was first
    assert shared_sweep_dir(argv) == [*argv, "hydra.sweep.dir=runs/multirun-set-by-rank-0"]
    given = [*argv, "hydra.sweep.dir=mine"]
    assert shared_sweep_dir(given) == given  # the user's choice stands


def _fake_job(root: Path, num: int, lr: float, model: str, train: list[float], val: list[float]) -> None:
    run_dir = root / str(num)
    run_dir.mkdir(parents=True)
    config = {
        "model": {"name": model, "d_model": 32 if model == "tiny" else 64, "n_layers": 2},
        "optim": {"lr": lr, "warmup_steps": 2},
        "trainer": {"max_steps": 6, "run_dir": str(run_dir), "seed": 1},
        "logger": {"group": "fake"},
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    records = [
        {"kind": "train", "step": i + 1, "loss": v, "tokens_per_s": 1000.0 + i} for i, v in enumerate(train)
    ]
    records += [{"kind": "eval", "step": 3 * (i + 1), "loss": v} for i, v in enumerate(val)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
