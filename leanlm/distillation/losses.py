"""Distillation losses: pure functions of the student's and the teacher's outputs, each with its formula.

Logits are [..., V] (any leading dims: batch, positions); `mask` [...] (true where a position counts) averages over
the positions it keeps. p is the teacher's distribution, q the student's, at temperature T: p = softmax(z_t / T),
q = softmax(z_s / T). The soft losses are multiplied by T², so that their gradients keep their size as T changes
(Hinton et al., arXiv 1503.02531). Sums run in float32 (float64 stays float64, for gradcheck).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _log_softmax(logits: torch.Tensor, T: float) -> torch.Tensor:
    return F.log_softmax(_float(logits) / T, dim=-1)


def _mean(per_position: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean over the positions `mask` keeps (all of them without one)."""
    if mask is None:
        return per_position.mean()
    mask = mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) = Σ a (log a − log b) along the last dim, from log-probabilities  # [...]"""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def _log_mix(log_a: torch.Tensor, log_b: torch.Tensor, weight: float) -> torch.Tensor:
    """log(w a + (1 − w) b), from log-probabilities, without leaving log space."""
    return torch.logaddexp(log_a + math.log(weight), log_b + math.log1p(-weight))


def hard_label(student: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy −log q(y) on labels y the teacher generated (sequence-level KD, Kim & Rush, arXiv 1606.07947).
    student [..., V], labels [...]"""
    return _mean(-_log_softmax(student, 1.0).gather(-1, labels[..., None])[..., 0], mask)


def soft_cross_entropy(student: torch.Tensor, teacher: torch.Tensor, T: float = 1.0,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """T² · H(p, q) = −T² Σ p log q: forward KL plus the teacher's entropy (same gradient, not zero at p = q)."""
    log_p, log_q = _log_softmax(teacher, T), _log_softmax(student, T)
    return T * T * _mean(-(log_p.exp() * log_q).sum(-1), mask)


def forward_kl(student: torch.Tensor, teacher: torch.Tensor, T: float = 1.0,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """T² · KL(p || q) = T² Σ p (log p − log q): mode-covering, the student spreads over all the teacher's modes."""
    if mask is None and student.requires_grad and not teacher.requires_grad:
        return _ForwardKL.apply(student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1]), T)
    return T * T * _mean(_kl(_log_softmax(teacher, T), _log_softmax(student, T)), mask)


class _ForwardKL(torch.autograd.Function):
    """forward_kl of rows [R, V] with no mask, its gradient T (q − p) / R found in the forward pass a few rows at a
    time, so that every pass over them stays in the cache: autograd's passes over a distillation chunk's logits
    ([85, 49152], 16 MB each) went to memory (32 ms a chunk against 14, Zen 4, 2 threads)."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, T: float) -> torch.Tensor:
        R = student.shape[0]
        grad = torch.empty_like(student, dtype=torch.promote_types(student.dtype, torch.float32))
        total = grad.new_zeros(())
        step = max(1, (1 << 18) // student.shape[1])  # 1 MiB of float32 logits
        for i in range(0, R, step):
            log_q, log_p = _log_softmax(student[i:i + step], T), _log_softmax(teacher[i:i + step], T)
            p = log_p.exp()
            total += (p * (log_p - log_q)).sum()
            torch.mul(log_q.exp_().sub_(p), T / R, out=grad[i:i + step])
        ctx.save_for_backward(grad)
        return total * (T * T / R)

    @staticmethod
    def backward(ctx, d_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * d_loss, None, None


def reverse_kl(student: torch.Tensor, teacher: torch.Tensor, T: float = 1.0,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """T² · KL(q || p) = T² Σ q (log q − log p): mode-seeking, the student settles on the teacher's main modes."""
    return T * T * _mean(_kl(_log_softmax(student, T), _log_softmax(teacher, T)), mask)


def jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float = 0.5, T: float = 1.0,
        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence (GKD, Agarwal et al., arXiv 2306.13649), with m = β p + (1 − β) q:
    JSD(β) = T² · (β KL(p || m) + (1 − β) KL(q || m)), β in (0, 1); β = 0.5 is the symmetric JSD."""
    if not 0 < beta < 1:
        raise ValueError(f"jsd's beta must be in (0, 1), got {beta}")
    log_p, log_q = _log_softmax(teacher, T), _log_softmax(student, T)
    log_m = _log_mix(log_p, log_q, beta)
    return T * T * _mean(beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m), mask)


def skew_kl(student: torch.Tensor, teacher: torch.Tensor, alpha: float = 0.1, reverse: bool = False,
            T: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Skew KL (DistiLLM, Ko et al., arXiv 2402.03898): T² · KL(p || α p + (1 − α) q); with reverse,
    skew reverse KL T² · KL(q || α q + (1 − α) p). α in [0, 1): α = 0 is the plain KL; a larger α bounds the
    loss and its gradient where q puts almost no mass on a token p likes."""
    if not 0 <= alpha < 1:
        raise ValueError(f"skew_kl's alpha must be in [0, 1), got {alpha}")
    log_p, log_q = _log_softmax(teacher, T), _log_softmax(student, T)
    if reverse:
        log_p, log_q = log_q, log_p
    return T * T * _mean(_kl(log_p, _log_mix(log_p, log_q, alpha) if alpha else log_q), mask)


