"""Packed documents (`documents=`, data.document_masking): a row holding several documents computes
what each document computes alone, in process, fp32, on the torch path:

- the logits of every token and the loss of every pair inside a document, and every parameter's
  gradient of the packed loss against the sum of the documents' own, for a GPT-2-family preset
  (learned positions), llama_tiny (rotary, grouped-query attention), seed_trax (sinusoidal positions
  from 1, the bos_shift objective) and fourier_T positions, across odd lengths and one-token
  documents, with and without activation checkpointing;
- the same through the Triton kernels (model.kernels=triton, interpreted: the flash-attention
  kernel skipping the tiles outside the documents) for a GPT-2-family preset and llama_tiny;
- the attention dispatch with documents is kernels.reference.document_attention_reference under
  every model.kernels setting (Triton selected: the flash-attention kernel with the documents),
  grouped-query heads included;
- without documents nothing changes, and bad documents are one ValueError."""

from __future__ import annotations

import copy

import pytest
import torch

from kernels.reference import attention_reference, document_attention_reference, repeat_kv
from lmsys.core.config import compose_model
from lmsys.engine.zero import apply_activation_checkpointing
from lmsys.model import ops
from lmsys.model.kv_cache import KVCache, document_positions
from lmsys.model.transformer import Transformer, next_token_documents, next_token_pairs
from tests.hf_files import moved_off_init

TOL = 1e-5  # fp32, relative to the largest magnitude compared
SMALL = ["vocab_size=53", "d_model=32", "n_layers=2", "max_seq_len=32", "ffn.d_ff=48"]
PRESETS = {
    "gpt2-learned": ("tiny", ["n_heads=2"]),
    "llama_tiny-rotary-gqa": ("llama_tiny", ["n_heads=4", "attention.n_kv_heads=2"]),
    "seed_trax-sinusoidal-bos_shift": ("seed_trax", ["n_heads=2"]),
    "gpt2-fourier_T": ("tiny", ["n_heads=2", "positions.kind=fourier_T"]),
}
# Two rows of 24 tokens: odd lengths, one-token documents, a document that is a whole row.
LENGTHS = [[1, 5, 7, 1, 9, 1], [24]]


def make_model(preset: str, seed: int = 0, kernels: str = "auto") -> Transformer:
    name, extra = PRESETS[preset]
    torch.manual_seed(seed)
    overrides = [*SMALL, *extra, f"kernels={kernels}"]
    if kernels == "triton":
        overrides.append("loss_impl=chunked")  # the attention is what documents change
    return moved_off_init(Transformer(compose_model(name, overrides))).float()


def packed_batch(lengths: list[list[int]], seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, documents), both (B, T): row b holds documents of lengths[b], numbered from 10 * b
    (document ids need only be non-decreasing along a row)."""
    width = sum(lengths[0])
    assert all(sum(row) == width for row in lengths)
    ids = torch.randint(0, 53, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    documents = torch.tensor(
        [[10 * b + i for i, n in enumerate(row) for _ in range(n)] for b, row in enumerate(lengths)]
    )
    return ids, documents


def spans(lengths: list[list[int]]):
    """(row, start, end) of every document."""
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            yield b, start, start + n
            start += n


def close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    scale = max(want.abs().max().item(), 1e-30)
    assert (got - want).abs().max().item() <= tol * scale, ((got - want).abs().max().item(), scale)


# ----------------------------------------------------------------------------- logits and losses


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_packed_logits_are_each_documents_own(preset):
    model = make_model(preset).eval()
    ids, documents = packed_batch(LENGTHS)
    packed = model(ids, documents=documents)  # (B, T, V)
    for b, start, end in spans(LENGTHS):
        close(packed[b, start:end], model(ids[b : b + 1, start:end])[0])


def pair_losses(model: Transformer, tokens: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
    """Every pair's loss of the objective (B, S') from the logits, weight 0 where the pair does not
    count (crosses a document)."""
    inputs, targets, weights = next_token_pairs(model.cfg, tokens, None, documents)
    logits = model(inputs, documents=next_token_documents(model.cfg, documents))
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    nll = nll.view_as(targets)
    return nll if weights is None else nll * weights


@pytest.mark.parametrize("preset", PRESETS)
def test_packed_losses_and_gradients_are_each_documents_own(preset):
    """Per-pair losses, the whole loss (its weighted mean) and every gradient: the packed rows'
    against each document run alone (the documents' losses summed with their pair counts)."""
    check_packed_losses_and_gradients(make_model(preset))


@pytest.mark.parametrize("preset", ["gpt2-learned", "llama_tiny-rotary-gqa"])
def test_the_triton_kernels_give_each_documents_own(preset):
    """model.kernels=triton (interpreted): the packed rows run the flash-attention kernel with the
    documents, each document alone the kernel without them."""
    check_packed_losses_and_gradients(make_model(preset, kernels="triton"))


def check_packed_losses_and_gradients(model: Transformer) -> None:
    alone = copy.deepcopy(model)
    ids, documents = packed_batch(LENGTHS)
    bos_shift = bool(model.cfg.bos_shift)
    packed_pairs = pair_losses(model, ids, documents).detach()
    total_alone, pairs_alone = 0.0, 0
    for b, start, end in spans(LENGTHS):
        doc = ids[b : b + 1, start:end]
        pairs = end - start if bos_shift else end - start - 1  # the pairs the document has alone
        if pairs == 0:
            continue
        own = pair_losses(alone, doc, None).detach()[0]  # (pairs,)
        close(packed_pairs[b, start : start + pairs], own)  # pair i: token i + 1 (bos_shift: i)
        total_alone = total_alone + alone.loss(doc) * pairs
        pairs_alone += pairs
    assert pairs_alone == (24 * 2 if bos_shift else 24 * 2 - 7)  # 7 documents: one pair fewer each
    loss = model.loss(ids, None, documents)
    close(loss.detach(), (total_alone / pairs_alone).detach())
    (loss * pairs_alone).backward()
    total_alone.backward()
    # relative to the largest gradient of the model: some are zero by symmetry (a key bias's,
    # softmax being invariant to a constant per query), and their float noise is all they hold
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    close(got, torch.cat([q.grad.flatten() for q in alone.parameters()]))


def test_activation_checkpointing_takes_documents():
    model = make_model("llama_tiny-rotary-gqa")
    checkpointed = copy.deepcopy(model)
    apply_activation_checkpointing(checkpointed)
    ids, documents = packed_batch(LENGTHS)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1))
    want, got = model.loss(ids, weights, documents), checkpointed.loss(ids, weights, documents)
    close(got.detach(), want.detach(), 1e-6)
    want.backward()
    got.backward()
    grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (model, checkpointed)]
    close(grads[1], grads[0], 1e-6)


