"""Calibration accumulators equal their naive definitions on the concatenated batches."""

from __future__ import annotations

import pytest
import torch

from leanlm.compress.stats import AbsMax, ChannelNorm, Hessian
from leanlm.errors import LeanLMError

K = 24


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(0)
    # Mixed leading shapes and dtypes, as a hooked Linear sees them ([B, T, K], [M, K], bf16 inputs).
    return [torch.randn(2, 5, K, generator=g), torch.randn(7, K, generator=g, dtype=torch.float64),
            (3 * torch.randn(3, 4, K, generator=g)).bfloat16(), torch.randn(1, 1, 1, K, generator=g)]


def _concat(batches):
    return torch.cat([b.reshape(-1, K).double() for b in batches])  # [M, K]


def _fill(stat, batches):
    for b in batches:
        stat.add_batch(b)
    return stat


def test_hessian(batches):
    X = _concat(batches)
    h = _fill(Hessian(K), batches)
    assert h.rows == X.shape[0] == 10 + 7 + 12 + 1
    assert h.value.dtype == torch.float32 and h.value.shape == (K, K)
    torch.testing.assert_close(h.value, (2 * X.T @ X / X.shape[0]).float())


def test_channel_norm(batches):
    X = _concat(batches)
    n = _fill(ChannelNorm(K), batches)
    assert n.rows == X.shape[0]
    torch.testing.assert_close(n.value, torch.linalg.vector_norm(X, dim=0).float())


def test_abs_max(batches):
    X = _concat(batches)
    a = _fill(AbsMax(K), batches)
    assert a.rows == X.shape[0]
    assert torch.equal(a.value, X.abs().amax(0).float())


@pytest.mark.parametrize("cls", [Hessian, ChannelNorm, AbsMax])
def test_user_errors(cls):
    s = cls(K)
    with pytest.raises(LeanLMError, match="no rows"):
        s.value
    with pytest.raises(LeanLMError, match=r"\[\.\.\., 24\]"):
        s.add_batch(torch.randn(3, K + 1))
    with pytest.raises(LeanLMError, match="floating-point"):
        s.add_batch(torch.ones(3, K, dtype=torch.int64))
    with pytest.raises(LeanLMError, match="positive"):
        cls(0)
