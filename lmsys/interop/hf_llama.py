"""The Llama family ↔ Hugging Face: transformers' Llama, Qwen2, Qwen3 and Mistral checkpoints as
lmsys configs and weights, and lmsys models of that family as such checkpoints.

The family's function (docs/SPEC.md section 11) in lmsys's options: rotary positions
(`positions.kind=rotary`, `rope_theta`, rope scaling none or llama3), pre-norm blocks with RMS
norms of gain only, a gated feed-forward without the bias-after-activation, grouped-query attention
with one head width (d_qk = d_vo = head_dim, scale 1/sqrt(head_dim)), causal row softmax, a final
norm, no unembedding bias, no bos_shift. What each architecture adds (config.json):

    model_type   attention biases                 QK-norm   feed-forward biases
    llama        q, k, v, o together (attention_bias)  no   all or none (mlp_bias)
    mistral      none                             no        none
    qwen2        q, k, v (never o)                no        none
    qwen3        q, k, v, o together (attention_bias)  yes  none

Everything else is a size: vocab_size, hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings, rms_norm_eps,
hidden_act, tie_word_embeddings. A checkpoint whose function lmsys cannot express is refused in
one line: sliding-window attention in use (a window shorter than the context on some layer), a
rope scaling other than default and llama3, a partial rotary factor, an activation lmsys lacks.

Weight layout: both sides use nn.Linear's (out, in) layout and the same half-split rotary
dimensions, so the tensors map over unchanged (no transpose, no permutation):
    model.embed_tokens.weight                        tok_emb.weight            (V, D)
    model.layers.i.input_layernorm.weight            blocks.i.norm1.weight
    model.layers.i.self_attn.{q,k,v}_proj.weight     blocks.i.attn.w_qkv.weight, rows [Q | K | V]
    model.layers.i.self_attn.{q,k,v}_proj.bias       blocks.i.attn.{q,k,v}_bias
    model.layers.i.self_attn.o_proj.{weight,bias}    blocks.i.attn.w_o.{weight,bias}
    model.layers.i.self_attn.{q,k}_norm.weight       blocks.i.attn.{q,k}_norm.weight (QK-norm)
    model.layers.i.post_attention_layernorm.weight   blocks.i.norm2.weight
    model.layers.i.mlp.gate_proj.{weight,bias}       blocks.i.ffn.gate
    model.layers.i.mlp.up_proj.{weight,bias}         blocks.i.ffn.hidden.0
    model.layers.i.mlp.down_proj.{weight,bias}       blocks.i.ffn.out
    model.norm.weight                                final_norm.weight
    lm_head.weight                                   unembed.weight (untied only; tied: not stored)
Splitting the fused [Q | K | V] rows and concatenating them again copies every bit, so a
checkpoint read and written back holds the same tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lmsys.core.config import ModelConfig, model_dims
from lmsys.core.errors import ExportError
from lmsys.interop.hf import HF_ACTIVATIONS, derived_and_recorded, special_ids
from lmsys.model.weights import check_tensors, expected_shapes

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
MODEL_TYPES = tuple(ARCHITECTURES)
# lmsys's activations by transformers' name (the one config.json gets)
HF_ACTIVATION_NAMES = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu",
                       "tanh": "tanh", "sigmoid": "sigmoid"}  # fmt: skip
# A checkpoint's stored buffers that are not weights (rotary tables of older Llama files).
_BUFFERS = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- the family's function


def model_type_for(cfg: ModelConfig) -> str:
    """The transformers architecture of a family model: the one it was imported as
    (model.hf_model_type), else qwen3 with QK-norm, qwen2 with q/k/v biases and no o bias, llama."""
    if cfg.hf_model_type is not None:
        return cfg.hf_model_type
    a = cfg.attention
    if a.qk_norm:
        return "qwen3"
    if a.q_bias and a.k_bias and a.v_bias and not a.o_bias:
        return "qwen2"
    return "llama"


def family_difference(cfg: ModelConfig, model_type: str) -> str | None:
    """The first option of `cfg` that transformers' `model_type` cannot express, as
    `model.key=value differs (<model_type>: want)`."""
    dims, a = model_dims(cfg), cfg.attention
    checks: list[tuple[str, Any, Any]] = [
        ("positions.kind", cfg.positions.kind, "rotary"),
        ("block", cfg.block, "pre"),
        ("norm.formula", cfg.norm.formula, "rms"),
        ("norm.affine", cfg.norm.affine, True),
        ("attention.causal", a.causal, True),
        ("attention.softmax", a.softmax, "row"),
        ("attention.d_vo", dims.d_vo, dims.d_qk),
        ("ffn.gated", cfg.ffn.gated, True),
        ("final_norm", cfg.final_norm, True),
        ("unembed_bias", cfg.unembed_bias, False),
        ("bos_shift", cfg.bos_shift, False),
        ("attention.qk_norm", a.qk_norm, model_type == "qwen3"),
    ]
    if model_type in ("llama", "qwen3"):  # attention_bias: all four or none
        checks += [(f"attention.{key}", getattr(a, key), a.q_bias) for key in ("k_bias", "v_bias", "o_bias")]
    else:  # mistral: none; qwen2: q, k, v and not o
        for key in ("q_bias", "k_bias", "v_bias"):
            checks.append((f"attention.{key}", getattr(a, key), model_type == "qwen2"))
        checks.append(("attention.o_bias", a.o_bias, False))
    if model_type != "llama":  # mlp_bias is Llama's alone
        checks.append(("ffn.bias", cfg.ffn.bias, False))
    if cfg.ffn.activation not in HF_ACTIVATION_NAMES:
        names = ", ".join(HF_ACTIVATION_NAMES)
        return f"model.ffn.activation={cfg.ffn.activation} differs ({model_type}: one of {names})"
    for key, value, want in checks:
        if value != want:
            shown = "d_qk" if key == "attention.d_vo" else _show(want)
            return f"model.{key}={_show(value)} differs ({model_type}: {shown})"
    if not math.isclose(dims.attention_scale, 1.0 / math.sqrt(dims.d_qk), rel_tol=1e-12):
        return f"model.attention.scale={a.scale} differs ({model_type}: 1/sqrt(head_dim), i.e. unset)"
    return None


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def require_family(cfg: ModelConfig) -> str:
    """The model_type format=hf writes for `cfg`; ExportError naming the first option it cannot
    express."""
    model_type = model_type_for(cfg)
    diff = family_difference(cfg, model_type)
    if diff is not None:
        raise ExportError(
            f"format=hf of a rotary model needs the function of transformers' {ARCHITECTURES[model_type]} "
            f"(docs/huggingface.md); {diff}"
        )
    return model_type


# ----------------------------------------------------------------------------- lmsys → HF


def hf_config(
    cfg: ModelConfig, tokenizer: Any | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """config.json of a family model, in the form every transformers release reads (rope_theta and
    rope_scaling at the top; transformers 5 turns them into its rope_parameters)."""
    model_type = require_family(cfg)
    dims, a, pos = model_dims(cfg), cfg.attention, cfg.positions
    scaling = pos.rope_scaling
    rope_scaling = None
    if scaling.kind == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
        }
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": dims.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": dims.n_kv_heads,
        "hidden_act": HF_ACTIVATION_NAMES[cfg.ffn.activation],
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps,
        "rope_theta": pos.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tied_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),  # the stored weights' dtype
        **special_ids(tokenizer),
    }
    if model_type != "qwen2" or dims.d_qk * cfg.n_heads != cfg.d_model:  # Qwen2Config has no head_dim field
        config["head_dim"] = dims.d_qk
    if model_type in ("llama", "qwen3"):
        config["attention_bias"] = a.q_bias
    if model_type == "llama":
        config["mlp_bias"] = cfg.ffn.bias
    if model_type in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    if model_type == "mistral":
        config["sliding_window"] = None
    return config


def to_hf(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer: Any | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json dict, safetensors tensors) of a family model's weights (a tied embedding once)."""
    config = hf_config(cfg, tokenizer, dtype)
    dims = model_dims(cfg)
    split = [cfg.n_heads * dims.d_qk, dims.n_kv_heads * dims.d_qk, dims.n_kv_heads * dims.d_vo]
    out = {
        "model.embed_tokens.weight": state["tok_emb.weight"],
        "model.norm.weight": state["final_norm.weight"],
    }
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = state["unembed.weight"]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for name, rows in zip("qkv", state[b + "attn.w_qkv.weight"].split(split)):
            out[f"{h}self_attn.{name}_proj.weight"] = rows
            if f"{b}attn.{name}_bias" in state:
                out[f"{h}self_attn.{name}_proj.bias"] = state[f"{b}attn.{name}_bias"]
        for theirs, ours in _LAYER_NAMES:
            if b + ours in state:
                out[h + theirs] = state[b + ours]
    return config, {k: v.contiguous() for k, v in out.items()}


