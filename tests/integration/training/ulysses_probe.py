"""Ulysses sequence parallelism against the single-device model (a test fixture for
lmsys.engine.sequence_parallel):

    torchrun --standalone --nproc_per_node=4 tests/integration/training/ulysses_probe.py OUT

For each case (a model, the sequence-parallel size P, packed documents or not) every rank builds
the same model and computes the whole batch's loss and gradients on its own (the reference); then
a copy of it, its attention wrapped by `shard_sequences` in DeepSpeed's groups of P, computes this
rank's part: the rows of its group (4 / P groups, each its own rows), its positions of them. Each
rank's loss is weighted by its share of the batch's loss weights and the gradients are summed over
the ranks, as the trainer and DeepSpeed do. Each rank writes OUT/rank<r>.json: per case, the
largest difference of the global loss and of any gradient from the reference.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.torchrun_exit import leave  # noqa: E402

SMALL = ["vocab_size=64", "d_model=32", "n_layers=2", "max_seq_len=16", "ffn.d_ff=48"]
ROWS, LENGTH = 4, 17  # tokens per row: 16 positions and the next-token shift (bos_shift: 16)

# name: (preset, model overrides, P, packed documents)
CASES = {
    "gpt2-p4": ("tiny", ["n_heads=4"], 4, False),
    # 2 key/value heads for 4 ranks: each copied to the 2 ranks whose query heads read it
    "llama-gqa-copied-p4-documents": ("llama_tiny", ["n_heads=4", "attention.n_kv_heads=2"], 4, True),
    # 4 key/value heads split among 2 ranks, in 2 groups of 2 that read different rows
    "llama-gqa-split-p2-documents": ("llama_tiny", ["n_heads=8", "attention.n_kv_heads=4"], 2, True),
    # sinusoidal positions counted from 1, bos_shift (every token predicted, no shift)
    "seed_trax-p2": ("seed_trax", ["n_heads=4"], 2, False),
    # the Triton flash-attention kernel (interpreted on CPU) inside the exchange
    "gpt2-triton-p2": ("tiny", ["n_heads=2", "kernels=triton"], 2, False),
    # ... and the Llama family's kernels, grouped heads and packed documents in it
    "llama-gqa-triton-p2-documents": (
        "llama_tiny",
        ["n_heads=4", "attention.n_kv_heads=2", "kernels=triton"],
        2,
        True,
    ),
}


def batch(vocab: int, bos_shift: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows with loss weights (some 0) and packed documents, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    length = LENGTH - 1 if bos_shift else LENGTH
    tokens = torch.randint(1, vocab, (ROWS, length), generator=g)  # (B, S)
    weights = (torch.rand(ROWS, length, generator=g) > 0.2).float()  # (B, S)
    starts = torch.rand(ROWS, length, generator=g) < 0.25  # (B, S)
    starts[:, 0] = False
    documents = starts.long().cumsum(dim=1)  # (B, S)
    return tokens, weights, documents


def run_case(name: str, preset: str, overrides: list[str], size: int, packed: bool) -> dict[str, float]:
    import torch.distributed as dist

    from lmsys.core.config import compose_model
    from lmsys.core.runtime import SequenceShard
    from lmsys.engine.sequence_parallel import sequence_parallel_groups, shard_sequences
    from lmsys.model.transformer import Transformer, next_token_pairs

    cfg = compose_model(preset, [*SMALL, *overrides])
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens, weights, documents = batch(cfg.vocab_size, cfg.bos_shift)
    documents = documents if packed else None
    sharded = copy.deepcopy(model)

    reference = model.loss(tokens, weights, documents)  # the whole batch, one device
    reference.backward()

    shard = SequenceShard(rank % size, size)
    module = shard_sequences(sharded, cfg, shard, sequence_parallel_groups(size))
    rows = slice((rank // size) * ROWS * size // world, (rank // size + 1) * ROWS * size // world)
    mine = (tokens[rows], weights[rows], None if documents is None else documents[rows])
    _, _, pair_weights = next_token_pairs(cfg, tokens, weights, documents)
    _, _, my_pair_weights = next_token_pairs(cfg, *mine)
    share = float(shard.part(my_pair_weights).sum()) / float(pair_weights.sum())
    loss = module(*mine)
    (loss * share).backward()
    total = (loss.detach() * share).reshape(1)
    dist.all_reduce(total)
    largest = 0.0
    for (param_name, p), q in zip(model.named_parameters(), sharded.parameters(), strict=True):
        grad = q.grad.clone()
        dist.all_reduce(grad)
        largest = max(largest, float((grad - p.grad).abs().max()))
        assert p.grad.abs().max() > 0, f"{name}: {param_name} has no reference gradient"
    return {"loss": float(total), "reference": float(reference), "largest_gradient_difference": largest}


def main() -> None:
    out = Path(sys.argv[1])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    from lmsys.engine import zero as eng
    from lmsys.model.ops import prepare_kernels

    prepare_kernels("triton", "cpu")  # the interpreter, before DeepSpeed imports triton
    eng.init_distributed(torch.device("cpu"), 120.0)
    rank = dist.get_rank()
    report = {name: run_case(name, *case) for name, case in CASES.items()}
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    leave(rank)


if __name__ == "__main__":
    main()
