"""torch.compile: the Triton kernels' custom ops pass torch.library.opcheck, every preset's
forward and loss trace into one graph with no graph break, compiled equals eager, and a compiled
module does not recompile for another batch of the same shape. Generation: the prompt forward and
the decode step through a StaticKVCache trace with no graph break, and compiled generation gives
eager's tokens with a bounded number of graphs, none per token.

Tolerances: the "aot_eager" backend runs the captured graph's aten ops as eager does, so logits
and gradients agree to 1e-6; inductor (tiny, fp32) fuses and reorders reductions: 1e-5 absolute,
1e-4 relative. Inductor on a CPU builds C++ (tens of seconds per graph), so it compiles one model;
every preset goes through dynamo and AOTAutograd, which is what inductor is handed.
"""

from __future__ import annotations

import pytest
import torch

from kernels.flash_attention import flash_attention_fwd
from kernels.gated import gated_fwd
from kernels.layer_norm import add_layer_norm_fwd, add_rms_norm_fwd, layer_norm_fwd, rms_norm_fwd
from kernels.linear_cross_entropy import linear_cross_entropy_fwd
from kernels.rotary import rotary_fwd
from lmsys.core.config import compile_choice, compose, compose_model
from lmsys.core.errors import ConfigError
from lmsys.inference.generation import generate
from lmsys.model.compiling import compile_stats
from lmsys.model.kv_cache import StaticKVCache
from lmsys.model.transformer import Transformer
from tests.conftest import DEVICE

SMALL = ["vocab_size=37", "d_model=32", "n_heads=2", "n_layers=2", "max_seq_len=24", "ffn.d_ff=48"]
PRESETS = ["seed_gpt", "seed_trax", "seed_postln", "seed_compact", "gpt2_124m", "tiny"]


def small_model(preset: str, extra: list[str] | None = None) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(compose_model(preset, SMALL + (extra or []))).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from the initialisation, so that no gradient is trivially 0
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen).to(DEVICE))
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, 37, (2, 17), generator=gen).to(DEVICE), torch.rand(2, 17, generator=gen).to(
        DEVICE
    )