# (transformers' name, lmsys's name) inside layer i, besides the fused q/k/v projections
_LAYER_NAMES = [
    ("input_layernorm.weight", "norm1.weight"),
    ("post_attention_layernorm.weight", "norm2.weight"),
    ("self_attn.o_proj.weight", "attn.w_o.weight"),
    ("self_attn.o_proj.bias", "attn.w_o.bias"),
    ("self_attn.q_norm.weight", "attn.q_norm.weight"),
    ("self_attn.k_norm.weight", "attn.k_norm.weight"),
    ("mlp.gate_proj.weight", "ffn.gate.weight"),
    ("mlp.gate_proj.bias", "ffn.gate.bias"),
    ("mlp.up_proj.weight", "ffn.hidden.0.weight"),
    ("mlp.up_proj.bias", "ffn.hidden.0.bias"),
    ("mlp.down_proj.weight", "ffn.out.weight"),
    ("mlp.down_proj.bias", "ffn.out.bias"),
]


# ----------------------------------------------------------------------------- HF → lmsys


def model_config_from_hf(
    config: dict[str, Any], lmsys_config_json: str | None = None, label: str = "config.json"
) -> ModelConfig:
    """The lmsys ModelConfig of a Llama, Qwen2, Qwen3 or Mistral config.json. When the weights
    record the lmsys config (lmsys's own format=hf exports), that is used, once config.json is
    checked to describe the same function."""
    model_type = str(config.get("model_type"))
    try:
        data = _config_dict(config, model_type, label)
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"{label} is not a {model_type} config ({type(exc).__name__}: {exc})") from exc
    derived, recorded = derived_and_recorded(data, lmsys_config_json, label)
    if recorded is None:
        return derived
    ignore = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "initializer_range")
    want = hf_config(recorded)
    for key, value in hf_config(derived).items():
        if key not in ignore and want.get(key) != value:
            raise ExportError(
                f"{label} disagrees with the lmsys config recorded in model.safetensors: {key} is "
                f"{value} vs {want.get(key)}"
            )
    return recorded


