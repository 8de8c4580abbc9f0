"""The learning-rate schedules (optim.schedule, lmsys.engine.zero.lr_at): the cosine and
warmup-stable-decay curves step by step, and every param group following it at its own scale
(optim=muon's Muon group at muon_lr). A real run on the wsd curve: tests/integration/training/test_muon.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lmsys.core.config import ConfigError, OptimConfig, compose
from lmsys.engine.zero import lr_at, set_lr


def test_wsd_warms_up_holds_then_decays_linearly():
    optim = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="wsd", decay_frac=0.2)
    lrs = {s: lr_at(s, optim, 100) for s in range(1, 121)}
    assert [lrs[s] for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])  # linear warmup
    assert all(lrs[s] == 1.0 for s in range(10, 81))  # stable until the last 20% of 100 steps
    assert [lrs[s] for s in (85, 90, 95, 100)] == pytest.approx([0.775, 0.55, 0.325, 0.1])
    assert all(lrs[s] == pytest.approx(0.1) for s in range(100, 121))  # the floor after the horizon
    diffs = [lrs[s] - lrs[s + 1] for s in range(80, 100)]
    assert diffs == pytest.approx([0.045] * 20)  # a straight line


def test_wsd_horizon_is_decay_steps_when_set_and_cosine_is_unchanged():
    wsd = OptimConfig(
        lr=2.0, warmup_steps=0, min_lr_ratio=0.0, schedule="wsd", decay_frac=0.5, decay_steps=40
    )
    assert lr_at(20, wsd, 1000) == 2.0 and lr_at(30, wsd, 1000) == pytest.approx(1.0)
    assert lr_at(40, wsd, 1000) == 0.0
    cosine = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert cosine.schedule == "cosine"
    for s in (11, 30, 55, 100):
        want = 0.1 + 0.45 * (1 + math.cos(math.pi * (s - 10) / 90))
        assert lr_at(s, cosine, 100) == pytest.approx(want, rel=1e-12)


def test_every_group_follows_the_schedule_at_its_scale():
    params = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.SGD([{"params": params[:1], "lr_scale": 10.0}, {"params": params[1:]}], lr=1.0)
    set_lr(SimpleNamespace(optimizer=optimizer), 0.003)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.03, 0.003])


def test_schedule_and_optimizer_keys_are_checked():
    assert compose(["optim=muon"]).optim.name == "muon"
    with pytest.raises(ConfigError, match="optim.schedule='linear' is not valid; choose one of: cosine, wsd"):
        compose(["optim.schedule=linear"])
    with pytest.raises(ConfigError, match=r"optim.decay_frac=1.5 must be in \(0, 1\]"):
        compose(["optim.decay_frac=1.5"])
    with pytest.raises(ConfigError, match="optim=muon needs optim.grad_clip=0"):
        compose(["optim=muon", "optim.grad_clip=1.0"])
