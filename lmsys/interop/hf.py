"""GPT-2 ↔ Hugging Face conversion: lmsys weights and config ↔ a `GPT2LMHeadModel` directory.

A config is "GPT-2's function" when every option that changes the math is GPT-2's: learned
positions, pre-LN blocks, `sqrt_var_eps` norms with affine, all four attention biases, the
default scale 1/sqrt(d_head), gelu-tanh, one hidden FFN layer with biases (any d_ff), the bias
before the activation, a final norm, tied embeddings, no unembedding bias, causal row softmax,
d_qk = d_vo = D/H and no bos_shift. Width, depth, heads, vocabulary, context and eps are free
(GPT2Config has a field for each).

Weight layout. transformers' GPT-2 uses `Conv1D` layers that store (in, out) matrices, the
transpose of `nn.Linear`'s (out, in):
    transformer.wte.weight              tok_emb.weight                        (V, D)
    transformer.wpe.weight              positions.table                       (T, D)
    transformer.h.i.ln_1.{weight,bias}  blocks.i.norm1.{weight,bias}
    transformer.h.i.attn.c_attn.weight  blocks.i.attn.w_qkv.weight^T          (D, 3D) = [Q | K | V]
    transformer.h.i.attn.c_attn.bias    cat(q_bias, k_bias, v_bias)           (3D,)
    transformer.h.i.attn.c_proj.*       blocks.i.attn.w_o (weight^T, bias)
    transformer.h.i.ln_2.*              blocks.i.norm2.*
    transformer.h.i.mlp.c_fc.*          blocks.i.ffn.hidden.0 (weight^T, bias)
    transformer.h.i.mlp.c_proj.*        blocks.i.ffn.out (weight^T, bias)
    transformer.ln_f.*                  final_norm.*
    lm_head.weight                      tied to wte: not stored (transformers re-ties it)
Both fuse Q, K, V in that order with head h in columns [h*d, (h+1)*d) of each third, so the
fused matrix maps over with a transpose only.

Reading a transformers checkpoint directory (`read_hf_weights`; lmsys.interop.export_dir reads its
config.json and dispatches on model_type, the Llama family to lmsys/interop/hf_llama.py): the
weights as `model.safetensors` or `pytorch_model.bin`, either one file or shards listed by their
`.index.json`; safetensors is preferred, and a .bin is read with
`torch.load(weights_only=True)`, which rebuilds tensors and refuses anything else in the pickle.
Older files name the tensors without `transformer.` and carry causal-mask buffers (dropped).
"""

from __future__ import annotations

import json
import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from lmsys.core.config import ModelConfig, model_config_from_dict, model_dims
from lmsys.core.errors import ConfigError, ExportError
from lmsys.model.weights import check_tensors, read_safetensors

GENERATION_CONFIG_FILE = "generation_config.json"
# transformers' weight files, in the order they are looked for: (single file, index of shards)
HF_WEIGHT_FILES = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)
# transformers' names of the tanh approximation of GELU (the same function) and others lmsys has.
HF_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
}


# ----------------------------------------------------------------------------- GPT-2's function


def gpt2_difference(cfg: ModelConfig) -> str | None:
    """The first option of `cfg` that differs from GPT-2's function, as `key=value (GPT-2: x)`."""
    dims = model_dims(cfg)
    head = cfg.d_model // cfg.n_heads if cfg.d_model % cfg.n_heads == 0 else None
    checks: list[tuple[str, Any, Any]] = [
        ("positions.kind", cfg.positions.kind, "learned"),
        ("block", cfg.block, "pre"),
        ("norm.formula", cfg.norm.formula, "sqrt_var_eps"),
        ("norm.affine", cfg.norm.affine, True),
        ("attention.causal", cfg.attention.causal, True),
        ("attention.softmax", cfg.attention.softmax, "row"),
        ("attention.q_bias", cfg.attention.q_bias, True),
        ("attention.k_bias", cfg.attention.k_bias, True),
        ("attention.v_bias", cfg.attention.v_bias, True),
        ("attention.o_bias", cfg.attention.o_bias, True),
        ("attention.d_qk", dims.d_qk, head),
        ("attention.d_vo", dims.d_vo, head),
        ("ffn.activation", cfg.ffn.activation, "gelu_tanh"),
        ("ffn.n_hidden_layers", cfg.ffn.n_hidden_layers, 1),
        ("ffn.bias", cfg.ffn.bias, True),
        ("ffn.bias_after_activation", cfg.ffn.bias_after_activation, False),
        ("final_norm", cfg.final_norm, True),
        ("tied_embeddings", cfg.tied_embeddings, True),
        ("unembed_bias", cfg.unembed_bias, False),
        ("bos_shift", cfg.bos_shift, False),
    ]
    for key, value, want in checks:
        if value != want:
            shown_want = "d_model/n_heads" if key.startswith("attention.d_") else _show(want)
            return f"model.{key}={_show(value)} differs (GPT-2: {shown_want})"
    if head is not None and not math.isclose(dims.attention_scale, 1.0 / math.sqrt(head), rel_tol=1e-12):
        return f"model.attention.scale={cfg.attention.scale} differs (GPT-2: 1/sqrt(d_head), i.e. unset)"
    return None


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def require_gpt2(cfg: ModelConfig) -> None:
    """Raise ExportError naming the first option that format=hf cannot express."""
    diff = gpt2_difference(cfg)
    if diff is not None:
        raise ExportError(f"format=hf needs GPT-2's function; {diff}")


