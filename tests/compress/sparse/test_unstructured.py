"""Unstructured pruning math on one tiny layer: SparseGPT < Wanda < magnitude < random in output error at 50% and
at 2:4; Wanda is magnitude when input norms are equal; SparseGPT's OBS update beats its own mask without it;
joint sparse + quantized keeps the mask on the grid; GPTQ after pruning keeps the zeros."""

from __future__ import annotations

import pytest
import torch

from leanlm.compress.quant.gptq import gptq_quantize
from leanlm.compress.sparse.magnitude import magnitude_prune
from leanlm.compress.sparse.masks import apply_mask, row_mask
from leanlm.compress.sparse.sparsegpt import sparsegpt_prune
from leanlm.compress.sparse.wanda import wanda_prune
from leanlm.errors import LeanLMError
from leanlm.lowbit.primitives import QuantSpec, dequantize, fake_quantize, quantize

N, K, M = 64, 128, 512


@pytest.fixture(scope="module")
def layer():
    """Correlated inputs with log-normal channel scales (uneven norms, as LLM activations have), a random
    weight  # X [M, K], W [N, K], H [K, K]"""
    g = torch.Generator().manual_seed(0)
    A = torch.randn(K, K, generator=g) / K ** 0.5
    X = torch.randn(M, K, generator=g) @ A * torch.randn(K, generator=g).exp()
    W = torch.randn(N, K, generator=g)
    return X, W, 2 * X.T @ X / M


def _err(X, W, W_hat):
    return torch.linalg.norm(X @ W.T - X @ W_hat.T).item()


def _groups_ok(W_hat, n, m):
    return ((W_hat.reshape(W_hat.shape[0], -1, m) == 0).sum(-1) >= m - n).all()


# Output errors measured (seed 0), SparseGPT / Wanda / magnitude / random: 50%: 403 / 456 / 1253 / ~3270;
# 2:4: 633 / 797 / 1719 / ~3220
@pytest.mark.parametrize("pattern", [None, (2, 4)], ids=["50%", "2:4"])
def test_sparsegpt_beats_wanda_beats_magnitude_beats_random(layer, pattern):
    X, W, H = layer
    random = apply_mask(W, row_mask(torch.rand(N, K, generator=torch.Generator().manual_seed(1)), 0.5))
    errors = [_err(X, W, w) for w in (sparsegpt_prune(W, H, 0.5, pattern).weight,
                                      wanda_prune(W, X.norm(dim=0), 0.5, pattern),
                                      magnitude_prune(W, 0.5, pattern), random)]
    assert errors == sorted(errors) and errors[0] < 0.9 * errors[1], errors


@pytest.mark.parametrize("pattern", [None, (2, 4)])
def test_wanda_is_magnitude_when_input_norms_are_equal(layer, pattern):
    _, W, _ = layer
    assert torch.equal(wanda_prune(W, torch.full((K,), 3.0), 0.5, pattern), magnitude_prune(W, 0.5, pattern))


@pytest.mark.parametrize("sparsity,pattern", [(0.5, None), (0.3, None), (0.5, (2, 4)), (0.5, (4, 8))])
def test_sparsegpt_masks_are_exact_and_its_update_lowers_the_error(layer, sparsity, pattern):
    X, W, H = layer
    W_hat = sparsegpt_prune(W, H, sparsity, pattern, block_size=32).weight
    if pattern is None:
        assert ((W_hat == 0).sum(1) == round(sparsity * K)).all()  # every row, exact to one weight
    else:
        assert _groups_ok(W_hat, *pattern)
    same_mask_no_update = W.masked_fill(W_hat == 0, 0)
    assert _err(X, W, W_hat) < 0.9 * _err(X, W, same_mask_no_update)


@pytest.mark.parametrize("spec", [QuantSpec(8, True, "channel"), QuantSpec(4, False, "group", 32),
                                  QuantSpec(4, True, "channel")], ids=["w8", "w4-g32", "w4-sym"])
def test_joint_sparse_quantized_keeps_the_mask_on_the_grid(layer, spec):
    X, W, H = layer
    float_err = _err(X, W, sparsegpt_prune(W, H, 0.5, (2, 4)).weight)
    W_hat, scale, zero = sparsegpt_prune(W, H, 0.5, (2, 4), quant_spec=spec)
    assert _groups_ok(W_hat, 2, 4)
    assert torch.equal(dequantize(quantize(W_hat, scale, zero, spec), scale, zero, spec), W_hat)
    assert _err(X, W, W_hat) < (1.02 if spec.bits == 8 else 1.2) * float_err  # 8 bits cost almost nothing


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_after_pruning_keeps_the_zeros(layer, act_order):
    X, W, H = layer
    W_pruned = sparsegpt_prune(W, H, 0.5, (2, 4)).weight
    for spec in (QuantSpec(4, False, "group", 32), QuantSpec(8, True, "channel")):
        W_q, scale, zero = gptq_quantize(W_pruned, H, spec, act_order=act_order)
        assert (W_q[W_pruned == 0] == 0).all()
        assert torch.equal(dequantize(quantize(W_q, scale, zero, spec), scale, zero, spec), W_q)
        # GPTQ still compensates: better than rounding the pruned weight to the nearest grid point
        assert _err(X, W_pruned, W_q) < _err(X, W_pruned, fake_quantize(W_pruned, spec))


def test_sparsegpt_bad_arguments(layer):
    _, W, H = layer
    with pytest.raises(LeanLMError, match=r"in \[0, 1\)"):
        sparsegpt_prune(W, H, 1.0)
    with pytest.raises(LeanLMError, match="divisible by 3"):
        sparsegpt_prune(W, H, 0.5, (1, 3))
    with pytest.raises(LeanLMError, match="H \\[K, K\\]"):
        sparsegpt_prune(W, H[:5], 0.5)
    with pytest.raises(LeanLMError, match="multiple of group_size"):
        sparsegpt_prune(W, H, 0.5, block_size=16, quant_spec=QuantSpec(4, False, "group", 32))