def _config_dict(config: dict[str, Any], model_type: str, label: str) -> dict[str, Any]:
    """lmsys's model config (a dict) of a family config.json; ExportError for what it cannot express."""
    heads = int(config["num_attention_heads"])
    d_model = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or d_model // heads)
    activation = str(config.get("hidden_act", "silu"))
    if activation not in HF_ACTIVATIONS:
        raise ExportError(f"{label}: hidden_act={activation!r} has no lmsys equivalent")
    max_len = int(config.get("max_position_embeddings", 2048))
    window = _sliding_window_in_use(config, model_type, max_len)
    if window is not None:
        raise ExportError(
            f"{label}: sliding-window attention (sliding_window={window}, shorter than the context of "
            f"{max_len}) has no lmsys equivalent; lmsys reads Llama, Qwen2, Qwen3 and Mistral "
            "checkpoints with full causal attention"
        )
    every_bias = bool(config.get("attention_bias", False))
    qwen2 = model_type == "qwen2"
    return {
        "name": f"{model_type}-hf",
        "vocab_size": int(config["vocab_size"]),
        "d_model": d_model,
        "n_layers": int(config["num_hidden_layers"]),
        "n_heads": heads,
        "max_seq_len": max_len,
        "positions": {"kind": "rotary", **_rope(config, max_len, label)},
        "attention": {
            "causal": True,
            "d_qk": head_dim,
            "d_vo": head_dim,
            "n_kv_heads": int(config.get("num_key_value_heads") or heads),
            "qk_norm": model_type == "qwen3",
            "q_bias": every_bias or qwen2,
            "k_bias": every_bias or qwen2,
            "v_bias": every_bias or qwen2,
            "o_bias": every_bias and not qwen2,
        },
        "ffn": {
            "activation": HF_ACTIVATIONS[activation],
            "d_ff": int(config["intermediate_size"]),
            "gated": True,
            "bias": model_type == "llama" and bool(config.get("mlp_bias", False)),
        },
        "norm": {"formula": "rms", "eps": float(config.get("rms_norm_eps", 1e-6)), "affine": True},
        "block": "pre",
        "final_norm": True,
        "tied_embeddings": bool(config.get("tie_word_embeddings", False)),
        "unembed_bias": False,
        "init_std": float(config.get("initializer_range", 0.02)),
        "hf_model_type": model_type,
    }


