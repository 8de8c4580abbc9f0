"""The transformer family of docs/SPEC.md: one configurable, single-device model.

Read top to bottom: positions (additive tables and rotary), attention, feed-forward,
normalisation, blocks, the unembedding, the stack, the loss. Every option is a field of
`ModelConfig`; the presets in conf/model/ pick the values that reproduce each seed document (and
the Llama family's published shapes). The model never touches torch.distributed and never knows whether
it is sharded: lmsys/engine/zero.py wraps it from outside.

Shapes: B batch, T positions, D d_model, H heads, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from lmsys.core.config import ModelConfig, context_prefix, model_dims, validate_model
from lmsys.model import ops
from lmsys.model.kv_cache import (
    CacheSpan,
    KVCache,
    StaticKVCache,
    document_span,
    document_starts,
    uncached_span,
)

# ----------------------------------------------------------------------------- positions


def sinusoidal_table(n_positions: int, d_model: int, origin: int = 0) -> torch.Tensor:
    """P[r, 2i] = sin(p / 10000^(2i/D)), P[r, 2i+1] = cos(p / 10000^(2i/D)), p = r + origin.

    Seed 001 numbers positions from 1 (origin=1); the Vaswani et al. convention is origin=0.
    """
    p = torch.arange(n_positions, dtype=torch.float64)[:, None] + origin  # (T, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (D/2,)
    angle = p / torch.pow(10000.0, two_i / d_model)  # (T, D/2)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


def fourier_t_table(n_positions: int, d_model: int, base: int) -> torch.Tensor:
    """Seed 004's variation with 1-based dims and positions and base T (the model's max length):
    P[t, 2i] = cos(t / T^(2i/D)), P[t, 2i-1] = sin(t / T^(2i/D)), i = 1..D/2, t = 1..T.
    0-based: row r has t = r + 1; column 2m holds sin, column 2m+1 cos, with i = m + 1."""
    t = torch.arange(1, n_positions + 1, dtype=torch.float64)[:, None]  # (T, 1)
    i = torch.arange(1, d_model // 2 + 1, dtype=torch.float64)  # (D/2,)
    angle = t / torch.pow(float(base), 2 * i / d_model)  # (T, D/2)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


def rope_inverse_frequencies(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """The rotary frequencies f_i = theta^(-2i/d), i = 0..d/2-1, d = d_qk, in fp32 (SPEC section
    11), computed as transformers computes them (so an imported model's angles are its own).

    llama3 scaling (Llama 3.1/3.2) keeps the fast frequencies, whose wavelength 2 pi / f_i is
    below original_max_seq_len / high_freq_factor, divides the slow ones, whose wavelength is
    above original_max_seq_len / low_freq_factor, by `factor`, and in between interpolates:
    (1 - s) f / factor + s f with s = (original_max_seq_len / wavelength - low) / (high - low)."""
    d = model_dims(cfg).d_qk
    inv_freq = 1.0 / (
        cfg.positions.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d)
    )  # (d/2,)
    scaling = cfg.positions.rope_scaling
    if scaling.kind == "none":
        return inv_freq
    old_context = scaling.original_max_seq_len
    wavelength = 2 * math.pi / inv_freq  # (d/2,)
    low_freq_wavelength = old_context / scaling.low_freq_factor
    high_freq_wavelength = old_context / scaling.high_freq_factor
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(
    cfg: ModelConfig,
    positions: torch.Tensor,  # (T,) or (B, T) token positions
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: (T, d) or (B, T, d), d = d_qk
    """cos and sin of the angles p * f_i, each repeated for both dimensions of pair i (i and
    i + d/2: the half-split layout), in fp32, then rounded to the model's dtype."""
    inv_freq = rope_inverse_frequencies(cfg, positions.device)  # (d/2,)
    angles = positions[..., None].float() * inv_freq  # (..., d/2)
    both = torch.cat((angles, angles), dim=-1)  # (..., d)
    return both.cos().to(dtype), both.sin().to(dtype)


class Positions(nn.Module):
    """Position information (SPEC sections 2 and 11): the additive P[start:start+T], or the
    rotary tables (`rotation`) with nothing added, or nothing at all."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.kind = cfg.positions.kind
        self.max_len = cfg.max_seq_len
        if self.kind in ("none", "rotary"):
            self.table = None
            return
        if self.kind == "learned":
            table = torch.zeros(cfg.max_seq_len, cfg.d_model)  # filled by Transformer.reset_parameters
            trainable = True
        elif self.kind == "sinusoidal":
            table = sinusoidal_table(cfg.max_seq_len, cfg.d_model, cfg.positions.origin)
            trainable = cfg.positions.trainable
        else:  # fourier_T
            table = fourier_t_table(cfg.max_seq_len, cfg.d_model, base=cfg.max_seq_len)
            trainable = cfg.positions.trainable
        if trainable:
            self.table = nn.Parameter(table)  # (T_max, D)
        else:
            self.register_buffer("table", table, persistent=True)

    def forward(self, start: int, length: int) -> torch.Tensor | None:  # (T, D) or None
        """P[start : start + length] to add to the embeddings; None without a table (rotary and
        none), after checking that a rotary model's window holds the positions."""
        if self.kind == "none":
            return None
        if start + length > self.max_len:
            raise ValueError(
                f"sequence of {start + length} positions exceeds model.max_seq_len={self.max_len}"
            )
        return None if self.table is None else self.table[start : start + length]

    def per_row(
        self, positions: torch.Tensor, checked: bool = True
    ) -> torch.Tensor | None:  # (B, T) -> (B, T, D) or None
        """P[positions[b, t]]: every row numbered on its own (a left-padded batch). checked=False
        (a compiled decode step, which must not read values back to the host) clamps to the
        table's last row instead of checking (StaticKVCache's docstring says when that happens)."""
        if self.kind == "none":
            return None
        if not checked:
            return None if self.table is None else self.table[positions.clamp_max(self.max_len - 1)]
        if int(positions.max()) >= self.max_len:
            raise ValueError(
                f"sequence of {int(positions.max()) + 1} positions exceeds model.max_seq_len={self.max_len}"
            )
        return None if self.table is None else self.table[positions]

    def rotation(
        self,
        span: CacheSpan,
        length: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # cos, sin: (T, d) or (B, T, d); None unless rotary
        """The rotary tables of the next `length` tokens of `span` (their positions: start + i, or
        each row's own). The window was checked by forward / per_row; a static cache's clamped
        positions need no clamping here (any position has angles)."""
        if self.kind != "rotary":
            return None
        if span.row_positions is None:
            positions = torch.arange(span.start, span.start + length, device=device)  # (T,)
        else:
            positions = span.row_positions  # (B, T)
        return rotary_tables(self.cfg, positions, dtype)


# ----------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """attn(X) = sum_h softmax(scale * (X Wq_h + cq)(X Wk_h + ck)^T + M) (X Wv_h + cv) Wo_h + bo.

    The per-head projections are stored fused (one GEMM for Q, K and V): rows
    [0, H*d_qk) of `w_qkv` are the queries, then the keys, then the values; head h uses the
    h-th block of each. Summing head_h Wo_h over heads equals concat(heads) Wo.

    Grouped-query attention (SPEC section 11): Hkv = n_kv_heads key/value heads, query head h
    reading key/value head h // (H / Hkv); the keys' and values' rows of `w_qkv` are Hkv blocks.
    QK-norm RMS-normalises each query and key head (one gain of width d_qk each) before the
    rotary positions turn them.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dims = model_dims(cfg)
        self.n_heads, self.n_kv_heads, self.d_qk, self.d_vo = (
            cfg.n_heads,
            dims.n_kv_heads,
            dims.d_qk,
            dims.d_vo,
        )
        self.scale = dims.attention_scale
        self.causal = cfg.attention.causal
        self.softmax = cfg.attention.softmax
        self.kernels = cfg.kernels
        h, h_kv = cfg.n_heads, dims.n_kv_heads
        self.w_qkv = nn.Linear(cfg.d_model, h * dims.d_qk + h_kv * (dims.d_qk + dims.d_vo), bias=False)
        self.q_bias = nn.Parameter(torch.zeros(h * dims.d_qk)) if cfg.attention.q_bias else None
        self.k_bias = nn.Parameter(torch.zeros(h_kv * dims.d_qk)) if cfg.attention.k_bias else None
        self.v_bias = nn.Parameter(torch.zeros(h_kv * dims.d_vo)) if cfg.attention.v_bias else None
        qk_norm = cfg.attention.qk_norm
        self.q_norm = Norm(cfg, width=dims.d_qk, formula="rms") if qk_norm else None
        self.k_norm = Norm(cfg, width=dims.d_qk, formula="rms") if qk_norm else None
        self.w_o = nn.Linear(h * dims.d_vo, cfg.d_model, bias=cfg.attention.o_bias)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        h, h_kv, d_qk, d_vo = self.n_heads, self.n_kv_heads, self.d_qk, self.d_vo
        q, k, v = self.w_qkv(x).split([h * d_qk, h_kv * d_qk, h_kv * d_vo], dim=-1)  # (B, T, heads*d)
        if self.q_bias is not None:
            q = q + self.q_bias
        if self.k_bias is not None:
            k = k + self.k_bias
        if self.v_bias is not None:
            v = v + self.v_bias
        q = q.view(b, t, h, d_qk)  # (B, T, H, d_qk)
        k = k.view(b, t, h_kv, d_qk)  # (B, T, Hkv, d_qk)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(b, t, h_kv, d_vo)  # (B, T, Hkv, d_vo)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, d)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, D)
        cache: KVCache | StaticKVCache | None = None,
        layer: int = 0,
        key_mask: torch.Tensor | None = None,  # (B, Tk) bool, False at padding (Transformer.forward)
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin (Positions.rotation)
        documents: torch.Tensor | None = None,  # (B, T) document ids of packed rows
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x)  # (B, H, T, d_qk), (B, Hkv, T, d_qk), (B, Hkv, T, d_vo)
        if rope is not None:
            q, k = ops.rotary(q, k, *rope, kernels=self.kernels)
        query_slots = None
        if cache is not None:
            k, v = cache.store(layer, k, v)  # (B, Hkv, Tk, d): every key the new tokens may attend to
            query_slots = cache.query_slots
        heads = self.attend(q, k, v, key_mask, query_slots, documents)  # (B, H, T, d_vo)
        heads = heads.transpose(1, 2).reshape(b, t, self.n_heads * self.d_vo)  # (B, T, H*d_vo)
        return self.w_o(heads)  # (B, T, D)

    def attend(
        self,
        q: torch.Tensor,  # (B, H, Tq, d_qk)
        k: torch.Tensor,  # (B, Hkv, Tk, d_qk)
        v: torch.Tensor,  # (B, Hkv, Tk, d_vo)
        key_mask: torch.Tensor | None = None,
        query_slots: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (B, H, Tq, d_vo)
        """The attention of projected heads with this layer's settings (ops.attention). Parallelism
        applied from outside may wrap it per instance (lmsys.engine.sequence_parallel)."""
        return ops.attention(
            q,
            k,
            v,
            causal=self.causal,
            scale=self.scale,
            kernels=self.kernels,
            softmax=self.softmax,
            key_mask=key_mask,
            query_slots=query_slots,
            documents=documents,
        )


# ----------------------------------------------------------------------------- feed-forward

ACTIVATIONS = ops.ACTIVATIONS


class FeedForward(nn.Module):
    """ffn(x) = W_out phi(... phi(W_1 x + b_1) ...) + b_out: activations on hidden layers only
    (seed 000's definition 2.1). With bias_after_activation (seed 002) each hidden bias is added
    after the activation instead: W_out (phi(W_1 x) + b_1) + b_out. Gated (SPEC section 11):
    W_out (phi(W_gate x + b_gate) * (W_1 x + b_1)) + b_out, with W_1 the "up" projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d_ff = model_dims(cfg).d_ff
        fcfg = cfg.ffn
        self.activation, self.kernels = fcfg.activation, cfg.kernels
        self.act = ACTIVATIONS[fcfg.activation]
        self.gate = nn.Linear(cfg.d_model, d_ff, bias=fcfg.bias) if fcfg.gated else None
        self.bias_after_activation = fcfg.bias_after_activation and fcfg.bias
        widths = [cfg.d_model] + [d_ff] * fcfg.n_hidden_layers
        self.hidden = nn.ModuleList(
            nn.Linear(w_in, w_out, bias=fcfg.bias and not self.bias_after_activation)
            for w_in, w_out in zip(widths[:-1], widths[1:])
        )
        self.hidden_bias_after = (
            nn.ParameterList(nn.Parameter(torch.zeros(d_ff)) for _ in self.hidden)
            if self.bias_after_activation
            else None
        )
        self.out = nn.Linear(d_ff, cfg.d_model, bias=fcfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        if self.gate is not None:  # one hidden layer (validate_model)
            hidden = ops.gated(
                self.gate(x), self.hidden[0](x), activation=self.activation, kernels=self.kernels
            )
            return self.out(hidden)  # (B, T, D)
        for i, layer in enumerate(self.hidden):
            x = self.act(layer(x))  # (B, T, d_ff)
            if self.hidden_bias_after is not None:
                x = x + self.hidden_bias_after[i]
        return self.out(x)


# ----------------------------------------------------------------------------- normalisation


class Norm(nn.Module):
    """Row-wise normalisation over D with one of SPEC section 5's formulas, optional affine; the
    "rms" formula (section 11) has a gain and no bias. `width` and `formula` other than the
    model's: QK-norm, RMS over each head's d_qk dimensions."""

    def __init__(self, cfg: ModelConfig, width: int | None = None, formula: str | None = None) -> None:
        super().__init__()
        self.formula, self.eps, self.kernels = formula or cfg.norm.formula, cfg.norm.eps, cfg.kernels
        width = width or cfg.d_model
        affine = cfg.norm.affine and self.formula != "none"
        self.weight = nn.Parameter(torch.ones(width)) if affine else None
        self.bias = nn.Parameter(torch.zeros(width)) if affine and self.formula != "rms" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(
            x, self.weight, self.bias, eps=self.eps, formula=self.formula, kernels=self.kernels
        )

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N(x + residual), x + residual), fused into one kernel on GPU."""
        return ops.add_layer_norm(
            x, residual, self.weight, self.bias, eps=self.eps, formula=self.formula, kernels=self.kernels
        )


# ----------------------------------------------------------------------------- blocks


class Block(nn.Module):
    """One residual block in the arrangement of SPEC section 6:
    none      Y = X + attn(X);          X' = Y + ffn(Y)            (seed 000)
    pre       Y = X + attn(N1(X));      X' = Y + ffn(N2(Y))        (seed 001, GPT-2)
    post      Y = N1(X + attn(X));      X' = N2(Y + ffn(Y))        (seeds 002, 004)
    parallel  X' = X + attn(N(X)) + ffn(N(X))                      (seed 000, remark 4.1)
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.arrangement = cfg.block
        self.attn = Attention(cfg)
        self.ffn = FeedForward(cfg)
        self.norm1 = Norm(cfg) if cfg.block in ("pre", "post", "parallel") else None
        self.norm2 = Norm(cfg) if cfg.block in ("pre", "post") else None

    def forward(
        self,
        x: torch.Tensor,  # (B, T, D)
        cache: KVCache | StaticKVCache | None = None,
        layer: int = 0,
        key_mask: torch.Tensor | None = None,  # (B, Tk) bool, False at padding
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # rotary cos, sin (Positions.rotation)
        documents: torch.Tensor | None = None,  # (B, T) document ids of packed rows
    ) -> torch.Tensor:
        if self.arrangement == "none":
            y = x + self.attn(x, cache, layer, key_mask, rope, documents)
            return y + self.ffn(y)
        if self.arrangement == "pre":
            assert self.norm1 is not None and self.norm2 is not None
            normed, y = self.norm2.add_norm(
                self.attn(self.norm1(x), cache, layer, key_mask, rope, documents), x
            )  # y = X + attn
            return y + self.ffn(normed)
        if self.arrangement == "post":
            assert self.norm1 is not None and self.norm2 is not None
            y, _ = self.norm1.add_norm(self.attn(x, cache, layer, key_mask, rope, documents), x)
            out, _ = self.norm2.add_norm(self.ffn(y), y)
            return out
        assert self.norm1 is not None  # parallel
        normed = self.norm1(x)
        return x + self.attn(normed, cache, layer, key_mask, rope, documents) + self.ffn(normed)


# ----------------------------------------------------------------------------- unembedding


class Unembedding(nn.Linear):
    """W_une (V, D) and its optional bias: hidden states (..., D) -> logits (..., V); or, given
    targets, the loss of SPEC section 8 straight from the hidden states (`model.loss_impl`):
    fused / chunked never materialise the (tokens, V) logits, full is logits then cross-entropy.

    The loss is computed inside this module's forward, like the logits, so that DeepSpeed ZeRO-3
    gathers the weight (the tied embedding included) around it and routes its gradient back to
    the weight's partition. Its parameters are nn.Linear's: `unembed.weight`, `unembed.bias`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.d_model, cfg.vocab_size, bias=cfg.unembed_bias)
        self.loss_impl, self.kernels = cfg.loss_impl, cfg.kernels

    def forward(
        self,
        x: torch.Tensor,  # (B, S, D)
        targets: torch.Tensor | None = None,  # (B, S)
        weights: torch.Tensor | None = None,  # (B, S)
    ) -> torch.Tensor:  # logits (B, S, V), or the 0-dim loss given targets
        if targets is None:
            return super().forward(x)
        if self.loss_impl == "full":
            return weighted_next_token_loss(super().forward(x), targets, weights)
        return ops.linear_cross_entropy(
            x, self.weight, targets, weights, self.bias, loss_impl=self.loss_impl, kernels=self.kernels
        )


# ----------------------------------------------------------------------------- the stack


def _as_model_config(cfg: ModelConfig | DictConfig | dict) -> ModelConfig:
    if isinstance(cfg, ModelConfig):
        validate_model(cfg)
        return cfg
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, ModelConfig)
    validate_model(obj)
    return obj


