"""Each distillation loss against its definition written out naively, zero where student and teacher agree,
gradcheck in float64, and MiniLLM's policy-gradient estimate against the exact gradient on a tiny vocabulary."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from leanlm.distillation import losses

V = 7


def _logits(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, V, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2


def _kl(p_logits, q_logits) -> torch.Tensor:  # per position, by torch.distributions
    return kl_divergence(Categorical(logits=p_logits), Categorical(logits=q_logits))


S, Tt = _logits(0, 3, 4), _logits(1, 3, 4)


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_kls_and_cross_entropies_equal_their_definitions(T):
    assert torch.allclose(losses.forward_kl(S, Tt, T), T * T * _kl(Tt / T, S / T).mean())
    assert torch.allclose(losses.reverse_kl(S, Tt, T), T * T * _kl(S / T, Tt / T).mean())
    entropy = Categorical(logits=Tt / T).entropy().mean()
    assert torch.allclose(losses.soft_cross_entropy(S, Tt, T), T * T * (_kl(Tt / T, S / T).mean() + entropy))
    labels = Tt.argmax(-1)
    assert torch.allclose(losses.hard_label(S, labels), torch.nn.functional.cross_entropy(S.reshape(-1, V),
                                                                                       labels.reshape(-1)))


def test_jsd_and_skew_kl_equal_their_definitions():
    p, q = Tt.softmax(-1), S.softmax(-1)

    def kl(a, b):
        return (a * (a.log() - b.log())).sum(-1)

    for beta in (0.1, 0.5, 0.9):
        m = beta * p + (1 - beta) * q
        assert torch.allclose(losses.jsd(S, Tt, beta), (beta * kl(p, m) + (1 - beta) * kl(q, m)).mean())
    assert torch.allclose(losses.jsd(S, Tt, 0.5), losses.jsd(Tt, S, 0.5))  # symmetric at 0.5
    for alpha in (0.0, 0.1, 0.5):
        assert torch.allclose(losses.skew_kl(S, Tt, alpha), kl(p, alpha * p + (1 - alpha) * q).mean())
        assert torch.allclose(losses.skew_kl(S, Tt, alpha, reverse=True), kl(q, alpha * q + (1 - alpha) * p).mean())
    with pytest.raises(ValueError, match="beta"):
        losses.jsd(S, Tt, 1.0)


def test_topk_kl_is_forward_kl_at_k_equal_v_and_renormalizes_below():
    values, indices = Tt.topk(V, dim=-1)
    assert torch.allclose(losses.topk_kl(S, values, indices, 2.0), losses.forward_kl(S, Tt, 2.0))
    values, indices = Tt.topk(3, dim=-1)
    assert torch.allclose(losses.topk_kl(S, values, indices), _kl(values, S.gather(-1, indices)).mean())


def test_slim_weighs_kl_and_cross_entropy_by_relative_confidence():
    values, indices = Tt.topk(3, dim=-1)
    labels = indices[..., 0]  # the teacher's favourite: always among the k
    p_y = values.softmax(-1)[..., 0]
    q_y = S.softmax(-1).gather(-1, labels[..., None])[..., 0]
    lam = p_y / (p_y + q_y)
    ce = -q_y.log()
    kl = _kl(values, S.gather(-1, indices))
    assert torch.allclose(losses.slim(S, values, indices, labels), (lam * kl + (1 - lam) * ce).mean())
    outside = torch.full_like(labels, -1)
    for pos in torch.cartesian_prod(torch.arange(3), torch.arange(4)):
        outside[tuple(pos)] = next(t for t in range(V) if t not in indices[tuple(pos)])
    q_out = S.softmax(-1).gather(-1, outside[..., None])[..., 0]
    assert torch.allclose(losses.slim(S, values, indices, outside), -q_out.log().mean())  # λ = 0: the label alone


def test_every_loss_is_zero_where_student_and_teacher_agree():
    values, indices = S.topk(3, dim=-1)
    assert losses.forward_kl(S, S).abs() < 1e-12 and losses.reverse_kl(S, S).abs() < 1e-12
    assert losses.jsd(S, S).abs() < 1e-12 and losses.skew_kl(S, S, 0.3).abs() < 1e-12
    assert losses.topk_kl(S, values, indices).abs() < 1e-12
    h = torch.randn(3, 4, 8, dtype=torch.float64)
    assert losses.hidden_mse(h, h) == 0 and losses.attention_mse(h[:, None], h[:, None]) == 0


def test_a_mask_averages_over_the_positions_it_keeps():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.allclose(losses.forward_kl(S, Tt, mask=mask), _kl(Tt, S)[mask].mean())
    S2 = S.clone()
    S2[~mask] = 100.0  # what a masked position holds cannot matter
    assert torch.allclose(losses.reverse_kl(S2, Tt, mask=mask), losses.reverse_kl(S, Tt, mask=mask))


def test_bf16_logits_are_summed_in_float32():
    out = losses.forward_kl(S.bfloat16(), Tt.bfloat16())
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), losses.forward_kl(S.bfloat16().double(), Tt.bfloat16().double()), rtol=1e-5)


def test_hidden_mse_through_a_projection_and_shape_errors():
    proj = torch.nn.Linear(4, 6, bias=False).double()
    hs, ht = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 6, dtype=torch.float64)
    assert torch.allclose(losses.hidden_mse(hs, ht, proj), ((proj(hs) - ht) ** 2).mean())
    with pytest.raises(ValueError, match="projection"):
        losses.hidden_mse(hs, ht)
    with pytest.raises(ValueError, match="differ"):
        losses.attention_mse(torch.zeros(1, 2, 3, 3), torch.zeros(1, 4, 3, 3))


def test_forward_kl_in_blocks_of_rows_matches_the_formula():
    """forward_kl's gradient is found in its forward pass a block of rows at a time (2 rows at this vocabulary):
    value and gradient those of the formula (its masked form, all kept), bf16 logits in float32."""
    g = torch.Generator().manual_seed(5)
    s, t = torch.randn(5, 1 << 17, generator=g) * 3, torch.randn(5, 1 << 17, generator=g) * 3
    for student in (s, s.bfloat16()):
        ours = student.clone().requires_grad_()
        ref = student.clone().requires_grad_()
        value = losses.forward_kl(ours, t, 2.0)
        expected = losses.forward_kl(ref, t, 2.0, mask=torch.ones(5, dtype=torch.bool))
        assert value.dtype == torch.float32 and torch.allclose(value, expected, rtol=1e-5)
        (value * 3).backward(), (expected * 3).backward()
        assert ours.grad.dtype == student.dtype
        assert torch.allclose(ours.grad.float(), ref.grad.float(), rtol=1e-2, atol=1e-3 * ref.grad.abs().max())


def test_gradcheck_in_float64():
    s = S[:2, :2].clone().requires_grad_()
    t = Tt[:2, :2]
    values, indices = t.topk(3, dim=-1)
    labels = t.argmax(-1)
    for fn in (lambda s: losses.forward_kl(s, t, 2.0), lambda s: losses.reverse_kl(s, t, 2.0),
               lambda s: losses.soft_cross_entropy(s, t), lambda s: losses.jsd(s, t, 0.3),
               lambda s: losses.skew_kl(s, t, 0.2), lambda s: losses.skew_kl(s, t, 0.2, reverse=True),
               lambda s: losses.topk_kl(s, values, indices), lambda s: losses.hard_label(s, labels)):
        assert torch.autograd.gradcheck(fn, (s,))
    # SLIM's weight λ carries no gradient: its gradient is that of the mix with λ held at its value
    lam = (values.softmax(-1)[..., 0] / (values.softmax(-1)[..., 0] + s.detach().softmax(-1)
                                         .gather(-1, labels[..., None])[..., 0]))
    fixed = (lam * _kl(values, s.gather(-1, indices)) - (1 - lam) * s.log_softmax(-1).gather(-1, labels[..., None])[..., 0])
    assert torch.allclose(torch.autograd.grad(losses.slim(s, values, indices, labels), s)[0],
                          torch.autograd.grad(fixed.mean(), s)[0])
    h = torch.randn(2, 2, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h: losses.hidden_mse(h, t[..., :4]), (h,))


# MiniLLM on a tiny two-step "model": the student's logits are a table θ1 [V] for the first token and θ2 [V, V] for
# the second given the first; the teacher's are fixed tables. Its exact sequence-level reverse KL is a finite sum.
V2 = 4


def _tables(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V2, generator=g, dtype=torch.float64), torch.randn(V2, V2, generator=g, dtype=torch.float64)


def _exact_reverse_kl(s1, s2, t1, t2):
    lq1, lq2, lp1, lp2 = s1.log_softmax(-1), s2.log_softmax(-1), t1.log_softmax(-1), t2.log_softmax(-1)
    joint_q = lq1[:, None] + lq2  # [y1, y2]
    return (joint_q.exp() * (joint_q - lp1[:, None] - lp2)).sum()


def _sample(logits: torch.Tensor, n: int, g) -> torch.Tensor:
    return torch.multinomial(logits.softmax(-1).expand(n, -1) if logits.dim() == 1 else logits.softmax(-1), 1,
                             replacement=True, generator=g)[:, 0]


def test_minillm_policy_gradient_is_unbiased_over_two_steps():
    s1, s2 = (x.requires_grad_() for x in _tables(0))
    t1, t2 = _tables(1)
    exact = torch.autograd.grad(_exact_reverse_kl(s1, s2, t1, t2), (s1, s2))
    n, g = 200_000, torch.Generator().manual_seed(2)
    with torch.no_grad():
        y1 = _sample(s1, n, g)
        y2 = _sample(s2[y1], n, g)
    student = torch.stack([s1.expand(n, -1), s2[y1]], 1)  # [n, 2, V]
    teacher = torch.stack([t1.expand(n, -1), t2[y1]], 1)
    loss = losses.minillm(student, teacher, torch.stack([y1, y2], 1), length_normalize=False)
    estimate = torch.autograd.grad(loss * 2, (s1, s2))  # the loss is per token: two of them
    for e, x in zip(estimate, exact):
        assert torch.allclose(e, x, atol=0.02), (e, x)
    assert (exact[1].abs() > 0.05).any()  # a gradient worth estimating


def test_minillm_importance_weights_undo_teacher_mixed_sampling():
    """The first token from p̃ = α p + (1 − α) q, the second from q: the first step's weight q/p̃ makes the
    estimate of the first table's gradient unbiased (its reward-to-go is the second step's log q − log p)."""
    s1, s2 = (x.requires_grad_() for x in _tables(4))
    t1, t2 = _tables(5)
    exact = torch.autograd.grad(_exact_reverse_kl(s1, s2, t1, t2), s1)[0]
    n, g, alpha = 200_000, torch.Generator().manual_seed(3), 0.4
    with torch.no_grad():
        mix1 = (alpha * t1.softmax(-1) + (1 - alpha) * s1.softmax(-1)).log()
        y1 = _sample(mix1, n, g)
        y2 = _sample(s2[y1], n, g)
    student = torch.stack([s1.expand(n, -1), s2[y1]], 1)
    teacher = torch.stack([t1.expand(n, -1), t2[y1]], 1)
    logp = torch.stack([mix1[y1], s2[y1].detach().log_softmax(-1).gather(-1, y2[:, None])[:, 0]], 1)
    tokens = torch.stack([y1, y2], 1)
    weighted = losses.minillm(student, teacher, tokens, sample_logp=logp, length_normalize=False)
    assert torch.allclose(torch.autograd.grad(weighted * 2, s1)[0], exact, atol=0.02)
    unweighted = losses.minillm(student, teacher, tokens, length_normalize=False)
    assert not torch.allclose(torch.autograd.grad(unweighted * 2, s1)[0], exact, atol=0.02)
