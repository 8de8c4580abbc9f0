"""The parts of lmsys.training.health that need no engine, on CPU in
seconds: when a loss counts as diverging, and the replay with hooks naming where a NaN first
appears (a forward output, an input gradient on one micro-batch, a weight used outside every
forward hook), on a real Transformer with the faults debug.nonfinite_at injects; a replay
that runs out of memory (debug.replay_oom).
The same code in real 2-rank runs: test_nonfinite.py."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch

from lmsys.core.config import ModelConfig, compose
from lmsys.core.errors import ConfigError
from lmsys.data.loader import Batch
from lmsys.model.transformer import Transformer
from lmsys.training.faults import Faults, NonfiniteInjection, refuse_allocation
from lmsys.training.health import Finding, Health, ReplayDidNotFit, out_of_memory, replay, replica

SMALL = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
         "model.max_seq_len=32", "model.ffn.d_ff=64"]  # fmt: skip


def test_a_loss_diverges_above_log_v_plus_margin_or_a_multiple_of_its_median(tmp_path):
    cfg = compose(SMALL)
    health = Health(cfg, None, tmp_path, None, None)  # type: ignore[arg-type]  # no step replayed here
    ceiling = math.log(512) + 1.0
    assert health.verdict(ceiling - 0.01) is None
    assert health.verdict(ceiling + 0.01) == (
        "diverging",
        f"loss {ceiling + 0.01:.4g} is above log(V) + 1 = 7.238",
    )
    assert (
        health.verdict(float("inf"))[0] == "non-finite" and health.verdict(float("nan"))[1] == "loss is nan"
    )
    health.history.extend([2.0] * 9)
    assert health.verdict(4.5) is None  # fewer than 10 applied steps: no median yet
    health.history.append(2.0)
    assert health.verdict(3.9) is None
    kind, what = health.verdict(4.1)
    assert kind == "diverging" and "trainer.spike_factor=2 x its running median 2" in what
    off = Health(
        compose([*SMALL, "trainer.spike_factor=0", "trainer.spike_margin=0"]), None, tmp_path, None, None
    )  # type: ignore[arg-type]  # noqa: E501
    off.history.extend([2.0] * 10)
    assert off.verdict(100.0) is None


@functools.cache
def _model_config() -> ModelConfig:
    return compose(SMALL).model  # once: Hydra's compose takes a second


def _model_and_batches() -> tuple[Transformer, list[Batch]]:
    torch.manual_seed(0)
    model = Transformer(_model_config())
    batches = [Batch(torch.randint(0, 512, (2, 33)), torch.ones(2, 33)) for _ in range(2)]
    return model, batches


def _armed(spec: str, step: int = 4) -> tuple[Transformer, list[Batch], NonfiniteInjection]:
    model, batches = _model_and_batches()
    injection = NonfiniteInjection.parse(spec)
    injection.begin_step(step)
    injection.arm(model)
    return model, batches, injection


def test_the_replay_names_the_first_module_and_pass():
    cpu = torch.device("cpu")
    model, batches, _ = _armed("blocks.0.ffn:forward:rank0:step4")
    assert replay(model, batches, [0.5, 0.5], cpu, rank=3) == Finding(
        3, 0, "blocks.0.ffn", "forward", "output"
    )
    model, batches, _ = _armed("blocks.1.attn:backward:rank0:step4:micro1")
    found = replay(model, batches, [0.5, 0.5], cpu, rank=0)
    assert found == Finding(0, 1, "blocks.1.attn", "backward", "input gradient")
    # a NaN weight of a norm that Block calls through add_norm (no forward hook of its own)
    model, batches = _model_and_batches()
    with torch.no_grad():
        model.blocks[1].norm2.weight[3] = float("nan")
    found = replay(model, batches, [0.5, 0.5], cpu, rank=0)
    assert found == Finding(0, 0, "blocks.1.norm2", "forward", "weight blocks.1.norm2.weight")
    # another step: the injection is quiet, the replay clean, the gradient left in the model
    model, batches, _ = _armed("blocks.0.ffn:forward:rank0:step4", step=5)
    assert replay(model, batches, [0.5, 0.5], cpu, rank=0) is None
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_replay_short_of_memory_is_a_refused_allocation_named_as_such():
    """debug.replay_oom is a real allocation the CPU allocator refuses; `out_of_memory`
    knows its error from others; a refused copy is ReplayDidNotFit; a refused first forward is
    the allocator's own error; each rank reads its own injections; a malformed one is one error."""
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError) as refused:
        refuse_allocation(cpu)
    assert out_of_memory(refused.value) and not out_of_memory(RuntimeError("size mismatch"))
    cfg = compose([*SMALL, "debug.replay_oom=[copy:rank1:step3,replay:rank0:step5]"])
    rank0, rank1 = (Faults.of(cfg.debug, rank, world_size=2, restarts=0) for rank in (0, 1))
    assert (rank0.replay_oom, rank1.replay_oom) == ({("replay", 5)}, {("copy", 3)})
    model, batches = _model_and_batches()
    engine = SimpleNamespace(module=SimpleNamespace(model=model))
    with pytest.raises(ReplayDidNotFit, match="^the copy of the model: .*can't allocate memory") as short:
        replica(engine, _model_config(), 0, functools.partial(rank1.replay_allocated, 3))
    assert not short.value.elsewhere
    copy = replica(engine, _model_config(), 0, functools.partial(rank1.replay_allocated, 4))  # another step
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), model.parameters(), strict=True))
    rank0.arm(copy, replay_step=5)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        replay(copy, batches, [0.5, 0.5], cpu, rank=0)
    with pytest.raises(ConfigError, match=r"debug.replay_oom: 'copy:rank1' is not WHERE:rankR:stepS"):
        compose([*SMALL, "debug.replay_oom=[copy:rank1]"])