class Transformer(nn.Module):
    """logits = Unembed(FinalNorm?(Blocks(W_emb[ids] + P))) for ids (B, T) -> (B, T, V)."""

    def __init__(self, cfg: ModelConfig | DictConfig | dict) -> None:
        super().__init__()
        self.cfg = cfg = _as_model_config(cfg)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)  # W_emb: (V, D)
        self.positions = Positions(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = Norm(cfg) if cfg.final_norm else None
        self.unembed = Unembedding(cfg)  # W_une^T: (V, D)
        if cfg.tied_embeddings:
            self.unembed.weight = self.tok_emb.weight  # W_une = W_emb^T
        self.reset_parameters()

    # -- initialisation ---------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's scheme, which trains every preset stably (the no-norm seed_gpt included):
        weights ~ N(0, init_std), biases 0, norm gains 1; the projections that write into the
        residual stream (attention output, last FFN layer) ~ N(0, init_std / sqrt(2 L)) so the
        stream's variance stays O(1) with depth. Learned positions ~ N(0, init_std); sinusoidal
        and fourier_T tables keep their formula values (seed 001: a trainable PE initialised so).
        """
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
        for block in self.blocks:
            nn.init.normal_(block.attn.w_o.weight, 0.0, residual_std)
            nn.init.normal_(block.ffn.out.weight, 0.0, residual_std)
        for name, param in self.named_parameters():
            if name.endswith("_bias") or ".hidden_bias_after." in name:
                nn.init.zeros_(param)
        if self.cfg.positions.kind == "learned":
            nn.init.normal_(self.positions.table, 0.0, std)
        if self.cfg.tied_embeddings:  # the Linear loop above re-drew the shared matrix
            nn.init.normal_(self.tok_emb.weight, 0.0, std)

    # -- forward ------------------------------------------------------------------------------

    def forward(
        self,
        ids: torch.Tensor,  # (B, T) LongTensor
        cache: KVCache | StaticKVCache | None = None,
        mask: torch.Tensor | None = None,  # (B, T) bool: False at padding
        documents: torch.Tensor | None = None,  # (B, T) int: each token's document, non-decreasing
    ) -> torch.Tensor:  # (B, T, V)
        """Logits of every position. With a cache, ids are the next T tokens after the cache's
        slots and their keys/values are appended to it.

        A padded batch (rows of different lengths, e.g. prompts padded on the left) passes `mask`,
        False at the padding: a token's position is then the number of real tokens before it in
        its row (the cache remembers the earlier slots' mask), and attention hides the padding,
        so each row computes what it computes alone (up to float rounding: README, "Generation").
        Without a mask every token is real.

        Rows packed with several documents pass `documents`, each token's document (integers,
        non-decreasing along a row): a token then attends only to the earlier tokens of its
        document, and its position counts from its document's first token, so each document
        computes what it computes alone (no cache, no mask)."""
        return self.unembed(self.hidden_states(ids, cache, mask, documents))  # (B, T, V)

    def hidden_states(
        self,
        ids: torch.Tensor,  # (B, T) LongTensor
        cache: KVCache | StaticKVCache | None = None,
        mask: torch.Tensor | None = None,  # (B, T) bool: False at padding
        documents: torch.Tensor | None = None,  # (B, T) int: each token's document (forward)
    ) -> torch.Tensor:  # (B, T, D)
        """The last hidden states: everything `forward` does before the unembedding."""
        if ids.dim() != 2:
            raise ValueError(f"expected token ids of shape (B, T), got {tuple(ids.shape)}")
        t = ids.shape[1]
        if documents is not None:
            check_documents(documents, ids, cache, mask)
            span = document_span(documents)  # (its positions need no check: compiles whole)
        else:
            span = cache.begin(mask, t) if cache is not None else uncached_span(mask, t)
        return self.span_states(ids, span, cache)

    def span_states(
        self,
        ids: torch.Tensor,  # (B, t) LongTensor
        span: CacheSpan,
        cache: KVCache | StaticKVCache | None = None,
    ) -> torch.Tensor:  # (B, t, D)
        """The last hidden states of `ids` standing where `span` says: their positions (span.start + i,
        or span.row_positions) and what they attend to (span.key_mask, span.documents). hidden_states
        resolves the span of whole rows, a padded batch or a cache's next tokens; a part of longer
        rows has its own (kv_cache.row_part_span)."""
        t = ids.shape[1]
        x = self.tok_emb(ids)  # (B, t, D)
        if span.documents is not None:
            # the whole rows' window: its check (a document's positions are below it) and, through
            # the module's call, ZeRO-3's gather of the table that per_row reads
            self.positions(0, span.documents.shape[1])
        if span.row_positions is None:
            pos = self.positions(span.start, t)  # (t, D)
        else:  # every row numbered on its own
            pos = self.positions.per_row(span.row_positions, checked=not span.clamped)  # (B, t, D)
        if pos is not None:
            x = x + pos.to(x.dtype)
        rope = self.positions.rotation(span, t, x.dtype, x.device)  # (cos, sin) of rotary models
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer, span.key_mask, rope, span.documents)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if cache is not None:
            cache.advance(t)
        return x  # (B, t, D)

    def loss(
        self,
        tokens: torch.Tensor,  # (B, S)
        weights: torch.Tensor | None = None,  # (B, S) in [0, 1]
        documents: torch.Tensor | None = None,  # (B, S) int: each token's document, non-decreasing
    ) -> torch.Tensor:  # 0-dim
        """Causal LM loss (SPEC section 8) on tokens (B, S) with loss weights (B, S) in [0, 1]:
        the whole batch's weighted mean -sum(w logp) / sum(w) of the `next_token_pairs`, computed
        as model.loss_impl says (the same function; fused and chunked without the logits). With
        `documents` (packed rows, see forward) only the pairs inside a document count: each
        document's loss is the loss it has alone."""
        inputs, targets, target_weights = next_token_pairs(self.cfg, tokens, weights, documents)
        input_documents = next_token_documents(self.cfg, documents)
        return self.unembed(self.hidden_states(inputs, documents=input_documents), targets, target_weights)

    # -- accounting ---------------------------------------------------------------------------

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Distinct parameters (a tied matrix counts once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def matmul_parameters(self) -> int:
        """Parameters that take part in a matrix multiply per token: all but the position table
        and, when untied, the input embedding (a lookup). This is N in the FLOPs formula."""
        n = self.num_parameters()
        if isinstance(self.positions.table, nn.Parameter):
            n -= self.positions.table.numel()
        if not self.cfg.tied_embeddings:
            n -= self.tok_emb.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, PaLM appendix B: 6 N + 12 L H d T, with the attention term
        written for independent widths as 6 L H (d_qk + d_vo) T (equal to 12 L H d T)."""
        dims = model_dims(self.cfg)
        attention = 6 * self.cfg.n_layers * self.cfg.n_heads * (dims.d_qk + dims.d_vo) * seq_len
        return 6 * self.matmul_parameters() + attention


# ----------------------------------------------------------------------------- the objective
#
# The one place that knows seed 001's `bos_shift`: such a model reads [bos_shift_id] + tokens[:-1]
# and predicts every token, where the usual objective reads tokens[:-1] and predicts tokens[1:].


def next_token_pairs(
    cfg: ModelConfig,
    tokens: torch.Tensor,  # (B, S)
    weights: torch.Tensor | None = None,  # (B, S): weights[b, s] weighs the prediction OF tokens[b, s]
    documents: torch.Tensor | None = None,  # (B, S): each token's document (packed rows)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, targets, target weights) of a batch of token sequences: predict tokens[:, 1:]
    from tokens[:, :-1] (weights[:, 0] unused), or under bos_shift every token from
    [bos_shift_id] + tokens[:, :-1].

    With `documents`, each document is its own sequence: a pair whose input ends one document and
    whose target starts the next has weight 0, and under bos_shift a document's first token is
    read after bos_shift_id (not after the previous document's last token) and predicted."""
    prefix = context_prefix(cfg)
    if prefix:
        bos = torch.full_like(tokens[:, :1], prefix[0])
        inputs = torch.cat([bos, tokens[:, :-1]], dim=1)  # (B, S)
        if documents is not None:
            inputs = torch.where(document_starts(documents), prefix[0], inputs)
        return inputs, tokens, weights  # (B, S) each
    target_weights = weights[:, 1:] if weights is not None else None  # (B, S-1)
    if documents is not None:
        inside = (documents[:, 1:] == documents[:, :-1]).to(torch.float32)  # (B, S-1)
        target_weights = inside if target_weights is None else target_weights * inside
    return tokens[:, :-1], tokens[:, 1:], target_weights  # (B, S-1)


def next_token_documents(cfg: ModelConfig, documents: torch.Tensor | None) -> torch.Tensor | None:
    """The documents of next_token_pairs' inputs: documents[:, :-1], or all of them under bos_shift."""
    if documents is None or context_prefix(cfg):
        return documents
    return documents[:, :-1]  # (B, S-1)


def check_documents(
    documents: torch.Tensor,
    ids: torch.Tensor,
    cache: KVCache | StaticKVCache | None,
    mask: torch.Tensor | None,
) -> None:
    """ValueError unless `documents` names a document for each token of `ids`, non-decreasing
    along each row, in a forward without a cache or a padding mask. The order is not checked
    under torch.compile (it reads the tensor back: a graph break)."""
    if cache is not None or mask is not None:
        raise ValueError(
            "documents describe whole packed rows: a forward with documents takes no cache or mask"
        )
    if documents.shape != ids.shape:
        raise ValueError(
            f"documents must have the ids' shape {tuple(ids.shape)}, got {tuple(documents.shape)}"
        )
    if documents.dtype.is_floating_point or documents.dtype.is_complex or documents.dtype == torch.bool:
        raise ValueError(f"documents must hold integer ids, got {documents.dtype}")
    if not torch.compiler.is_compiling() and bool((documents[:, 1:] < documents[:, :-1]).any()):
        raise ValueError("documents must be non-decreasing along each row (each document one run of tokens)")


def weighted_next_token_loss(
    logits: torch.Tensor,  # (B, S, V)
    targets: torch.Tensor,  # (B, S)
    weights: torch.Tensor | None = None,  # (B, S)
) -> torch.Tensor:
    """-sum(w * log p(target)) / sum(w) over the whole batch (not the mean of per-row means).
    All-zero weights give 0 (and zero gradients) rather than 0/0."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # the log-sum-exp over V needs fp32
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(
        targets
    )  # (B, S)
    if weights is None:
        return nll.mean()
    weights = weights.to(nll.dtype)
    return (weights * nll).sum() / weights.sum().clamp_min(torch.finfo(nll.dtype).tiny)
