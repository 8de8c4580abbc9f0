"""trainer.deterministic=true: two real 2-rank ZeRO-2 runs of the same config give bitwise-equal
losses (metrics.jsonl) and bitwise-equal weights in every checkpoint (lmsys.core.runtime
.make_deterministic: torch's deterministic algorithms, seeded data order and initialisation)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from lmsys.engine.checkpoint import CHECKPOINTS, tag_for
from lmsys.engine.zero import consolidated_state_dict
from tests.integration.features import Run, child_env, train_command

pytestmark = pytest.mark.slow


def test_two_deterministic_runs_are_bitwise_equal(runs, tmp_path):
    overrides = [*runs.overrides("2proc-zero2"), "trainer.deterministic=true", "trainer.max_steps=4"]
    started = {}
    for name in ("a", "b"):  # both at once: their start-up overlaps
        command = train_command(2, [*overrides, f"trainer.run_dir={tmp_path / name}"])
        started[name] = subprocess.Popen(
            command, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    done = {}
    for name, proc in started.items():
        out, err = proc.communicate(timeout=400)
        done[name] = Run(name, tmp_path / name, proc.returncode, out, err).check()
    a, b = done["a"], done["b"]
    assert "deterministic" in a.stdout  # the banner says so
    losses_a, losses_b = a.losses(), b.losses()
    assert sorted(losses_a) == [1, 2, 3, 4]
    assert [float(x).hex() for x in losses_a.values()] == [float(x).hex() for x in losses_b.values()]
    saved = {}
    for step in (2, 4):  # trainer.save_interval=2
        tag = f"{CHECKPOINTS}/{tag_for(step)}"
        weights_a = consolidated_state_dict(a.run_dir / tag, zero_stage=2)
        weights_b = consolidated_state_dict(b.run_dir / tag, zero_stage=2)
        assert weights_a.keys() == weights_b.keys() and weights_a
        for name, tensor in weights_a.items():
            assert torch.equal(tensor, weights_b[name]), f"step {step}: {name} differs"
        saved[step] = weights_a
    assert any(not torch.equal(saved[2][k], saved[4][k]) for k in saved[2])  # it trained in between