def topk_kl(student: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, T: float = 1.0,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """T² · KL(p̂ || q̂) on the teacher's k largest logits alone (what a logit cache stores): p̂ = softmax(values / T)
    and q̂ = softmax(z_s[indices] / T), both renormalized over those k tokens. With k = V it is forward_kl.
    student [..., V]; values, indices [..., k] (the teacher's top-k logits and their token ids)"""
    log_p = _log_softmax(values, T)
    log_q = _log_softmax(student.gather(-1, indices), T)
    return T * T * _mean(_kl(log_p, log_q), mask)


def slim(student: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, labels: torch.Tensor, T: float = 1.0,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    """SLIM (Sparse Logit Infused Modeling, openreview.net/forum?id=2fc5GOPYip; k = 5% of the vocabulary there):
    top-k KL and the labels' cross-entropy,
    weighted per position by how confident the teacher is relative to the student on the label y:
    λ = p̂(y) / (p̂(y) + q(y)) (no gradient; p̂(y) = 0 when y is not among the k), loss = λ·KL_k + (1 − λ)·CE.
    Where the teacher is much surer than the student it teaches its distribution; where the student already is,
    the label alone. The weighting is our reading of the paper's "relative confidence" rule."""
    log_p = _log_softmax(values, T)
    log_q_k = _log_softmax(student.gather(-1, indices), T)
    log_q = _log_softmax(student, 1.0)
    ce = -log_q.gather(-1, labels[..., None])[..., 0]
    hit = indices == labels[..., None]  # [..., k]
    p_y = (log_p.exp() * hit).sum(-1)
    with torch.no_grad():
        lam = p_y / (p_y + (-ce).exp()).clamp_min(1e-12)
    return _mean(lam * T * T * _kl(log_p, log_q_k) + (1 - lam) * ce, mask)


def hidden_mse(student: torch.Tensor, teacher: torch.Tensor, projection: torch.nn.Module | None = None,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    """TinyBERT's embedding and hidden-state loss (Jiao et al., arXiv 1909.10351): MSE(h_s W, h_t), W a learned
    projection from the student's width to the teacher's (None when the widths agree).
    student [..., d_s], teacher [..., d_t]"""
    h = _float(student) if projection is None else _float(projection(student))
    if h.shape != teacher.shape:
        raise ValueError(f"hidden_mse: student states {tuple(h.shape)} (after the projection) and teacher states "
                         f"{tuple(teacher.shape)} differ; give a projection to the teacher's width")
    return _mean(((h - _float(teacher)) ** 2).mean(-1), mask)


def attention_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """TinyBERT's attention loss: MSE between the student's and the teacher's attention score maps (TinyBERT
    matches the scores before the softmax), averaged over heads and keys. student, teacher [B, H, T, S];
    mask [B, T] (the queries that count)"""
    if student.shape != teacher.shape:
        raise ValueError(f"attention_mse: maps {tuple(student.shape)} and {tuple(teacher.shape)} differ "
                         "(pick teacher heads or layers to match the student's)")
    per_query = ((_float(student) - _float(teacher)) ** 2).mean(-1).mean(1)  # [B, T]
    return _mean(per_query, mask)


def minillm(student: torch.Tensor, teacher: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None = None,
            sample_logp: torch.Tensor | None = None, length_normalize: bool = True) -> torch.Tensor:
    """MiniLLM's sequence-level reverse KL (Gu et al., arXiv 2306.08543) as a surrogate whose gradient is the
    policy gradient of KL(q || p) over whole sequences y sampled by the student:
        ∇ KL = Σ_t E[∇ KL(q_t || p_t)] + E[Σ_t w_t R_{t+1} ∇ log q(y_t)],   R_{t+1} = Σ_{t' > t} log q(y_t') − log p(y_t')
    The first (single-step) term is taken exactly over the vocabulary at each visited prefix, the second by the
    samples. With `sample_logp` (log p̃(y_t) of a teacher-mixed sampler p̃ = α p + (1 − α) q) each step carries the
    importance weight w_t = q(y_t) / p̃(y_t) (per token, as the paper: low variance, no longer unbiased beyond one
    step); without it the samples came from q and w_t = 1, and the estimate is unbiased. length_normalize divides
    R_{t+1} by the number of its terms (the paper's length-normalized reward, against a bias to short outputs).
    The loss is per token: each sequence's sum over its steps divided by its length, then the batch mean.
    student, teacher [B, T, V]; tokens, mask, sample_logp [B, T] (y_t is the token sampled at step t)"""
    log_q, log_p = _log_softmax(student, 1.0), _log_softmax(teacher, 1.0)
    keep = torch.ones_like(tokens, dtype=log_q.dtype) if mask is None else mask.to(log_q.dtype)
    single = _kl(log_q, log_p) * keep  # [B, T]
    log_q_y = log_q.gather(-1, tokens[..., None])[..., 0]
    with torch.no_grad():
        step = (log_q_y - log_p.gather(-1, tokens[..., None])[..., 0]) * keep  # log q − log p of each y_t
        later = step.flip(-1).cumsum(-1).flip(-1) - step  # R_{t+1}
        if length_normalize:
            count = keep.flip(-1).cumsum(-1).flip(-1) - keep
            later = later / count.clamp_min(1)
        weight = (log_q_y - sample_logp).exp() if sample_logp is not None else torch.ones_like(later)
    long_term = weight * later * log_q_y * keep
    return ((single + long_term).sum(-1) / keep.sum(-1).clamp_min(1)).mean()