def test_custom_ops_pass_opcheck() -> None:
    """Schema, fake implementation, autograd registration and AOT dispatch of every op, on CPU
    tensors through the Triton interpreter (tests/conftest.py)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE).requires_grad_()

    q, k, v = rand(1, 2, 16, 16), rand(1, 2, 16, 16), rand(1, 2, 16, 8)
    for causal in (True, False):
        torch.library.opcheck(flash_attention_fwd, (q, k, v, causal, 0.25))
    x, residual, weight, bias = rand(3, 5, 32), rand(3, 5, 32), rand(32), rand(32)
    for formula in ("sqrt_var_eps", "std_plus_eps", "exact"):
        torch.library.opcheck(layer_norm_fwd, (x, weight, bias, 1e-5, formula))
    torch.library.opcheck(layer_norm_fwd, (x, None, None, 1e-5, "sqrt_var_eps"))
    torch.library.opcheck(add_layer_norm_fwd, (x, residual, weight, bias, 1e-5, "sqrt_var_eps"))
    h, unembed, bias_v = rand(13, 16), rand(23, 16), rand(23)
    targets = torch.randint(0, 23, (13,), generator=gen).to(DEVICE)
    loss_weights = torch.rand(13, generator=gen).to(DEVICE)
    for chunk, needs in ((0, (True, True, True)), (5, (True, True, False)), (0, (False, False, False))):
        args = (h, unembed, targets, loss_weights, bias_v, chunk, *needs)
        torch.library.opcheck(linear_cross_entropy_fwd, args)
    unweighted = (h, unembed, targets, None, None, 0, True, True, False)
    torch.library.opcheck(linear_cross_entropy_fwd, unweighted)


def test_the_llama_family_ops_pass_opcheck() -> None:
    """RMS norm, add + RMS norm, rotary, the gated activation, and flash attention with grouped
    key/value heads and with packed documents."""
    gen = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE).requires_grad_()

    x, residual, weight = rand(3, 5, 32), rand(3, 5, 32), rand(32)
    torch.library.opcheck(rms_norm_fwd, (x, weight, 1e-6))
    torch.library.opcheck(rms_norm_fwd, (x, None, 1e-6))
    torch.library.opcheck(add_rms_norm_fwd, (x, residual, weight, 1e-6))
    q, k = rand(2, 5, 4, 16).transpose(1, 2), rand(2, 2, 5, 16)  # (B, H, T, d), (B, Hkv, T, d)
    angles = torch.rand(5, 8, generator=gen).repeat(1, 2).to(DEVICE)  # (T, d)
    torch.library.opcheck(rotary_fwd, (q, k, angles.cos(), angles.sin()))
    for activation in ("silu", "gelu", "gelu_tanh"):
        torch.library.opcheck(gated_fwd, (rand(3, 7), rand(3, 7), activation))
    q, k, v = rand(1, 4, 16, 16), rand(1, 2, 16, 16), rand(1, 2, 16, 8)
    torch.library.opcheck(flash_attention_fwd, (q, k, v, True, 0.25))
    documents = torch.tensor([[0] * 5 + [1] + [4] * 10]).to(DEVICE)  # (B, T) packed documents
    for causal in (True, False):
        torch.library.opcheck(flash_attention_fwd, (q, k, v, causal, 0.25, documents))


def _explain(fn, *args):
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args)


@pytest.mark.parametrize("preset", PRESETS)
def test_forward_and_loss_have_no_graph_break(preset: str) -> None:
    model = small_model(preset, ["kernels=torch"])
    tokens, weights = batch()
    for what, out in (("forward", _explain(model, tokens)), ("loss", _explain(model.loss, tokens, weights))):
        assert out.graph_break_count == 0 and out.graph_count == 1, (preset, what, out.break_reasons)


def test_the_triton_kernels_trace_without_a_graph_break() -> None:
    """model.kernels=triton, model.loss_impl=fused: attention, the norms and the loss are the
    custom ops, not Python launches."""
    model = small_model("gpt2_124m", ["kernels=triton", "loss_impl=fused"])
    tokens, weights = batch()
    out = _explain(model.loss, tokens, weights)
    assert out.graph_break_count == 0 and out.graph_count == 1, out.break_reasons
    ops = {str(node.target) for graph in out.graphs for node in graph.graph.nodes}
    for op in ("flash_attention_fwd", "layer_norm_fwd", "linear_cross_entropy_fwd"):
        assert any(op in target for target in ops), (op, ops)


def test_the_llama_family_kernels_trace_without_a_graph_break() -> None:
    """model.kernels=triton on a Llama-family model with QK-norm and grouped-query attention: RMS
    norm, add + RMS norm, rotary, the gated activation and attention are the custom ops, with
    packed documents too (the attention op takes them)."""
    extra = ["kernels=triton", "attention.d_qk=16", "attention.d_vo=16", "attention.n_kv_heads=1"]
    model = small_model("qwen3_0_6b", extra)
    tokens, weights = batch()
    documents = torch.tensor([[0] * 4 + [1] * 13, [2] * 9 + [3] + [5] * 7]).to(DEVICE)  # (B, S)
    for args in ((tokens, weights), (tokens, weights, documents)):
        out = _explain(model.loss, *args)
        assert out.graph_break_count == 0 and out.graph_count == 1, out.break_reasons
        ops = {str(node.target) for graph in out.graphs for node in graph.graph.nodes}
        for op in ("flash_attention_fwd", "rms_norm_fwd", "add_rms_norm_fwd", "rotary_fwd", "gated_fwd"):
            assert any(op in target for target in ops), (op, ops)


def _loss_and_grads(model, loss_fn, tokens, weights):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(tokens, weights)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_agree(got, want, atol: float, rtol: float) -> None:
    torch.testing.assert_close(got[0], want[0], atol=atol, rtol=rtol)
    for name, grad in want[1].items():
        torch.testing.assert_close(
            got[1][name], grad, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("preset", PRESETS)
def test_compiled_equals_eager(preset: str) -> None:
    model = small_model(preset, ["kernels=torch"])
    tokens, weights = batch()
    want = _loss_and_grads(model, model.loss, tokens, weights)
    torch._dynamo.reset()
    compiled = torch.compile(model.loss, backend="aot_eager", fullgraph=True)
    _assert_agree(_loss_and_grads(model, compiled, tokens, weights), want, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(
            torch.compile(model, backend="aot_eager", fullgraph=True)(tokens),
            model(tokens),
            atol=1e-6,
            rtol=1e-6,
        )


@pytest.mark.slow
def test_inductor_equals_eager() -> None:
    """What trainer.compile=true does: the engine's LossModule compiled in place with inductor
    (the state-dict keys do not change)."""
    from lmsys.engine.zero import LossModule  # the engine room (DeepSpeed is imported only to initialize)

    module = LossModule(small_model("tiny", ["kernels=torch"]))
    tokens, weights = batch()
    want = _loss_and_grads(module, module, tokens, weights)
    keys = list(module.state_dict())
    torch._dynamo.reset()
    before = compile_stats().graphs  # dynamo's counters are process-wide
    module.compile()
    _assert_agree(_loss_and_grads(module, module, tokens, weights), want, atol=1e-5, rtol=1e-4)
    assert list(module.state_dict()) == keys
    graphs = compile_stats().graphs
    _loss_and_grads(module, module, *batch())  # the same shapes again: no recompilation
    assert compile_stats().graphs == graphs == before + 1


def test_trainer_compile_takes_auto_true_false_only() -> None:
    assert compile_choice(compose(["trainer.compile=true"]).trainer.compile) == "true"
    assert compile_choice(compose([]).trainer.compile) == "auto"
    with pytest.raises(
        ConfigError, match=r"trainer.compile=maybe is not valid; choose one of: auto, true, false"
    ):
        compose(["trainer.compile=maybe"])


def _left_padded(widths: list[int], seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 37, (len(widths), max(widths)), generator=gen)
    mask = torch.arange(max(widths))[None, :] >= torch.tensor([max(widths) - w for w in widths])[:, None]
    return ids.to(DEVICE), mask.to(DEVICE)  # (B, T) each


CAUSAL_PRESETS = ["seed_gpt", "seed_trax", "seed_postln", "seed_compact", "gpt2_124m"]  # all a cache takes


@pytest.mark.parametrize("preset", CAUSAL_PRESETS)
@torch.inference_mode()
def test_generation_steps_have_no_graph_break(preset: str) -> None:
    """What lmsys-generate compiles: a padded batch of prompts, then one decode step, through a
    StaticKVCache; each step is one graph. kernels=triton: the norms are the custom ops."""
    model = small_model(preset, ["kernels=triton"]).eval()
    ids, mask = _left_padded([3, 9, 6])
    cache = StaticKVCache.empty(model.cfg, 3, 16, ids.device, torch.float32)
    prompt = _explain(model, ids, cache, mask)
    step = _explain(model, ids[:, :1], cache)
    for what, out in (("prompt", prompt), ("decode step", step)):
        assert out.graph_break_count == 0 and out.graph_count == 1, (preset, what, out.break_reasons)


def test_compiled_generation_gives_eager_tokens_with_no_graph_per_token() -> None:
    """Greedy and sampled generation with eos in play, compiled (aot_eager: dynamo and
    AOTAutograd, what inductor is handed) against eager. Graphs: a prompt graph and a decode
    graph for the first batch size, then any other size (dynamo makes it dynamic), then a batch
    of one: at most 6, whatever the lengths, and more tokens add none."""
    model = small_model("tiny", ["kernels=torch"]).eval()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 37, (n,), generator=gen).tolist() for n in (3, 11, 6, 1, 8, 15, 2)]
    eos = generate(model, prompts[:1], 4, greedy=True)[0][-1]  # a token greedy decoding reaches
    runs = [  # (generate's options, batch sizes it makes of the 7 prompts)
        ({"greedy": True, "eos_id": eos, "batch_size": 3}, "3, 3, 1"),
        ({"temperature": 0.9, "top_k": 20, "seed": 3, "eos_id": eos, "batch_size": 4}, "4, 3"),
    ]
    eager = [generate(model, prompts, 12, **options) for options, _ in runs]
    assert any(len(tokens) < 12 for tokens in eager[0]), "eos should end some row early"
    torch._dynamo.reset()
    model.compile(backend="aot_eager")
    start = compile_stats()
    for (options, _), want in zip(runs, eager):
        assert generate(model, prompts, 12, **options, static_cache=True) == want
    graphs = compile_stats(start).graphs
    assert 2 < graphs <= 6, graphs
    short = [prompts[3], prompts[0], prompts[6]]  # 1, 3 and 2 tokens: room for 20 new ones each
    longer = generate(model, short, 20, greedy=True, batch_size=2, static_cache=True)
    assert [len(tokens) for tokens in longer] == [20] * 3  # other lengths, more tokens: no new graph
    assert compile_stats(start).graphs == graphs
    assert compile_stats(start).graph_breaks == 0