def test_weights_count_only_the_pairs_inside_a_document():
    cfg = make_model("gpt2-learned").cfg
    ids, documents = packed_batch([[3, 1, 4]])
    weights = torch.full(ids.shape, 0.5)
    _, _, w = next_token_pairs(cfg, ids, weights, documents)
    assert w.tolist() == [[0.5, 0.5, 0.0, 0.0, 0.5, 0.5, 0.5]]  # pairs 2->3 and 3->4 cross documents
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]


# ----------------------------------------------------------------------------- the attention dispatch


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_with_documents_is_the_reference(kernels, causal):
    g = torch.Generator().manual_seed(0)
    b, h, h_kv, t, d = 2, 4, 2, 17, 8
    q, k, v = (torch.randn(b, heads, t, d, generator=g) for heads in (h, h_kv, h_kv))
    documents = torch.tensor([[0] * 1 + [1] * 6 + [2] * 1 + [3] * 9, [5] * 17])
    got = ops.attention(q, k, v, causal=causal, scale=0.3, kernels=kernels, documents=documents)
    want = document_attention_reference(q, repeat_kv(k, 2), repeat_kv(v, 2), documents, causal, 0.3)
    close(got, want, 1e-6)
    # one document per row is plain attention; documents of one token see only themselves
    whole = torch.zeros(b, t, dtype=torch.long)
    close(document_attention_reference(q, q, v.repeat(1, 2, 1, 1), whole, causal, 0.3),
          attention_reference(q, q, v.repeat(1, 2, 1, 1), causal, 0.3), 1e-6)  # fmt: skip
    single = document_attention_reference(q, q, q, torch.arange(t).expand(b, t), causal, 0.3)
    close(single, q, 1e-6)


def test_bad_documents_are_one_error():
    model = make_model("gpt2-learned").eval()
    ids, documents = packed_batch([[3, 5]])
    with pytest.raises(ValueError, match="non-decreasing"):
        model(ids, documents=documents.flip(1))
    with pytest.raises(ValueError, match="shape"):
        model(ids, documents=documents[:, :-1])
    with pytest.raises(ValueError, match="integer"):
        model(ids, documents=documents.float())
    cache = KVCache.empty(model.cfg, 1, 8, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="no cache"):
        model(ids, cache, documents=documents)


@torch.no_grad()
def test_without_documents_nothing_changes():
    model = make_model("llama_tiny-rotary-gqa").eval()
    ids, _ = packed_batch([[24]])
    one_document = torch.zeros_like(ids)
    torch.testing.assert_close(model(ids, documents=one_document), model(ids), atol=1e-6, rtol=0)
    torch.testing.assert_close(model.loss(ids, None, one_document), model.loss(ids), atol=1e-6, rtol=0)


def test_the_packed_loss_compiles_whole():
    """torch.compile (trainer.compile) traces the loss with documents in one graph: no check that
    reads a tensor back (aot_eager: dynamo and AOTAutograd, what inductor is handed)."""
    model = make_model("llama_tiny-rotary-gqa")
    ids, documents = packed_batch(LENGTHS)
    torch._dynamo.reset()
    compiled = torch.compile(model.loss, backend="aot_eager", fullgraph=True)
    close(compiled(ids, None, documents).detach(), model.loss(ids, None, documents).detach(), 1e-6)