# ----------------------------------------------------------------------------- lmsys → HF


def hf_config(
    cfg: ModelConfig, tokenizer: Any | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The GPT2Config (as config.json) of a GPT-2-shaped lmsys config."""
    require_gpt2(cfg)
    dims = model_dims(cfg)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": dims.d_ff,
        "activation_function": "gelu_new",  # GPT-2's name for the tanh approximation
        "layer_norm_epsilon": cfg.norm.eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),  # the stored weights' dtype
        **special_ids(tokenizer),
    }


def special_ids(tokenizer: Any | None) -> dict[str, int | None]:
    """config.json's (and generation_config.json's) bos/eos/pad ids of the export's tokenizer."""
    if tokenizer is None:
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    return {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
    }


def generation_config(tokenizer: Any) -> dict[str, Any]:
    return special_ids(tokenizer)


def to_hf(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer: Any | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json dict, safetensors tensors) of a GPT-2-shaped lmsys model's weights."""
    config = hf_config(cfg, tokenizer, dtype)
    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": state["tok_emb.weight"],
        "transformer.wpe.weight": state["positions.table"],
        "transformer.ln_f.weight": state["final_norm.weight"],
        "transformer.ln_f.bias": state["final_norm.bias"],
    }
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        out[h + "ln_1.weight"] = state[b + "norm1.weight"]
        out[h + "ln_1.bias"] = state[b + "norm1.bias"]
        out[h + "attn.c_attn.weight"] = state[b + "attn.w_qkv.weight"].t()
        out[h + "attn.c_attn.bias"] = torch.cat(
            [state[b + "attn.q_bias"], state[b + "attn.k_bias"], state[b + "attn.v_bias"]]
        )
        out[h + "attn.c_proj.weight"] = state[b + "attn.w_o.weight"].t()
        out[h + "attn.c_proj.bias"] = state[b + "attn.w_o.bias"]
        out[h + "ln_2.weight"] = state[b + "norm2.weight"]
        out[h + "ln_2.bias"] = state[b + "norm2.bias"]
        out[h + "mlp.c_fc.weight"] = state[b + "ffn.hidden.0.weight"].t()
        out[h + "mlp.c_fc.bias"] = state[b + "ffn.hidden.0.bias"]
        out[h + "mlp.c_proj.weight"] = state[b + "ffn.out.weight"].t()
        out[h + "mlp.c_proj.bias"] = state[b + "ffn.out.bias"]
    return config, {k: v.contiguous() for k, v in out.items()}


# ----------------------------------------------------------------------------- HF → lmsys


