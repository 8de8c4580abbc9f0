"""Model weights as named tensors: the names and shapes a config implies, and a `Transformer`
built from a state dict (an export's tensors, a checkpoint's consolidated weights, HF weights).

Names are `Transformer.state_dict()`'s. A tied model's unembedding is the embedding itself:
stored once, as `tok_emb.weight`, and re-tied when a model is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lmsys.core.config import ModelConfig
from lmsys.core.errors import ExportError
from lmsys.model.transformer import Transformer

TIED_KEY = "unembed.weight"  # the alias of tok_emb.weight when model.tied_embeddings
EMBED_KEY = "tok_emb.weight"


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Skips the in-place initialisers while a model is built whose weights are loaded right
    after: its parameters stay uninitialised `torch.empty` memory, which the OS does not even
    commit until written. (A meta-device model would be lighter still, but computing the
    sinusoidal tables or initialising on meta imports torch._dynamo: seconds of start-up for
    every lmsys-generate / lmsys-eval call.)"""

    SKIP = frozenset({"normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "constant_",
                      "trunc_normal_", "kaiming_uniform_", "xavier_uniform_"})  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.SKIP:
            return args[0] if args else next(iter((kwargs or {}).values()))
        return func(*args, **(kwargs or {}))


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors and the header metadata of a safetensors file (never unpickles)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        raise ExportError(f"{path} is not a readable safetensors file ({first})") from exc
    return tensors, metadata


def skeleton(cfg: ModelConfig) -> Transformer:
    """A Transformer of `cfg` with uninitialised parameters (shapes and fixed buffers only)."""
    with _SkipInit():
        return Transformer(cfg)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor an export stores for `cfg` (tied embedding once)."""
    model = skeleton(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tied_embeddings:
        shapes.pop(TIED_KEY, None)
    return shapes


def check_tensors(
    tensors: dict[str, Any], expected: dict[str, tuple[int, ...]], where: str, file_label: str = ""
) -> None:
    """Raise ExportError naming the first tensor whose name or shape disagrees with `expected`."""
    label = file_label or where
    for name, shape in expected.items():
        if name not in tensors:
            raise ExportError(f"{label} has no tensor {name!r} (shape {list(shape)}) that the config needs")
        got = tuple(tensors[name].shape) if hasattr(tensors[name], "shape") else tuple(tensors[name])
        if got != shape:
            raise ExportError(
                f"{label}: tensor {name!r} has shape {list(got)}, the config needs {list(shape)}"
            )
    extra = [k for k in tensors if k not in expected]
    if extra:
        raise ExportError(f"{label} has a tensor {extra[0]!r} that the config does not define")


def build_model(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """A Transformer holding exactly `state` (checked names and shapes), tied weights re-tied.
    A tied model's state may carry the alias unembed.weight (as `state_dict()` does) if it is
    the embedding itself."""
    if cfg.tied_embeddings and TIED_KEY in state and EMBED_KEY in state:
        if not torch.equal(state[TIED_KEY], state[EMBED_KEY]):
            raise ExportError(f"{TIED_KEY} differs from {EMBED_KEY} although model.tied_embeddings=true")
        state = {k: v for k, v in state.items() if k != TIED_KEY}
    check_tensors(state, expected_shapes(cfg), where="the weights")
    model = skeleton(cfg)
    # The model's tensors become copies of `state` (assign: the uninitialised ones are replaced,
    # never written); copies, so the model shares no memory with the caller's tensors.
    owned = {
        k: v.detach().to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
        for k, v in state.items()
    }
    missing, unexpected = model.load_state_dict(owned, strict=False, assign=True)
    allowed_missing = {TIED_KEY} if cfg.tied_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ExportError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    if cfg.tied_embeddings:
        model.unembed.weight = model.tok_emb.weight  # assign replaced the shared Parameter: re-tie
    model.to(device=device, dtype=dtype)  # anything not in `state` (non-persistent buffers)
    model.eval()
    return model


def model_state_dict(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map consolidated engine keys onto `Transformer` keys: strip the engine's wrapper prefix
    (e.g. `model.`), keep a tied embedding once (checking a duplicated copy is identical), and
    check every expected tensor is present with its shape. Returns fp32 (non-float kept)."""
    expected = expected_shapes(cfg)
    prefix = next((k[: -len(EMBED_KEY)] for k in raw if k.endswith(EMBED_KEY)), None)
    if prefix is None:
        raise ExportError(f"the checkpoint has no {EMBED_KEY} tensor: it is not an lmsys Transformer")
    state = {k[len(prefix) :]: v for k, v in raw.items() if k.startswith(prefix)}
    if cfg.tied_embeddings and TIED_KEY in state:
        tied = state.pop(TIED_KEY)
        if tied.shape != state[EMBED_KEY].shape or not torch.equal(tied.float(), state[EMBED_KEY].float()):
            raise ExportError(
                f"the checkpoint's {TIED_KEY} differs from {EMBED_KEY} although "
                "model.tied_embeddings=true (the shared tensor was not consolidated as one)"
            )
    check_tensors(state, expected, where="the checkpoint")
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in state.items()}
