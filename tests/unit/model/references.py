"""Independent references written from the seed documents' equations, in float64.

Each reference reads the weights out of a `Transformer` as the matrices the document names
(W_QK, W_OV, W^Q_i, A, K, B, L, ...) and then evaluates the document's formula with plain loops
and einsum, without calling any lmsys module code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- weight extraction


@dataclass
class HeadWeights:
    wq: Tensor  # (D, d_qk): Q = X wq
    wk: Tensor  # (D, d_qk)
    wv: Tensor  # (D, d_vo)
    wo: Tensor  # (d_vo, D): head contribution = head wo
    cq: Tensor | None
    ck: Tensor | None
    cv: Tensor | None


def heads_of(attn) -> list[HeadWeights]:
    h, d_qk, d_vo = attn.n_heads, attn.d_qk, attn.d_vo
    w = attn.w_qkv.weight.detach()  # (H*(2 d_qk + d_vo), D)
    wq_all, wk_all, wv_all = w.split([h * d_qk, h * d_qk, h * d_vo], dim=0)
    wo_all = attn.w_o.weight.detach().T  # (H*d_vo, D)

    def part(t: Tensor | None, i: int, d: int) -> Tensor | None:
        return None if t is None else t.detach()[i * d : (i + 1) * d]

    return [
        HeadWeights(
            wq=wq_all[i * d_qk : (i + 1) * d_qk].T,
            wk=wk_all[i * d_qk : (i + 1) * d_qk].T,
            wv=wv_all[i * d_vo : (i + 1) * d_vo].T,
            wo=wo_all[i * d_vo : (i + 1) * d_vo],
            cq=part(attn.q_bias, i, d_qk),
            ck=part(attn.k_bias, i, d_qk),
            cv=part(attn.v_bias, i, d_vo),
        )
        for i in range(h)
    ]


def linear(layer) -> tuple[Tensor, Tensor | None]:
    """(W, b) with y = W x + b for column vectors x: torch stores exactly W."""
    return layer.weight.detach(), None if layer.bias is None else layer.bias.detach()


def embeddings(model, ids: Tensor) -> Tensor:
    """X0[t] = W_emb[s_t] + P[t] for one sequence of ids (T,) -> (T, D)."""
    w_emb = model.tok_emb.weight.detach()
    x = torch.stack([w_emb[int(s)] for s in ids])
    if model.positions.table is not None:
        x = x + model.positions.table.detach()[: len(ids)]
    return x


def relu(x: Tensor) -> Tensor:
    return torch.where(x > 0, x, torch.zeros_like(x))


def softmax_vector(z: Tensor) -> Tensor:
    """exp(z_n) / sum exp(z_m), with exp(-inf) = 0."""
    m = z[torch.isfinite(z)].max()
    e = torch.exp(z - m)
    return e / e.sum()


# ----------------------------------------------------------------------------- seed 000


def seed000_logits(model, ids: Tensor) -> Tensor:
    """Seed 000: X -> X + sum_h A^h(X) X W_OV^{hT} with A^h = softmax*(X W_QK^h X^T) (causal,
    row-wise, no 1/sqrt(d)), W_QK = W_Q^T W_K, W_OV = W_O W_V; then X -> X + m(X) with
    m(x) = W_2 ReLU(W_1 x + b_1) + b_2; block = ff o attn; logits = X W_U^T."""
    x = embeddings(model, ids)
    n = x.shape[0]
    for block in model.blocks:
        update = torch.zeros_like(x)
        for hw in heads_of(block.attn):
            # seed notation: W_Q, W_K: R^d -> R^dh are (dh x d); W_QK = W_Q^T W_K is (d x d)
            w_qk = hw.wq @ hw.wk.T  # (D, D)
            w_ov = (hw.wv @ hw.wo).T  # (D, D) = W_O W_V in the seed's orientation
            scores = x @ w_qk @ x.T  # (T, T) bilinear form <x_i, x_j>_h
            a = torch.zeros(n, n, dtype=x.dtype)
            for i in range(n):
                row = scores[i].clone()
                row[i + 1 :] = -math.inf
                a[i] = softmax_vector(row)
            update = update + a @ x @ w_ov.T
        x = x + update
        (w1, b1), (w2, b2) = linear(block.ffn.hidden[0]), linear(block.ffn.out)
        x = torch.stack([xt + w2 @ relu(w1 @ xt + b1) + b2 for xt in x])
    w_u = model.unembed.weight.detach()  # (V, D)
    return x @ w_u.T


# ----------------------------------------------------------------------------- seed 001


def standardize_then_affine(x: Tensor, a: Tensor, b: Tensor, eps: float) -> Tensor:
    """Seed 001: subtract the mean, divide by (std + eps), multiply by a, add b; std is the
    population standard deviation."""
    mean = x.sum() / x.numel()
    std = torch.sqrt(((x - mean) ** 2).sum() / x.numel())
    return (x - mean) / (std + eps) * a + b


def seed001_logits(model, ids: Tensor) -> Tensor:
    """Seed 001: T_LM = Phi o N o DB_L o ... o DB_1 o PE o Em with
    DB(X) = X + CA(N_ca(X)) + FF(X + CA(N_ca(X))), FF(X) = ReLU(N_ff(X) A + K) B + L,
    CA(X) = Concat_i(softmax(mask(Q_i K_i^T / sqrt(d_head))) V_i) W^O + B, Phi(X) = X Y + B."""
    eps = 1e-6  # "a constant embedded in the code"
    x = embeddings(model, ids)  # Em then PE: X + PE|n
    n = x.shape[0]

    def norm(layer, rows: Tensor) -> Tensor:
        a, b = layer.weight.detach(), layer.bias.detach()
        return torch.stack([standardize_then_affine(r, a, b, eps) for r in rows])

    for block in model.blocks:
        xn = norm(block.norm1, x)
        heads = []
        for hw in heads_of(block.attn):
            q, k, v = xn @ hw.wq, xn @ hw.wk, xn @ hw.wv
            d_head = hw.wq.shape[1]
            s = q @ k.T / math.sqrt(d_head)
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
            heads.append(torch.stack([softmax_vector(r) for r in s]) @ v)
        w_o = block.attn.w_o.weight.detach().T  # (d_model, d_model)
        ca = torch.cat(heads, dim=1) @ w_o + block.attn.w_o.bias.detach()
        y = x + ca
        w_a, k_bias = linear(block.ffn.hidden[0])
        w_b, l_bias = linear(block.ffn.out)
        ff = relu(norm(block.norm2, y) @ w_a.T + k_bias) @ w_b.T + l_bias
        x = y + ff
    x = norm(model.final_norm, x)
    y_w, y_b = linear(model.unembed)
    return x @ y_w.T + y_b


def seed001_loss(model, batch: Tensor, weights: Tensor) -> Tensor:
    """Seed 001's batch loss: X = (0, x_1..x_n), Y = LogSoftmax(T(X)|n), y_k = Y[k][x_k],
    loss = -sum_(j,i) w_ji y_ji / sum_(j,i) w_ji."""
    num = torch.zeros((), dtype=torch.float64)
    den = torch.zeros((), dtype=torch.float64)
    for row, w in zip(batch, weights):
        x = torch.cat([torch.zeros(1, dtype=row.dtype), row])
        t = seed001_logits(model, x)[: len(row)]
        for k in range(len(row)):
            logp = t[k] - torch.logsumexp(t[k], dim=0)
            num = num + w[k] * logp[int(row[k])]
            den = den + w[k]
    return -num / den


# ----------------------------------------------------------------------------- seed 002


def seed002_logits(model, ids: Tensor) -> Tensor:
    """Seed 002, position by position: x* = LN1(x_i + Attention_i(x)), x' = LN2(x* + FFN(x*)),
    Attention_i = W_O (AH_1 || ... || AH_H), AH = sum_j Weight(x_i, x_j) W_V x_j with
    Weight = exp(d_k^-1/2 Score) / sum, Score = -inf for masked j > i; LN = gamma (x - mu)/sigma
    + beta with sigma = sqrt(var) + eps; FFN = W_out (phi(W_in x) + b_in) + b_out; logits = U x."""
    eps = model.cfg.norm.eps
    x = [row for row in embeddings(model, ids)]
    n = len(x)

    def layer_norm(layer, z: Tensor) -> Tensor:
        mu = sum(z) / z.numel()
        sigma = math.sqrt(sum((zi - mu) ** 2 for zi in z) / z.numel()) + eps
        return layer.weight.detach() * (z - mu) / sigma + layer.bias.detach()

    for block in model.blocks:
        heads = heads_of(block.attn)
        w_o = block.attn.w_o.weight.detach()  # (d_M, H d_h)
        new_x = []
        for i in range(n):
            z_parts = []
            for hw in heads:
                d_k = hw.wq.shape[1]
                query = hw.wq.T @ x[i]
                scores = torch.tensor(
                    [float(query @ (hw.wk.T @ x[j])) if j <= i else -math.inf for j in range(n)],
                    dtype=torch.float64,
                )
                weight = softmax_vector(scores / math.sqrt(d_k))
                z_parts.append(sum(weight[j] * (hw.wv.T @ x[j]) for j in range(n)))
            x_star = layer_norm(block.norm1, x[i] + w_o @ torch.cat(z_parts))
            w_in = block.ffn.hidden[0].weight.detach()
            b_in = block.ffn.hidden_bias_after[0].detach()
            w_out, b_out = linear(block.ffn.out)
            ffn = w_out @ (relu(w_in @ x_star) + b_in) + b_out
            new_x.append(layer_norm(block.norm2, x_star + ffn))
        x = new_x
    u = model.unembed.weight.detach()  # (n_V, d_M)
    return torch.stack([u @ xi for xi in x])


# ----------------------------------------------------------------------------- seed 004


def seed004_logits(model, ids: Tensor, causal: bool) -> Tensor:
    """Seed 004: Y_t = LayerNorm(X_t + attn(X, X_t)), X_t = LayerNorm(Y_t + ffn(Y_t)) with
    attn(X, z) = sum_h softmax(z W_Q W_K^T X^T / sqrt(D_QK)) X W_V W_O^T, LayerNorm exact (no
    eps, no affine), ffn(z) = W2 ReLU(W1 z + b1) + b2, logits_t = X_t W_une.
    causal=True restricts X in attn(X, X_t) to the rows 1..t (lmsys's training use)."""
    x = embeddings(model, ids)
    n = x.shape[0]

    def layer_norm(z: Tensor) -> Tensor:
        mean = z.sum() / z.numel()
        var = ((z - mean) ** 2).sum() / z.numel()
        return (z - mean) / torch.sqrt(var)

    for block in model.blocks:
        heads = heads_of(block.attn)
        y = []
        for t in range(n):
            context = x[: t + 1] if causal else x
            z = x[t]
            attn = torch.zeros_like(z)
            for hw in heads:
                d_qk = hw.wq.shape[1]
                w_o_seed = hw.wo.T  # seed's W_O is (D_E x D_VO)
                scores = z @ hw.wq @ hw.wk.T @ context.T / math.sqrt(d_qk)
                attn = attn + softmax_vector(scores) @ context @ hw.wv @ w_o_seed.T
            y.append(layer_norm(x[t] + attn))
        (w1, b1), (w2, b2) = linear(block.ffn.hidden[0]), linear(block.ffn.out)
        x = torch.stack([layer_norm(yt + w2 @ relu(w1 @ yt + b1) + b2) for yt in y])
    w_une = model.unembed.weight.detach().T  # (D_E, V)
    return x @ w_une
