"""A plain PyTorch training loop (no DeepSpeed, one process) on the same model, data order,
optimizer, schedule and clipping as lmsys.train: the math every sharded run must reproduce. Its
loss is the full-logits path (model.loss_impl=full: logits, then the weighted cross-entropy),
so runs with the chunked (auto on CPU) or fused loss are checked against it."""

from __future__ import annotations

from pathlib import Path

import torch

from lmsys.core.config import compose, tokens_per_sample
from lmsys.core.runtime import seed_everything
from lmsys.engine.zero import lr_at, param_groups
from lmsys.model.transformer import Transformer


def plain_losses(
    overrides: list[str], skip_steps: set[int] | frozenset[int] = frozenset()
) -> dict[int, float]:
    """Loss per step of a plain loop over the whole global batch; `skip_steps` consume their batch
    but make no update (what a NaN step must amount to)."""
    from lmsys.data.loader import TokenLoader
    from lmsys.data.shards import PreparedData

    cfg = compose([*overrides, "model.loss_impl=full"])
    t, o = cfg.trainer, cfg.optim
    sequences = t.global_batch_tokens // cfg.data.seq_len
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seed_everything(t.seed)
        model = Transformer(cfg.model)
        opt = torch.optim.AdamW(
            param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False
        )
        loader = TokenLoader(
            PreparedData(Path(cfg.data.dir)),
            "train",
            tokens_per_sample=tokens_per_sample(cfg.model, cfg.data.seq_len),
            global_batch_size=sequences,
            micro_batch_size=sequences,
            rank=0,
            world_size=1,
            seed=t.seed,
            mask_doc_boundaries=cfg.data.mask_doc_boundaries,
            document_masking=cfg.data.document_masking,
        )
        losses = {}
        for step in range(1, t.max_steps + 1):
            batch = loader.next_batch()
            if step in skip_steps:
                continue
            for group in opt.param_groups:
                group["lr"] = lr_at(step, o, t.max_steps)
            loss = model.loss(batch.tokens, batch.weights, batch.documents)
            loss.backward()
            if o.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[step] = loss.item()
        return losses
    finally:
        torch.set_num_threads(threads)