def model_config_from_hf(config: dict[str, Any], lmsys_config_json: str | None = None) -> ModelConfig:
    """The lmsys ModelConfig of a GPT2Config dict. When the export recorded its lmsys config (our
    own format=hf exports), that is used after checking it agrees with config.json."""
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise ExportError("config.json: scale_attn_by_inverse_layer_idx=true has no lmsys equivalent")
    activation = config.get("activation_function", "gelu_new")
    if activation not in HF_ACTIVATIONS:
        raise ExportError(f"config.json: activation_function={activation!r} has no lmsys equivalent")
    try:
        n_embd, n_head = int(config["n_embd"]), int(config["n_head"])
        data: dict[str, Any] = {
            "name": str(config.get("_name_or_path") or "gpt2-hf").split("/")[-1] or "gpt2-hf",
            "vocab_size": int(config["vocab_size"]),
            "d_model": n_embd,
            "n_layers": int(config["n_layer"]),
            "n_heads": n_head,
            "max_seq_len": int(config.get("n_positions", 1024)),
            "positions": {"kind": "learned"},
            "attention": {
                "causal": True,
                "scale": None if config.get("scale_attn_weights", True) else 1.0,
                "q_bias": True,
                "k_bias": True,
                "v_bias": True,
                "o_bias": True,
            },
            "ffn": {
                "activation": HF_ACTIVATIONS[activation],
                "d_ff": int(config.get("n_inner") or 4 * n_embd),
            },
            "norm": {
                "formula": "sqrt_var_eps",
                "eps": float(config.get("layer_norm_epsilon", 1e-5)),
                "affine": True,
            },
            "block": "pre",
            "final_norm": True,
            "tied_embeddings": bool(config.get("tie_word_embeddings", True)),
            "unembed_bias": False,
            "init_std": float(config.get("initializer_range", 0.02)),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"config.json is not a GPT2Config ({type(exc).__name__}: {exc})") from exc
    derived, recorded = derived_and_recorded(data, lmsys_config_json)
    if recorded is None:
        return derived
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "tied_embeddings"):
        if getattr(recorded, key) != getattr(derived, key):
            raise ExportError(
                f"config.json disagrees with the lmsys config recorded in model.safetensors: "
                f"{key} is {getattr(derived, key)} vs {getattr(recorded, key)}"
            )
    if model_dims(recorded).d_ff != model_dims(derived).d_ff or recorded.norm.eps != derived.norm.eps:
        raise ExportError(
            "config.json disagrees with the lmsys config recorded in model.safetensors: n_inner or eps"
        )
    return recorded


