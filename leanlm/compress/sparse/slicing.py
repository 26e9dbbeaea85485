"""The math of structured pruning, on tensors and single modules: importance scores, which units to keep, and
cutting a block's projections down to them. The glue that walks a model is in structured.py."""

from __future__ import annotations

import torch
from torch import nn

from leanlm.models.config import ModelConfig


def param_count(cfg: ModelConfig) -> int:
    """Parameters of a Transformer with this config: embedding, lm_head (once if tied), norms, projections."""
    d, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
    block = 2 * d + d * qkv + (qkv if cfg.qkv_bias else 0) + cfg.q_size * d + 3 * d * cfg.intermediate_size
    return cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2) + cfg.num_layers * block + d


def select_top(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the `keep` highest scores, in ascending index order (the kept units keep their order;
    ties go to the lower index)  # [N] -> [keep]"""
    order = torch.sort(scores.double(), descending=True, stable=True).indices
    return order[:keep].sort().values


def kv_group_scores(o_weight: torch.Tensor, xtx: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Energy of each KV group's share of the attention output, sum_t ||W_o[:, g] a_t[g]||^2, from o_proj's
    weight [d, H*D] and the Gram matrix X^T X [H*D, H*D] of its inputs (the heads' outputs a_t).

    Removing group g (a KV head with its G query heads) takes exactly W_o[:, g] a_t[g] out of every token's
    attention output, so this is the squared error that removing it alone adds to the block; it accounts for
    both how active the heads are and how much o_proj amplifies them. = trace(W_g^T W_g X_g^T X_g)  # [n_kv]"""
    W = o_weight.double()
    width = W.shape[1] // n_kv  # G * D columns per group
    return torch.stack([((W[:, s] @ xtx.double()[s, s]) * W[:, s]).sum()
                        for s in (slice(g * width, (g + 1) * width) for g in range(n_kv))])


def neuron_contribution(down_weight: torch.Tensor, h_norm: torch.Tensor) -> torch.Tensor:
    """||down[:, j]||_2 * ||h_j||_2 over calibration tokens: the norm of what removing neuron j alone takes out
    of the MLP output (a structured Wanda score, https://arxiv.org/abs/2306.11695)  # [d, I], [I] -> [I]"""
    return down_weight.double().norm(dim=0) * h_norm.double()


def merge_redundant(gram: torch.Tensor, down_weight: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedily drop the neuron that another kept one best stands in for, folding it into that twin: with
    h_i ~ a h_j over the calibration tokens, down[:, i] h_i ~ (a down[:, i]) h_j, so down[:, j] += a down[:, i],
    a = <h_i, h_j> / <h_j, h_j> (least squares). What the fold leaves out of the MLP output is exactly
    ||down[:, i]||^2 ||h_i||^2 (1 - cos^2(h_i, h_j)), and the neuron (with its most collinear partner) of least
    such error goes first: a duplicate (cos = 1) or a near-zero neuron costs nothing. Ranking by collinearity
    alone would, once the real duplicates are gone, drop strong neurons that are merely the "most" collinear.

    gram: H^T H of the activations act(gate) * up  # [I, I]; down_weight [d, I]
    -> (kept indices [keep] ascending, down weight [d, I] with the merges folded in, float32)"""
    G, W = gram.double(), down_weight.double().clone()
    I = G.shape[0]
    sq = G.diagonal().clamp_min(1e-30)  # ||h_j||^2
    cos = G / sq.sqrt()[:, None] / sq.sqrt()[None, :]
    cos = cos.abs().fill_diagonal_(float("-inf"))
    best, partner = cos.max(1)  # each neuron's most collinear other neuron
    energy = W.square().sum(0) * sq  # ||down_j||^2 ||h_j||^2: what dropping j without a fold would lose
    alive = torch.ones(I, dtype=torch.bool)
    for _ in range(I - keep):
        cost = torch.where(alive, (1 - best.clamp(max=1).square()) * energy, torch.inf)
        drop = int(cost.argmin())
        twin = int(partner[drop])
        W[:, twin] += G[drop, twin] / sq[twin] * W[:, drop]
        energy[twin] = W[:, twin].square().sum() * sq[twin]
        alive[drop] = False
        cos[:, drop] = float("-inf")
        stale = alive & (partner == drop)  # neurons whose best partner just went: look again (rarely many)
        if stale.any():
            best[stale], partner[stale] = cos[stale].max(1)
    return alive.nonzero().squeeze(1), W.float()


def block_influence(x_in: torch.Tensor, x_out: torch.Tensor) -> torch.Tensor:
    """ShortGPT's block influence 1 - cos(x_in, x_out) of every token (https://arxiv.org/abs/2403.03853):
    near 0 where the block barely turns the residual stream  # [..., d], [..., d] -> [...]"""
    return 1 - torch.nn.functional.cosine_similarity(x_in.float(), x_out.float(), dim=-1)


def _cut(linear: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None,
         weight: torch.Tensor | None = None) -> None:
    """Keep these output rows / input columns of a Linear in place (weight: replace it first, e.g. merged)."""
    w = linear.weight if weight is None else weight.to(linear.weight)
    if rows is not None:
        w = w[rows]
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=linear.bias.requires_grad)
    if cols is not None:
        w = w[:, cols]
    linear.weight = nn.Parameter(w.contiguous(), requires_grad=linear.weight.requires_grad)
    linear.out_features, linear.in_features = w.shape


def slice_attention(attn: nn.Module, kv_keep: torch.Tensor) -> None:
    """Keep the KV heads `kv_keep` [k] of an Attention with their query heads (query head h reads KV head
    h // G, as in transformers' repeat_kv), cutting the fused q/k/v rows and the o_proj columns in place."""
    H, Hkv, D = attn.n_heads, attn.n_kv, attn.head_dim
    G = H // Hkv
    kv_keep = kv_keep.to(torch.long)
    q_heads = (kv_keep[:, None] * G + torch.arange(G)).flatten()  # [k * G]
    dims = torch.arange(D)
    q_rows = (q_heads[:, None] * D + dims).flatten()
    kv_rows = (kv_keep[:, None] * D + dims).flatten()
    _cut(attn.qkv_proj, rows=torch.cat([q_rows, H * D + kv_rows, (H + Hkv) * D + kv_rows]))
    _cut(attn.o_proj, cols=q_rows)
    attn.n_heads, attn.n_kv = len(q_heads), len(kv_keep)


def slice_mlp(mlp: nn.Module, keep: torch.Tensor, down_weight: torch.Tensor | None = None) -> None:
    """Keep the neurons `keep` [k] of a SwiGLU MLP: rows of gate and up (fused [2I, d]), columns of down
    (down_weight [d, I]: use this down weight, e.g. with redundant neurons merged in)."""
    I = mlp.down_proj.in_features
    keep = keep.to(torch.long)
    _cut(mlp.gate_up_proj, rows=torch.cat([keep, I + keep]))
    _cut(mlp.down_proj, cols=keep, weight=down_weight)

