"""The model with model.kernels=triton equals model.kernels=torch, forward and every gradient.

On CPU the Triton kernels run through the interpreter (tests/conftest.py), so this checks the
wiring in lmsys/model/ops.py and the kernels' agreement with the torch path inside a whole model.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

from lmsys.core.config import compose_model
from lmsys.model.transformer import Transformer
from tests.conftest import DEVICE

REPO_ROOT = Path(__file__).resolve().parents[3]
KERNEL_MODULES = {  # lmsys.model.ops calls the kernels' public functions, each through its custom op
    "flash_attention": "kernels.flash_attention",
    "layer_norm": "kernels.layer_norm",
    "add_layer_norm": "kernels.layer_norm",
    "linear_cross_entropy": "kernels.linear_cross_entropy",
}

SMALL = ["vocab_size=37", "d_model=32", "n_heads=2", "n_layers=2", "max_seq_len=24", "ffn.d_ff=48"]
PRESETS = {
    "seed_gpt": [],
    "seed_gpt_parallel": ["block=parallel"],
    "seed_trax": [],
    "seed_postln": [],
    "seed_compact": ["attention.d_qk=16", "attention.d_vo=24"],
    "seed_compact_bidirectional": ["attention.d_qk=16", "attention.d_vo=24", "attention.causal=false"],
    "gpt2_124m": [],
    "tiny": [],
}


def _pair(preset: str, extra: list[str]) -> tuple[Transformer, Transformer]:
    name = preset.removesuffix("_parallel").removesuffix("_bidirectional")
    models = []
    for choice in ("torch", "triton"):
        torch.manual_seed(0)
        cfg = compose_model(name, SMALL + extra + [f"kernels={choice}"])
        models.append(Transformer(cfg).to(DEVICE))
    # At init (std 0.02) attention is almost uniform, which hides a wrong scale (checked: seed_gpt's
    # scale 1 vs 1/sqrt(d) changed nothing). Perturb every parameter, biases and gains included,
    # identically in both models, so a wrong scale or mask moves logits and gradients by >= 3e-3.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in models[0].parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen).to(DEVICE))
    models[1].load_state_dict(models[0].state_dict())
    return models[0], models[1]


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch, modules: dict[str, str] = KERNEL_MODULES) -> Counter:
    """Wrap the kernels' entry points in their modules (lmsys.model.ops imports them from there at call
    time)."""
    calls: Counter = Counter()
    for name, module_name in modules.items():
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("preset", list(PRESETS))
def test_triton_model_equals_torch_model(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, fused = _pair(preset, PRESETS[preset])
    tokens = torch.randint(0, 37, (2, 19), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    weights = torch.rand(2, 19, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    calls = _count_kernel_calls(monkeypatch)
    loss_ref = reference.loss(tokens, weights)
    assert not calls, f"kernels=torch ran Triton kernels: {dict(calls)}"
    loss_fused = fused.loss(tokens, weights)
    # Every layer's attention, every norm where the preset has one, and the loss (model.loss_impl
    # auto: fused where model.kernels runs Triton) went through Triton.
    assert calls["flash_attention"] == fused.cfg.n_layers, dict(calls)
    assert calls["linear_cross_entropy"] == 1, dict(calls)
    if fused.cfg.norm.formula != "none":
        assert calls["layer_norm"] + calls["add_layer_norm"] > 0, dict(calls)
    loss_ref.backward()
    loss_fused.backward()
    torch.testing.assert_close(fused(tokens[:, :-1]), reference(tokens[:, :-1]), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(loss_fused, loss_ref, atol=2e-6, rtol=1e-5)
    _assert_same_gradients(fused, reference)


def _assert_same_gradients(fused: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Every parameter's gradient as the torch model's, to fp32 rounding relative to the tensor's
    largest entry (k biases get exactly-zero gradients in exact arithmetic: softmax ignores a
    per-row shift, hence the floor). Observed <= 5e-7."""
    grads_ref = dict(reference.named_parameters())
    for name, p in fused.named_parameters():
        expected = grads_ref[name].grad
        atol = 1e-5 * max(expected.abs().max().item(), 1e-2)
        torch.testing.assert_close(p.grad, expected, atol=atol, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


LLAMA_KERNELS = {  # the Llama family's entry points: (name in its module, module)
    "flash_attention": "kernels.flash_attention",
    "rms_norm": "kernels.layer_norm",
    "add_rms_norm": "kernels.layer_norm",
    "rotary": "kernels.rotary",
    "gated": "kernels.gated",
}


def test_llama_family_triton_model_equals_torch_model(monkeypatch) -> None:
    """Qwen3's function (the Llama family with QK-norm), multi-query: RMS norm (blocks, final and
    QK-norm), the fused add + RMS norm, rotary, SwiGLU and grouped-query attention all run their
    kernels under kernels=triton, and the model computes what kernels=torch does."""
    extra = ["attention.d_qk=16", "attention.d_vo=16", "attention.n_kv_heads=1", "loss_impl=chunked"]
    reference, fused = _pair("qwen3_0_6b", extra)
    tokens = torch.randint(0, 37, (2, 19), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    calls = _count_kernel_calls(monkeypatch, LLAMA_KERNELS)
    loss_ref = reference.loss(tokens)
    assert not calls, dict(calls)
    loss_fused = fused.loss(tokens)
    layers = fused.cfg.n_layers
    qk_norms = 2 * layers if fused.cfg.attention.qk_norm else 0
    assert calls == {
        "flash_attention": layers, "rotary": layers, "gated": layers,
        "rms_norm": layers + 1 + qk_norms, "add_rms_norm": layers,  # norm1 each block, the final norm
    }, dict(calls)  # fmt: skip
    loss_ref.backward()
    loss_fused.backward()
    torch.testing.assert_close(loss_fused, loss_ref, atol=2e-6, rtol=1e-5)
    _assert_same_gradients(fused, reference)


def test_auto_uses_torch_on_cpu_and_triton_on_cuda() -> None:
    from lmsys.model import ops

    cpu = torch.zeros(1)
    assert not ops.use_triton(cpu, "auto")
    assert ops.use_triton(cpu, "triton")
    assert not ops.use_triton(cpu, "torch")
    if torch.cuda.is_available():
        assert ops.use_triton(cpu.cuda(), "auto")


# ----------------------------------------------------------------------------- prepare_kernels
# A fresh process without TRITON_INTERPRET (this session's conftest set it for itself), as a
# user's `lmsys-generate` starts.


def _fresh_python(*pieces: str) -> subprocess.CompletedProcess:
    """Run the code pieces (each dedented on its own) in a fresh interpreter."""
    code = "\n".join(textwrap.dedent(piece) for piece in pieces)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


_TRITON_VS_TORCH = """
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 40, generator=g), torch.randn(40, generator=g), torch.randn(40, generator=g)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(3))
    for name, run in [
        ("layer_norm", lambda choice: ops.layer_norm(x, w, b, eps=1e-5, formula="exact", kernels=choice)),
        ("attention", lambda choice: ops.attention(q, k, v, causal=True, scale=0.3, kernels=choice)),
    ]:
        try:
            got = run("triton")
        except Exception as exc:
            print(f"{name}: triton failed: {type(exc).__name__}: {exc}")
            continue
        torch.testing.assert_close(got, run("torch"), atol=1e-5, rtol=1e-5)
        print(f"{name}: triton ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter is selected only without CUDA")
def test_prepare_kernels_selects_the_interpreter_before_triton_is_imported():
    proc = _fresh_python(
        """
        import os, sys
        import torch
        from kernels import runtime
        from lmsys.model import ops
        assert "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ
        ops.prepare_kernels("triton", torch.device("cpu"))
        assert os.environ["TRITON_INTERPRET"] == "1"
        """,
        _TRITON_VS_TORCH,
        """
        assert runtime.triton_mode() == "interpreter"
        ops.prepare_kernels("triton", torch.device("cpu"))  # again: no second warning
        """,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "layer_norm: triton ok" in proc.stdout and "attention: triton ok" in proc.stdout, proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "CPU interpreter" in warnings[0], proc.stderr
    assert "minutes per training step" in warnings[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter is selected only without CUDA")
def test_prepare_kernels_after_a_compiled_triton_import_is_one_clear_error():
    """Something imported triton for compiled kernels first (torch._dynamo does, e.g. inside
    deepspeed.initialize): too late to switch, so one ConfigError says what to do. Without the
    call the kernels really fail (the control below), and the other settings need nothing."""
    proc = _fresh_python(
        """
        import os, sys
        import torch
        import triton  # compiled mode: TRITON_INTERPRET is unset
        from kernels import runtime
        from lmsys.model import ops
        from lmsys.core.errors import ConfigError
        assert runtime.triton_mode() == "compiled"
        for kernels, device in [("auto", "cpu"), ("torch", "cpu"), ("triton", "cuda")]:
            ops.prepare_kernels(kernels, device)  # nothing to do, nothing raised
        assert "TRITON_INTERPRET" not in os.environ
        try:
            ops.prepare_kernels("triton", "cpu")
        except ConfigError as exc:
            print(f"ConfigError: {exc}")
        """,
        _TRITON_VS_TORCH,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ConfigError: ")]
    assert len(errors) == 1, proc.stdout
    assert "model.kernels=triton" in errors[0] and "TRITON_INTERPRET=1" in errors[0], errors[0]
    assert "model.kernels=auto" in errors[0], errors[0]
    for name in ("layer_norm", "attention"):
        assert f"{name}: triton failed" in proc.stdout, proc.stdout


def test_prepare_kernels_warns_of_the_interpreter_on_cuda(monkeypatch, capsys):
    from lmsys.model import ops

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops.prepare_kernels("torch", "cuda")
    assert capsys.readouterr().err == ""
    for choice in ("auto", "triton"):
        ops.prepare_kernels(choice, "cuda")
        assert "warning: TRITON_INTERPRET is set" in capsys.readouterr().err
    monkeypatch.delenv("TRITON_INTERPRET")
    ops.prepare_kernels("triton", "cuda")
    assert capsys.readouterr().err == ""


def test_prepare_kernels_in_this_session():
    """Here triton was imported as conftest chose: interpreter on CPU, compiled with CUDA."""
    from kernels import runtime
    from lmsys.core.errors import ConfigError
    from lmsys.model import ops

    for choice in ("auto", "torch"):
        ops.prepare_kernels(choice, "cpu")
    ops.prepare_kernels("triton", "cuda")
    if DEVICE == "cpu":
        assert runtime.triton_mode() == "interpreter"
        ops.prepare_kernels("triton", "cpu")
        ops.prepare_kernels("triton", "cpu", torch.float16)
        with pytest.raises(ConfigError, match="cannot compute bf16 attention"):
            ops.prepare_kernels("triton", "cpu", torch.bfloat16)
    else:
        assert runtime.triton_mode() == "compiled"
        with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
            ops.prepare_kernels("triton", "cpu")


# ----------------------------------------------------------------------------- model.loss_impl=fused
# On a CPU the fused loss runs in the Triton interpreter: chosen by itself when triton is not
# imported yet, one clear error when it was imported for compiled kernels first.

_FUSED_LOSS = """
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(9, 16, generator=g), torch.randn(23, 16, generator=g)
    t = torch.randint(0, 23, (9,), generator=g)
    try:
        got = ops.linear_cross_entropy(h, w, t, None, None, loss_impl="fused")
    except ConfigError as exc:
        print(f"ConfigError: {exc}")
    else:
        want = ops.linear_cross_entropy(h, w, t, None, None, loss_impl="chunked")
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        print("fused: ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter is selected only without CUDA")
def test_fused_loss_on_cpu_selects_the_interpreter_before_triton_is_imported():
    proc = _fresh_python(
        """
        import os, sys
        import torch
        from kernels import runtime
        from lmsys.model import ops
        from lmsys.core.errors import ConfigError
        assert "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ
        """,
        _FUSED_LOSS,
        _FUSED_LOSS,  # again: no second warning
        """
        assert os.environ["TRITON_INTERPRET"] == "1" and runtime.triton_mode() == "interpreter"
        """,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("fused: ok") == 2, proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "model.loss_impl=fused on cpu" in warnings[0], proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter is selected only without CUDA")
def test_fused_loss_on_cpu_after_a_compiled_triton_import_is_one_clear_error():
    proc = _fresh_python(
        """
        import torch
        import triton  # compiled mode, as DeepSpeed's start-up imports it
        from lmsys.model import ops
        from lmsys.core.errors import ConfigError
        """,
        _FUSED_LOSS,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ConfigError: ")]
    assert len(errors) == 1, proc.stdout
    for hint in (
        "model.loss_impl=fused on cpu",
        "model.kernels=triton",
        "TRITON_INTERPRET=1",
        "loss_impl=chunked",
    ):
        assert hint in errors[0], errors[0]
