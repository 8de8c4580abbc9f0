"""Save a real ZeRO-3 engine twice and report what happened to its persistent parameters (a test
fixture for lmsys.engine.zero.persistent_params_kept).

    torchrun --standalone --nproc_per_node=2 tests/integration/training/zero3_save_probe.py OUT

A small model (the tiny preset shrunk) at deepspeed.param_persistence_threshold=100, so that its
biases and norms stay whole on every rank and its matrices are partitioned, takes one optimizer
step. Then:

1. `lmsys.engine.checkpoint.save` (lmsys's path) into OUT/lmsys;
2. DeepSpeed's own `engine.save_checkpoint` of the same tag into OUT/deepspeed.

Around each, every persistent parameter's `all_gather` is counted, and after each it records
whether the parameter is whole again, in the same storage (not a new all-gather buffer) and with
the same values. Each rank
writes OUT/rank<r>.json; the test compares the two saves' files.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.torchrun_exit import leave  # noqa: E402

SMALL = ["vocab_size=256", "d_model=32", "n_layers=2", "n_heads=2", "max_seq_len=16", "ffn.d_ff=64"]


def main() -> None:
    out = Path(sys.argv[1])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    from lmsys.core.config import compose, config_to_dict
    from lmsys.core.runtime import resolve_precision, split_batch
    from lmsys.engine import checkpoint as ckpt
    from lmsys.engine import zero as eng
    from lmsys.model.transformer import Transformer

    device = torch.device("cpu")
    eng.init_distributed(device, 120.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = compose(
        [
            "model=tiny",
            *(f"model.{o}" for o in SMALL),
            "deepspeed=zero3",
            "deepspeed.param_persistence_threshold=100",
            "logger=none",
            "data.seq_len=16",
            "trainer.micro_batch_size=2",
            f"trainer.global_batch_tokens={2 * 16 * world}",
        ]
    )
    plan = split_batch(cfg, world)
    precision = resolve_precision(cfg.deepspeed.precision, device)
    torch.manual_seed(cfg.trainer.seed)
    engine, _, _ = eng.initialize(Transformer(cfg.model), cfg, plan, device, precision)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    loss = engine(tokens, torch.ones_like(tokens, dtype=torch.float32))
    engine.backward(loss)
    engine.step()

    persistent = list(engine.optimizer.persistent_parameters)
    gathers = [0]
    for p in persistent:

        def counted(*args, _gather=p.all_gather, **kwargs):
            gathers[0] += 1
            return _gather(*args, **kwargs)

        p.all_gather = counted

    def probe(save) -> dict:
        before = [(p.data, p.data.clone()) for p in persistent]
        gathers[0] = 0
        save()
        return {
            "gathers": gathers[0],
            "whole": all(p.ds_status.name == "AVAILABLE" for p in persistent),
            "same_storage": all(p.data.data_ptr() == d.data_ptr() for p, (d, _) in zip(persistent, before)),
            "same_values": all(torch.equal(p.data, copy) for p, (_, copy) in zip(persistent, before)),
        }

    state = ckpt.TrainState(
        step=1, tokens_seen=plan.tokens_per_step, nan_skips=0, last_loss=float(loss.item()),
        world_size=world, zero_stage=3, precision=precision, tokenizer_sha256="", wandb_id=None,
        config=config_to_dict(cfg),
    )  # fmt: skip
    lmsys_save = probe(lambda: ckpt.save(engine, out / "lmsys", state, {}, rank, keep_last=1))
    tag = ckpt.tag_for(1)
    ds_save = probe(lambda: engine.save_checkpoint(str(out / "deepspeed"), tag=tag, save_latest=False))
    report = {
        "persistent": len(persistent),
        "partitioned": sum(1 for p in engine.module.parameters() if not p.ds_persist),
        "lmsys": lmsys_save,
        "deepspeed": ds_save,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    leave(rank)


if __name__ == "__main__":
    main()
