"""The model's part of the typed configuration: `ModelConfig` (every option of docs/SPEC.md),
the widths it implies (`model_dims`), and its validation (`validate_model`).

lmsys.core.config composes and validates the whole configuration and re-exports these names; this
module holds the model's schema so that each stays a readable size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lmsys.core.choices import KERNEL_CHOICES
from lmsys.core.errors import ConfigError

POSITION_KINDS = ("learned", "sinusoidal", "fourier_T", "rotary", "none")
ROPE_SCALINGS = ("none", "llama3")
HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # model.hf_model_type: format=hf's architectures
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "leaky_relu")
NORM_FORMULAS = ("sqrt_var_eps", "std_plus_eps", "exact", "rms", "none")
BLOCK_KINDS = ("none", "pre", "post", "parallel")
SOFTMAX_KINDS = ("row", "matrix")
LOSS_IMPLS = ("auto", "fused", "chunked", "torch", "full")


# ----------------------------------------------------------------------------- model


@dataclass
class RopeScalingConfig:
    """The rotary frequencies' rescaling for contexts beyond the pretrained one (SPEC section 11)."""

    kind: str = "none"  # none | llama3 (Llama 3.1/3.2's: slow frequencies / factor, smooth in between)
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192  # the context the model was pretrained at


@dataclass
class PositionsConfig:
    # learned | sinusoidal | fourier_T | rotary | none (SPEC sections 2 and 11); rotary rotates each
    # query and key head by its position and adds nothing to the embeddings
    kind: str = "learned"
    trainable: bool = True  # sinusoidal / fourier_T: a Parameter initialised by the formula, or a buffer
    origin: int = 0  # sinusoidal: number of the first position (seed 001 counts from 1)
    rope_theta: float = 10000.0  # rotary: the base of the frequencies theta^(-2i/d)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)


@dataclass
class AttentionConfig:
    causal: bool = True
    scale: float | None = None  # None means 1/sqrt(d_qk); seed 000 uses 1.0 (W_QK absorbs it)
    d_qk: int | None = None  # per-head query/key width; None means d_model // n_heads
    d_vo: int | None = None  # per-head value/output width; None means d_model // n_heads
    # grouped-query attention: key/value heads, each shared by n_heads / n_kv_heads query heads
    # (1: multi-query); None means n_heads
    n_kv_heads: int | None = None
    qk_norm: bool = False  # RMS-normalise each query and key head (gain of width d_qk) before rotary
    q_bias: bool = True
    k_bias: bool = True
    v_bias: bool = True
    o_bias: bool = True
    # "row" is the softmax every seed's function needs; "matrix" normalises over the whole
    # (masked) score matrix, the literal reading of seeds 000/003, kept as a reference option.
    softmax: str = "row"


@dataclass
class FFNConfig:
    activation: str = "gelu_tanh"
    d_ff: int | None = None  # None means 4 * d_model
    n_hidden_layers: int = 1  # seed 000 allows any depth; activation on hidden layers only
    bias: bool = True
    bias_after_activation: bool = False  # seed 002: W2 (phi(W1 x) + b1) + b2
    gated: bool = False  # W2 (phi(W_gate x) * (W1 x)): SwiGLU with silu, GeGLU with gelu (one hidden layer)


@dataclass
class NormConfig:
    formula: str = "sqrt_var_eps"  # sqrt_var_eps | std_plus_eps | exact | rms | none (identity)
    eps: float = 1e-5
    affine: bool = True


