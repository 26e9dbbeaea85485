"""The shared OBS column solver on tiny tensors: lazy block updates equal the column-by-column definition, for any
block size, with what a method reads through `pending` included; the damped inverse Cholesky factor is one;
a column grid rounds as the whole-tensor grid does."""

from __future__ import annotations

import pytest
import torch

from leanlm.compress.obs import ColumnGrid, inverse_cholesky, obs_update, solver_inputs
from leanlm.errors import LeanLMError
from leanlm.lowbit.primitives import QuantSpec, compute_qparams, fake_quantize

N, K = 6, 16


@pytest.fixture(scope="module")
def problem():
    """A weight and the inverse-Hessian factor of correlated inputs, in float64 so that the lazy and the
    column-by-column update agree to ~1e-12  # W [N, K], U [K, K]"""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(40, K, generator=g, dtype=torch.float64) @ torch.randn(K, K, generator=g, dtype=torch.float64)
    return torch.randn(N, K, generator=g, dtype=torch.float64), inverse_cholesky(2 * X.T @ X / 40, 0.01).double()


def _method(seen: list):
    """A column rule that looks ahead: every 4 columns it prunes, per row, the 2 smallest of the next 4 as
    `pending` gives them; kept weights are rounded to a 0.25 grid. It records what `pending` showed it, columns
    inside and after the current block both."""
    mask = torch.zeros(N, K, dtype=torch.bool)

    def column(j, w, pending):
        if j % 4 == 0:
            ahead = pending(range(j, j + 4))
            mask[:, j:j + 4].scatter_(1, ahead.abs().topk(2, dim=1, largest=False).indices, True)
            later = torch.arange(j, K, 3)
            seen.append((ahead.clone(), pending(later).clone(), pending(range(j, K)).clone()))
        return (w * 4).round().div(4).masked_fill(mask[:, j:j + 1], 0.0)
    return column


def _naive(W, U, column):
    """OBS by its definition: each column's error reaches every later column at once."""
    W = W.clone()
    for j in range(K):
        def pending(cols):
            return W[:, cols.start:cols.stop].clone() if isinstance(cols, range) else W[:, cols].clone()
        w = W[:, j:j + 1].clone()
        q = column(j, w, pending)
        W[:, j:] -= (w - q) / U[j, j] * U[j:j + 1, j:]
        W[:, j:j + 1] = q  # the update above sets it to q up to rounding
    return W


@pytest.mark.parametrize("block_size", [1, 3, 4, 5, 16, 64])
def test_lazy_blocks_are_the_column_by_column_update(problem, block_size):
    W, U = problem
    seen_naive, seen = [], []
    expected = _naive(W, U, _method(seen_naive))
    got = obs_update(W.clone(), U, block_size, _method(seen))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert ((got.reshape(N, -1, 4) == 0).sum(-1) >= 2).all()  # every mask was applied
    assert len(seen) == len(seen_naive) == K // 4
    for a, b in zip(seen, seen_naive):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def test_keeping_every_column_changes_nothing(problem):
    W, U = problem
    assert torch.equal(obs_update(W.clone(), U, 5, lambda j, w, pending: w.clone()), W)


def test_inverse_cholesky_factors_the_damped_inverse(problem):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(8, K, generator=g, dtype=torch.float64)
    H = 2 * X.T @ X / 8  # rank 8 < K: only the damping makes it invertible
    U = inverse_cholesky(H, 0.1).double()
    assert torch.equal(U, U.triu())
    damped = H + 0.1 * H.diagonal().mean() * torch.eye(K, dtype=torch.float64)
    torch.testing.assert_close(U.T @ U @ damped, torch.eye(K, dtype=torch.float64), rtol=0, atol=1e-4)
    with pytest.raises(LeanLMError, match="larger damp"):
        inverse_cholesky(H, 0.0)


def test_solver_inputs_drop_dead_inputs():
    W, H = torch.ones(2, 3), torch.diag(torch.tensor([1.0, 0.0, 2.0]))
    W2, H2 = solver_inputs(W, H)
    assert W2[:, 1].eq(0).all() and H2[1, 1] == 1 and H2.dtype == torch.float64
    assert W.eq(1).all() and H[1, 1] == 0  # the caller's tensors are left alone


@pytest.mark.parametrize("spec", [QuantSpec(4, False, "channel"), QuantSpec(4, True, "tensor"),
                                  QuantSpec(3, False, "group", 4)], ids=["channel", "tensor", "group"])
def test_column_grid_rounds_as_the_tensor_grid(problem, spec):
    W = problem[0].float()
    grid = ColumnGrid(W, spec)
    cols = []
    for k in range(K):
        if grid.needs_fit(k):
            grid.fit(k, W[:, k:k + spec.group_size])
        assert not grid.needs_fit(k)
        cols.append(grid.round(W[:, k:k + 1], k))
    assert torch.equal(torch.cat(cols, 1), fake_quantize(W, spec))
    scale, zero = compute_qparams(W, spec)
    assert torch.equal(grid.scale, scale) and torch.equal(grid.zero, zero)
    with pytest.raises(LeanLMError, match="activations"):
        ColumnGrid(W, QuantSpec(8, True, "token"))