def derived_and_recorded(
    data: dict[str, Any], lmsys_config_json: str | None, label: str = "config.json"
) -> tuple[ModelConfig, ModelConfig | None]:
    """(the ModelConfig of `data`, the lmsys form of a config.json; the one an lmsys format=hf
    export recorded in its safetensors header, None when there is none), each validated."""
    try:
        derived = model_config_from_dict(data)
    except ConfigError as exc:
        raise ExportError(f"{label} describes an invalid model: {exc}") from exc
    if not lmsys_config_json:
        return derived, None
    try:
        recorded = model_config_from_dict(json.loads(lmsys_config_json))
    except (ValueError, ConfigError) as exc:
        raise ExportError(f"the lmsys config recorded in model.safetensors is invalid: {exc}") from exc
    return derived, recorded


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names (without the `transformer.` prefix) and shapes of a GPT-2 checkpoint of `cfg`."""
    d, v, t, f = cfg.d_model, cfg.vocab_size, cfg.max_seq_len, model_dims(cfg).d_ff
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (v, d),
        "wpe.weight": (t, d),
        "ln_f.weight": (d,),
        "ln_f.bias": (d,),
    }
    for i in range(cfg.n_layers):
        h = f"h.{i}."
        shapes.update(
            {
                h + "ln_1.weight": (d,),
                h + "ln_1.bias": (d,),
                h + "attn.c_attn.weight": (d, 3 * d),
                h + "attn.c_attn.bias": (3 * d,),
                h + "attn.c_proj.weight": (d, d),
                h + "attn.c_proj.bias": (d,),
                h + "ln_2.weight": (d,),
                h + "ln_2.bias": (d,),
                h + "mlp.c_fc.weight": (d, f),
                h + "mlp.c_fc.bias": (f,),
                h + "mlp.c_proj.weight": (f, d),
                h + "mlp.c_proj.bias": (d,),
            }
        )
    if not cfg.tied_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def normalize_hf_keys(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Strip `transformer.`, drop the causal-mask buffers older GPT-2 files carry, and drop a
    stored lm_head.weight that merely repeats the tied wte."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        name = key[len("transformer.") :] if key.startswith("transformer.") else key
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
            if value.dim() != 1:  # the (1, 1, T, T) mask buffer, not a parameter
                continue
        out[name] = value
    if cfg.tied_embeddings and "lm_head.weight" in out:
        lm_head = out.pop("lm_head.weight")
        if "wte.weight" in out and not torch.equal(lm_head, out["wte.weight"]):
            raise ExportError("lm_head.weight differs from wte.weight although tie_word_embeddings=true")
    return out


def from_hf(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], label: str = "model.safetensors"
) -> dict[str, torch.Tensor]:
    """lmsys state dict (tied embedding once) from GPT-2 tensors, names and shapes checked."""
    hf = normalize_hf_keys(tensors, cfg)
    check_tensors(hf, expected_hf_shapes(cfg), where="", file_label=label)
    d = cfg.d_model
    state: dict[str, torch.Tensor] = {
        "tok_emb.weight": hf["wte.weight"],
        "positions.table": hf["wpe.weight"],
        "final_norm.weight": hf["ln_f.weight"],
        "final_norm.bias": hf["ln_f.bias"],
    }
    if not cfg.tied_embeddings:
        state["unembed.weight"] = hf["lm_head.weight"]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"h.{i}."
        q_bias, k_bias, v_bias = hf[h + "attn.c_attn.bias"].split(d)
        state.update(
            {
                b + "norm1.weight": hf[h + "ln_1.weight"],
                b + "norm1.bias": hf[h + "ln_1.bias"],
                b + "attn.w_qkv.weight": hf[h + "attn.c_attn.weight"].t(),
                b + "attn.q_bias": q_bias,
                b + "attn.k_bias": k_bias,
                b + "attn.v_bias": v_bias,
                b + "attn.w_o.weight": hf[h + "attn.c_proj.weight"].t(),
                b + "attn.w_o.bias": hf[h + "attn.c_proj.bias"],
                b + "norm2.weight": hf[h + "ln_2.weight"],
                b + "norm2.bias": hf[h + "ln_2.bias"],
                b + "ffn.hidden.0.weight": hf[h + "mlp.c_fc.weight"].t(),
                b + "ffn.hidden.0.bias": hf[h + "mlp.c_fc.bias"],
                b + "ffn.out.weight": hf[h + "mlp.c_proj.weight"].t(),
                b + "ffn.out.bias": hf[h + "mlp.c_proj.bias"],
            }
        )
    return {k: v.contiguous() for k, v in state.items()}


# ----------------------------------------------------------------------------- a transformers directory


def read_hf_weights(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """(tensors, safetensors metadata, a label naming the files) of a transformers directory."""
    for single, index in HF_WEIGHT_FILES:
        files = [directory / single] if (directory / single).is_file() else []
        if not files and (directory / index).is_file():
            files = _shards(directory / index)
        if files:
            break
    else:
        names = ", ".join(name for pair in HF_WEIGHT_FILES for name in pair)
        raise ExportError(f"{directory} holds no weights (looked for {names})")
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for file in files:
        if file.suffix == ".safetensors":
            part, meta = read_safetensors(file)
            metadata.update(meta)
        else:
            part = _load_bin(file)
        tensors.update(part)
    label = str(files[0]) if len(files) == 1 else f"{directory} ({len(files)} weight shards)"
    return tensors, metadata, label


def _shards(index: Path) -> list[Path]:
    """The shard files an `.index.json` lists (its weight_map's values), each present."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ExportError(
            f"{index} is not a transformers weight index ({type(exc).__name__}: {exc})"
        ) from exc
    missing = [name for name in names if not (index.parent / name).is_file()]
    if missing:
        raise ExportError(f"{index} lists {missing[0]}, which is missing")
    return [index.parent / name for name in names]


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model.bin's tensors; weights_only refuses any pickle that would build other objects."""
    try:
        with warnings.catch_warnings():  # torch's notes on pickle protocols say nothing to a user
            warnings.simplefilter("ignore", UserWarning)
            data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        # torch's message suggests weights_only=False; keep only what it found in the file
        text = " ".join(str(exc).split())
        found = text.split("WeightsUnpickler error:", 1)[-1].split(" Check the documentation")[0].strip()
        raise ExportError(
            f"{path} cannot be read safely: torch.load(weights_only=True) refused it ({found[:200]}); "
            "lmsys reads only tensors from a pickle, never code"
        ) from exc
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise ExportError(f"{path} does not hold a state dict of tensors")
    return data