def _rope(config: dict[str, Any], max_len: int, label: str) -> dict[str, Any]:
    """positions.rope_theta and rope_scaling of a config.json: transformers 5's rope_parameters, or
    the rope_theta and rope_scaling of earlier releases (the hub's files)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        raise ExportError(f"{label}: rotary parameters per layer type have no lmsys equivalent")
    if not params:
        params = dict(config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ExportError(
            f"{label}: partial_rotary_factor={partial} has no lmsys equivalent (lmsys rotates whole heads)"
        )
    if rope_type == "default":
        return {"rope_theta": theta, "rope_scaling": {"kind": "none"}}
    if rope_type != "llama3":
        raise ExportError(
            f"{label}: rope scaling {rope_type!r} has no lmsys equivalent; lmsys reads the default rotary "
            "positions and llama3's scaling"
        )
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    return {
        "rope_theta": theta,
        "rope_scaling": {
            "kind": "llama3",
            "factor": float(params["factor"]),
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_seq_len": int(original if original is not None else max_len),
        },
    }


def _sliding_window_in_use(config: dict[str, Any], model_type: str, max_len: int) -> int | None:
    """The attention window of a checkpoint that limits some layer's attention below its context,
    else None. Mistral windows every layer when sliding_window is set; Qwen2/3 only with
    use_sliding_window, on the layers that layer_types (or, before it, max_window_layers) names."""
    window = config.get("sliding_window")
    if window is None or int(window) >= max_len:
        return None
    if model_type in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False):
            return None
        layer_types = config.get("layer_types")
        if layer_types is not None:
            return int(window) if "sliding_attention" in layer_types else None
        layers = int(config["num_hidden_layers"])
        return int(window) if int(config.get("max_window_layers", layers)) < layers else None
    return int(window) if model_type == "mistral" else None


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a family checkpoint of `cfg` (transformers' names): lmsys's, mapped by
    to_hf on the meta device (no memory)."""
    meta = {k: torch.empty(shape, device="meta") for k, shape in expected_shapes(cfg).items()}
    return {k: tuple(v.shape) for k, v in to_hf(cfg, meta)[1].items()}


def from_hf(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], label: str = "model.safetensors"
) -> dict[str, torch.Tensor]:
    """lmsys state dict (tied embedding once) of a family checkpoint's tensors, names and shapes
    checked; a tied lm_head.weight stored anyway must equal the embedding."""
    hf = {k: v for k, v in tensors.items() if not k.endswith(_BUFFERS)}
    if cfg.tied_embeddings and "lm_head.weight" in hf:
        lm_head = hf.pop("lm_head.weight")
        if not torch.equal(lm_head, hf.get("model.embed_tokens.weight", lm_head)):
            raise ExportError(
                f"{label}: lm_head.weight differs from the embedding although tie_word_embeddings=true"
            )
    check_tensors(hf, expected_hf_shapes(cfg), where="", file_label=label)
    state = {"tok_emb.weight": hf["model.embed_tokens.weight"], "final_norm.weight": hf["model.norm.weight"]}
    if not cfg.tied_embeddings:
        state["unembed.weight"] = hf["lm_head.weight"]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        state[b + "attn.w_qkv.weight"] = torch.cat([hf[f"{h}self_attn.{n}_proj.weight"] for n in "qkv"])
        for name in "qkv":
            if f"{h}self_attn.{name}_proj.bias" in hf:
                state[f"{b}attn.{name}_bias"] = hf[f"{h}self_attn.{name}_proj.bias"]
        for theirs, ours in _LAYER_NAMES:
            if h + theirs in hf:
                state[b + ours] = hf[h + theirs]
    return {k: v.contiguous() for k, v in state.items()}