@dataclass
class ModelConfig:
    name: str = "custom"
    vocab_size: int = 50257  # rows of the embedding (and the unembedding)
    # The pieces of the model's tokenizer when fewer than vocab_size: the rows past it are padding
    # no text encodes to (an imported Qwen: 151,936 rows, 151,669 pieces). None: vocab_size.
    tokenizer_vocab_size: int | None = None
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    max_seq_len: int = 1024  # T_max: learned table size, sinusoidal rows, fourier_T's base T
    positions: PositionsConfig = field(default_factory=PositionsConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    norm: NormConfig = field(default_factory=NormConfig)
    block: str = "pre"  # none | pre | post | parallel (SPEC section 6)
    final_norm: bool = True
    tied_embeddings: bool = True
    unembed_bias: bool = False
    bos_shift: bool = False  # seed 001's loss: prepend token `bos_shift_id` so every token is predicted
    bos_shift_id: int = 0
    init_std: float = 0.02
    kernels: str = "auto"  # auto (Triton on CUDA, torch elsewhere) | triton | torch
    # How Transformer.loss computes the same function from the last hidden states: fused (the Triton
    # kernel), chunked (torch, a chunk of tokens at a time), neither materialising the (tokens, V)
    # logits; full (logits, then cross-entropy); auto: fused where model.kernels runs Triton (CUDA
    # by default), chunked elsewhere.
    loss_impl: str = "auto"
    # An export directory whose weights start a training run (fine-tuning; lmsys.export.initial_model):
    # its model must compute the same function as this config. A resumed run ignores it.
    init_from: str | None = None
    # format=hf: the transformers architecture to write (llama | qwen2 | qwen3 | mistral), kept from an
    # import; None: the one the function needs (lmsys/interop/hf_llama.py)
    hf_model_type: str | None = None


# ----------------------------------------------------------------------------- derived values


@dataclass(frozen=True)
class ModelDims:
    """Widths the model actually uses, derived once from a ModelConfig."""

    d_qk: int
    d_vo: int
    d_ff: int
    attention_scale: float
    n_kv_heads: int  # key/value heads (n_heads without grouped-query attention)


def model_dims(cfg: ModelConfig) -> ModelDims:
    d_qk = cfg.attention.d_qk if cfg.attention.d_qk is not None else cfg.d_model // cfg.n_heads
    d_vo = cfg.attention.d_vo if cfg.attention.d_vo is not None else cfg.d_model // cfg.n_heads
    d_ff = cfg.ffn.d_ff if cfg.ffn.d_ff is not None else 4 * cfg.d_model
    scale = cfg.attention.scale if cfg.attention.scale is not None else 1.0 / math.sqrt(d_qk)
    n_kv = cfg.attention.n_kv_heads if cfg.attention.n_kv_heads is not None else cfg.n_heads
    return ModelDims(d_qk=d_qk, d_vo=d_vo, d_ff=d_ff, attention_scale=scale, n_kv_heads=n_kv)


def tokenizer_size(cfg: ModelConfig) -> int:
    """The pieces of the tokenizer this model reads: model.tokenizer_vocab_size, else vocab_size."""
    return cfg.tokenizer_vocab_size if cfg.tokenizer_vocab_size is not None else cfg.vocab_size


def context_prefix(cfg: ModelConfig) -> list[int]:
    """Token ids every input of this model starts with: [bos_shift_id] under bos_shift (position
    0 always held it in training), none otherwise."""
    return [cfg.bos_shift_id] if cfg.bos_shift else []


def autoregressive(cfg: ModelConfig) -> bool:
    """Whether earlier positions never see later tokens (causal row-softmax attention): then a KV
    cache is exact, and tokens appended after a sequence cannot change its earlier outputs."""
    return cfg.attention.causal and cfg.attention.softmax == "row"


def tokens_per_sample(cfg: ModelConfig, seq_len: int) -> int:
    """Tokens a training sequence spans so the forward covers `seq_len` positions: seq_len + 1
    with the usual shift (the first token is only context), seq_len under bos_shift."""
    return seq_len + 1 - len(context_prefix(cfg))


# ----------------------------------------------------------------------------- validation


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def one_of(key: str, value: Any, valid: tuple[str, ...]) -> None:
    require(value in valid, f"{key}={value!r} is not valid; choose one of: {', '.join(valid)}")


def validate_model(cfg: ModelConfig, prefix: str = "model") -> None:
    p = prefix
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
        require(getattr(cfg, key) >= 1, f"{p}.{key}={getattr(cfg, key)} must be >= 1")
    one_of(f"{p}.positions.kind", cfg.positions.kind, POSITION_KINDS)
    one_of(f"{p}.ffn.activation", cfg.ffn.activation, ACTIVATIONS)
    one_of(f"{p}.norm.formula", cfg.norm.formula, NORM_FORMULAS)
    one_of(f"{p}.block", cfg.block, BLOCK_KINDS)
    one_of(f"{p}.attention.softmax", cfg.attention.softmax, SOFTMAX_KINDS)
    one_of(f"{p}.kernels", cfg.kernels, KERNEL_CHOICES)
    one_of(f"{p}.loss_impl", cfg.loss_impl, LOSS_IMPLS)
    require(cfg.positions.origin in (0, 1), f"{p}.positions.origin={cfg.positions.origin} must be 0 or 1")
    if cfg.positions.kind in ("sinusoidal", "fourier_T"):
        require(
            cfg.d_model % 2 == 0,
            f"{p}.d_model={cfg.d_model} must be even for {p}.positions.kind={cfg.positions.kind}",
        )
    for key in ("d_qk", "d_vo"):
        value = getattr(cfg.attention, key)
        if value is None:
            require(
                cfg.d_model % cfg.n_heads == 0,
                f"{p}.n_heads={cfg.n_heads} does not divide {p}.d_model={cfg.d_model} "
                f"(needed while {p}.attention.{key} is unset)",
            )
        else:
            require(value >= 1, f"{p}.attention.{key}={value} must be >= 1")
    if cfg.attention.scale is not None:
        require(cfg.attention.scale > 0, f"{p}.attention.scale={cfg.attention.scale} must be > 0")
    _validate_llama_options(cfg, p)
    if cfg.ffn.d_ff is not None:
        require(cfg.ffn.d_ff >= 1, f"{p}.ffn.d_ff={cfg.ffn.d_ff} must be >= 1")
    require(cfg.ffn.n_hidden_layers >= 1, f"{p}.ffn.n_hidden_layers={cfg.ffn.n_hidden_layers} must be >= 1")
    require(cfg.norm.eps >= 0, f"{p}.norm.eps={cfg.norm.eps} must be >= 0")
    require(cfg.init_std > 0, f"{p}.init_std={cfg.init_std} must be > 0")
    if cfg.block in ("pre", "post"):
        require(
            cfg.norm.formula != "none",
            f"{p}.norm.formula=none is only valid with {p}.block=none or parallel "
            f"(got {p}.block={cfg.block})",
        )
    if cfg.final_norm:
        require(cfg.norm.formula != "none", f"{p}.final_norm=true needs a {p}.norm.formula other than none")
    if cfg.attention.softmax == "matrix":
        require(
            cfg.kernels != "triton",
            f"{p}.attention.softmax=matrix is a torch-only reference option; set {p}.kernels=torch or auto",
        )
    require(
        0 <= cfg.bos_shift_id < cfg.vocab_size,
        f"{p}.bos_shift_id={cfg.bos_shift_id} must be a token id in [0, {p}.vocab_size={cfg.vocab_size})",
    )


def _validate_llama_options(cfg: ModelConfig, p: str) -> None:
    """The options of SPEC section 11: grouped-query attention, rotary positions, the gated FFN."""
    a, pos = cfg.attention, cfg.positions
    if a.n_kv_heads is not None:
        require(
            a.n_kv_heads >= 1 and cfg.n_heads % a.n_kv_heads == 0,
            f"{p}.attention.n_kv_heads={a.n_kv_heads} must divide {p}.n_heads={cfg.n_heads} "
            "(each key/value head serves an equal group of query heads; 1 is multi-query attention)",
        )
    if cfg.tokenizer_vocab_size is not None:
        require(
            1 <= cfg.tokenizer_vocab_size <= cfg.vocab_size,
            f"{p}.tokenizer_vocab_size={cfg.tokenizer_vocab_size} must be in [1, {p}.vocab_size="
            f"{cfg.vocab_size}] (the embedding's rows hold the tokenizer's pieces)",
        )
    one_of(f"{p}.positions.rope_scaling.kind", pos.rope_scaling.kind, ROPE_SCALINGS)
    if pos.kind == "rotary":
        d_qk = model_dims(cfg).d_qk
        require(
            d_qk % 2 == 0,
            f"{p}.attention.d_qk={d_qk} is odd: rotary positions rotate pairs of a head's dimensions, "
            "so the query/key width must be even",
        )
        require(pos.rope_theta > 0, f"{p}.positions.rope_theta={pos.rope_theta} must be > 0")
        scaling = pos.rope_scaling
        if scaling.kind == "llama3":
            q = f"{p}.positions.rope_scaling"
            require(scaling.factor > 0, f"{q}.factor={scaling.factor} must be > 0")
            require(
                0 < scaling.low_freq_factor < scaling.high_freq_factor,
                f"{q}.low_freq_factor={scaling.low_freq_factor} must be > 0 and below "
                f"{q}.high_freq_factor={scaling.high_freq_factor}",
            )
            require(
                scaling.original_max_seq_len >= 1,
                f"{q}.original_max_seq_len={scaling.original_max_seq_len} must be >= 1",
            )
    if cfg.ffn.gated:
        require(
            cfg.ffn.n_hidden_layers == 1 and not cfg.ffn.bias_after_activation,
            f"{p}.ffn.gated=true has one hidden layer with its bias before the activation; set "
            f"{p}.ffn.n_hidden_layers=1 and {p}.ffn.bias_after_activation=false",
        )
    if cfg.hf_model_type is not None:
        one_of(f"{p}.hf_model_type", cfg.hf_model_type, HF_MODEL_TYPES)


def either(numbers: list[int]) -> str:
    """`1`, `1 or 2`, `1, 2 or 4`: the numbers an error line offers."""
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_sequence_parallel(p: int, cfg: ModelConfig, seq_len: int) -> None:
    """trainer.sequence_parallel=p for this model and data.seq_len: each of the p ranks of a group
    holds seq_len / p positions of every sequence and attends over the whole of it with n_heads / p
    query heads; the key/value heads are split among them (a multiple of p) or each rank holds a
    copy of the one its query heads read (a divisor of p). ConfigError naming what would fit."""
    require(p >= 1, f"trainer.sequence_parallel={p} must be >= 1 (1: off)")
    if p == 1:
        return
    heads, kv_heads = cfg.n_heads, model_dims(cfg).n_kv_heads
    fits = [d for d in divisors(heads)[1:] if kv_heads % d == 0 or d % kv_heads == 0]
    fit = f"; use trainer.sequence_parallel={either(fits)}" if fits else ""
    require(
        heads % p == 0,
        f"trainer.sequence_parallel={p} does not divide model.n_heads={heads}: each rank of a group "
        f"attends with n_heads / {p} of the query heads{fit}",
    )
    require(
        kv_heads % p == 0 or p % kv_heads == 0,
        f"trainer.sequence_parallel={p} and model.attention.n_kv_heads={kv_heads}: the key/value heads "
        f"are split among the {p} ranks of a group (a multiple of {p}) or copied to them (a divisor of "
        f"{p}), and {kv_heads} is neither{fit}",
    )
    require(
        seq_len % p == 0,
        f"data.seq_len={seq_len} does not divide by trainer.sequence_parallel={p}: each rank of a group "
        f"holds data.seq_len / {p} positions of every sequence; use e.g. data.seq_len="
        f"{max(p, seq_len // p * p)}",
    )
