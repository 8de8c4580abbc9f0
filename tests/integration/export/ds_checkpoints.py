"""Write real DeepSpeed checkpoints of a small model at several ZeRO stages (a test fixture).

    torchrun --standalone --nproc_per_node=N tests/integration/export/ds_checkpoints.py \
        OUT DATA_DIR STAGES [overrides...]

For each stage: build the Transformer, wrap it with lmsys.engine.zero (the training path's engine:
LossModule, param groups, DeepSpeed JSON), take two optimizer steps on random tokens, save with
lmsys.engine.checkpoint.save (the training path's atomic save, client state as train.py writes it) into
OUT/zero<stage>, then run the engine's own model on fixed ids and write rank 0's logits to
OUT/zero<stage>/reference_logits.safetensors. At ZeRO-3 every rank takes part in that forward
(DeepSpeed gathers the partitioned parameters), so the logits are the trained model's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.torchrun_exit import leave  # noqa: E402


def main() -> None:
    out, data_dir, stages = Path(sys.argv[1]), sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    overrides = sys.argv[4:]
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist
    from safetensors.torch import save_file

    from lmsys.core.config import compose, config_to_dict
    from lmsys.core.runtime import resolve_precision, split_batch
    from lmsys.data.tokenizer import Tokenizer
    from lmsys.engine import checkpoint as ckpt
    from lmsys.engine import zero as eng
    from lmsys.model.transformer import Transformer

    tok = Tokenizer(Path(data_dir) / "tokenizer.model")
    device = torch.device("cpu")
    eng.init_distributed(device, 120.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    for stage in stages:
        cfg = compose(
            [
                f"deepspeed.stage={stage}",
                f"data.dir={data_dir}",
                "logger=none",
                "deepspeed.param_persistence_threshold=0",
                *overrides,
            ]
        )
        plan = split_batch(cfg, world)
        precision = resolve_precision(cfg.deepspeed.precision, device)
        torch.manual_seed(cfg.trainer.seed)
        model = Transformer(cfg.model)
        engine, _, _ = eng.initialize(model, cfg, plan, device, precision)
        g = torch.Generator().manual_seed(100 + rank)
        for _step in range(2):  # two optimizer steps
            for _ in range(plan.grad_accum):
                tokens = torch.randint(
                    0, cfg.model.vocab_size, (plan.micro_batch_size, plan.tokens_per_sample), generator=g
                )
                loss = engine(tokens, torch.ones_like(tokens, dtype=torch.float32))
                engine.backward(loss)
                engine.step()
        run_dir = out / f"zero{stage}"
        state = ckpt.TrainState(
            step=2,
            tokens_seen=2 * plan.tokens_per_step,
            nan_skips=0,
            last_loss=float(loss.item()),
            world_size=world,
            zero_stage=stage,
            precision=precision,
            tokenizer_sha256=tok.sha256,
            wandb_id=None,
            config=config_to_dict(cfg),
        )
        ckpt.save(engine, run_dir, state, {"loader": {}, "rng": ckpt.rng_state()}, rank, keep_last=2)
        engine.eval()
        ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            logits = engine.module.model(ids)
        if rank == 0:
            save_file(
                {"ids": ids, "logits": logits.float().contiguous()},
                str(run_dir / "reference_logits.safetensors"),
            )
        dist.barrier()
        del engine
    leave(rank)


if __name__ == "__main__":
    main()
