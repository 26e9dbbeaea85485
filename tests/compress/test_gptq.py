"""GPTQ math on a tiny layer: beats round-to-nearest on the layer output, stays on its grid, reduces to RTN
for a diagonal Hessian, and copes with dead input channels."""

from __future__ import annotations

import pytest
import torch

from leanlm.compress.quant.gptq import gptq_quantize
from leanlm.errors import LeanLMError
from leanlm.lowbit.primitives import QuantSpec, dequantize, fake_quantize, quantize

N, K, M = 64, 128, 384

SPECS = [QuantSpec(4, False, "channel"), QuantSpec(4, True, "channel"), QuantSpec(4, False, "group", 32),
         QuantSpec(3, False, "channel"), QuantSpec(3, True, "group", 32), QuantSpec(4, True, "tensor")]
IDS = ["w4-asym-channel", "w4-sym-channel", "w4-asym-g32", "w3-asym-channel", "w3-sym-g32", "w4-sym-tensor"]


@pytest.fixture(scope="module")
def layer():
    """Correlated inputs X = Z A with uneven channel scales, and a random weight  # X [M, K], W [N, K]"""
    g = torch.Generator().manual_seed(0)
    A = torch.randn(K, K, generator=g) / K ** 0.5
    X = torch.randn(M, K, generator=g) @ A * (2 * torch.rand(K, generator=g) + 0.1)
    W = torch.randn(N, K, generator=g)
    return X, W, 2 * X.T @ X / M


def _out_err(X, W, Wq):
    return torch.linalg.norm(X @ W.T - X @ Wq.T).item()


# GPTQ/RTN layer-output error ratios measured (seed 0), in SPECS order:
#   act_order=False: 0.69 0.69 0.70 0.69 0.75 0.69;  act_order=True: 0.55 0.55 0.58 0.55 0.56 0.54
@pytest.mark.parametrize("search_grid", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_beats_rtn_and_stays_on_grid(layer, spec, act_order, search_grid):
    X, W, H = layer
    Wq, scale, zero = gptq_quantize(W, H, spec, act_order=act_order, search_grid=search_grid)
    assert Wq.shape == W.shape and Wq.dtype == torch.float32
    ratio = _out_err(X, W, Wq) / _out_err(X, W, fake_quantize(W, spec))
    assert ratio < 0.85, ratio
    # Every weight is a grid point of the returned scale/zero: re-quantizing reproduces it exactly.
    assert torch.equal(dequantize(quantize(Wq, scale, zero, spec), scale, zero, spec), Wq)


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2]], ids=[IDS[0], IDS[2]])
def test_block_size_does_not_change_the_result(layer, spec):
    # Lazy block updates are exact algebra; only float summation order differs (group 32 > block 16 also
    # checks that a group's grid sees the pending updates of the current block).
    X, W, H = layer
    a, sa, za = gptq_quantize(W, H, spec, block_size=128, act_order=True)
    b, sb, zb = gptq_quantize(W, H, spec, block_size=16, act_order=True)
    torch.testing.assert_close(sa, sb)  # group scales differ by float rounding (~1e-7 relative) only
    assert torch.equal(za, zb)
    codes_a, codes_b = quantize(a, sa, za, spec), quantize(b, sb, zb, spec)
    assert (codes_a != codes_b).float().mean() < 1e-3


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("spec", [SPECS[0], SPECS[1], SPECS[2], SPECS[4]], ids=[IDS[0], IDS[1], IDS[2], IDS[4]])
def test_diagonal_hessian_is_rtn(layer, spec, act_order):
    # With H diagonal, H^-1 and its Cholesky factor are diagonal: a column's error reaches no other column, so
    # every grid (channel, or group computed when reached) sees the original weights and GPTQ == RTN exactly.
    # That holds for any positive diagonal and any damp, not only for H = I with damp = 0.
    _, W, _ = layer
    rtn = fake_quantize(W, spec)
    assert torch.equal(gptq_quantize(W, torch.eye(K), spec, damp=0.0, act_order=act_order)[0], rtn)
    diag = torch.rand(K, generator=torch.Generator().manual_seed(1)) + 0.5
    assert torch.equal(gptq_quantize(W, torch.diag(diag), spec, damp=0.1, act_order=act_order)[0], rtn)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2]], ids=[IDS[0], IDS[2]])
def test_dead_channels(layer, spec, act_order):
    X, W, _ = layer
    X = X.clone()
    dead = torch.tensor([0, 5, 33, 34, 127])
    X[:, dead] = 0.0  # H is singular: those rows and columns are zero
    H = 2 * X.T @ X / M
    Wq, scale, zero = gptq_quantize(W, H, spec, act_order=act_order)
    assert torch.isfinite(Wq).all()
    assert (Wq[:, dead] == 0).all()
    assert torch.equal(dequantize(quantize(Wq, scale, zero, spec), scale, zero, spec), Wq)
    assert _out_err(X, W, Wq) < 0.85 * _out_err(X, W, fake_quantize(W, spec))


def test_rank_deficient_hessian_needs_only_damp(layer):
    X, W, _ = layer
    Xs = X[:32]  # 32 rows < K = 128: H has rank 32, dampening makes it invertible
    Wq, _, _ = gptq_quantize(W, 2 * Xs.T @ Xs / 32, SPECS[0])
    assert torch.isfinite(Wq).all()
    assert _out_err(Xs, W, Wq) < _out_err(Xs, W, fake_quantize(W, SPECS[0]))


def test_user_errors(layer):
    _, W, H = layer
    with pytest.raises(LeanLMError, match="larger damp"):
        gptq_quantize(W, -torch.eye(K), SPECS[0])
    with pytest.raises(LeanLMError, match="token"):
        gptq_quantize(W, H, QuantSpec(4, True, "token"))
    with pytest.raises(LeanLMError, match=r"H \[K, K\]"):
        gptq_quantize(W, H[:-1, :-1], SPECS[0])
    with pytest.raises(LeanLMError, match="group_size=48 does not divide"):
        gptq_quantize(W, H, QuantSpec(4, True, "group", 48))
    with pytest.raises(LeanLMError, match="damp"):
        gptq_quantize(W, H, SPECS[0], damp=-1.0)
