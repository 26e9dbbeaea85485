"""GPTQ as pure math: quantize a weight [N, K] column by column onto a QuantSpec grid, feeding each column's
rounding error into the not-yet-quantized columns through the inverse layer Hessian.

Paper: https://arxiv.org/abs/2210.17323 (Frantar et al., Algorithm 1: Cholesky form, lazy block updates)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from leanlm.compress.calibrate import calibrate
from leanlm.compress.quant.rtn import Int4Options, group_for
from leanlm.compress.registry import register
from leanlm.compress.stats import Hessian
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear
from leanlm.lowbit.primitives import QuantSpec, compute_qparams, dequantize, quantize, search_qparams
from leanlm.lowbit.record import replace as replace_module


def _inverse_cholesky(H: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U), computed in float64  # [K, K] -> [K, K] float32"""
    L, info = torch.linalg.cholesky_ex(H)
    if info.item() == 0:
        U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    if info.item() != 0 or not torch.isfinite(U).all():
        raise LeanLMError("GPTQ: the calibration Hessian is not positive definite even after dampening; "
                          "use a larger damp (e.g. 0.05 or 0.1) or more calibration data")
    return U.float()


def solver_inputs(W: torch.Tensor, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies an OBS-style column solver (GPTQ, SparseGPT) may edit: W float32 [N, K], H float64 [K, K]. An input
    that was always zero carries no information: its weights are dropped and H made invertible there."""
    W = W.detach().float().clone()
    H = H.detach().to(device=W.device, dtype=torch.float64).clone()
    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1.0
    W[:, dead] = 0.0
    return W, H


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, spec: QuantSpec, block_size: int = 128,
                  damp: float = 0.01, act_order: bool = False, search_grid: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ-quantize W [N, K] given H = 2 X^T X / rows [K, K] (https://arxiv.org/abs/2210.17323).

    Returns (W_q dequantized [N, K] float32, scale, zero) with scale/zero shaped as `compute_qparams` gives them
    for `spec` ([N, 1] channel, [N, K/g] group, [] tensor), so `quantize(W_q, scale, zero, spec)` recovers the
    integer codes exactly. Channel/tensor grids come from the whole (dead-channel-zeroed) W up front; a group's
    grid comes from the error-updated weights of its columns when the first of them is processed.
    With act_order, columns are processed by descending diag(H) but groups stay keyed to the original
    column order (group g = original columns [g*gs, (g+1)*gs)), so the output is an ordinary group-quantized
    tensor with no column permutation to store.
    search_grid: each grid's range is shrunk where that lowers its own rounding error (`search_qparams`)."""
    if W.dim() != 2 or H.shape != (W.shape[1], W.shape[1]):
        raise LeanLMError(f"gptq_quantize needs W [N, K] and H [K, K]; got W {tuple(W.shape)}, H {tuple(H.shape)}")
    if spec.granularity == "token":
        raise LeanLMError("granularity='token' is for activations; quantize weights per 'channel', 'group' "
                          "or 'tensor'")
    if not isinstance(block_size, int) or block_size < 1:
        raise LeanLMError(f"block_size={block_size!r} is invalid; use a positive integer such as 128")
    if damp < 0:
        raise LeanLMError(f"damp={damp!r} is negative; use a small non-negative ratio such as 0.01")
    spec.check(W)
    N, K = W.shape
    # Weights that are exactly 0 were pruned (SparseGPT, Wanda, ...): they stay 0 (a grid point of every spec),
    # and what the error updates pile onto them is passed on to later columns like any rounding error.
    pruned = W.detach() == 0
    W, H = solver_inputs(W, H)
    diag = H.diagonal()

    col_spec = replace(spec, granularity="channel", group_size=None)  # quantize one column [N, 1] at a time
    qparams = search_qparams if search_grid else compute_qparams
    grouped = spec.granularity == "group"
    if grouped:
        gs = spec.group_size
        scale = torch.zeros(N, K // gs, dtype=torch.float32, device=W.device)
        zero = torch.zeros(N, K // gs, dtype=torch.int32, device=W.device)
        have_group = torch.zeros(K // gs, dtype=torch.bool)
    else:
        scale, zero = qparams(W, spec)
        col_scale, col_zero = scale.expand(N, 1), zero.expand(N, 1)

    perm = torch.argsort(diag, descending=True, stable=True) if act_order else torch.arange(K, device=W.device)
    W, H, pruned = W[:, perm], H[perm][:, perm], pruned[:, perm]
    perm_cpu = perm.tolist()
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(K, device=W.device)  # pos[original column] = processing index

    H.diagonal().add_(damp * H.diagonal().mean())
    U = _inverse_cholesky(H)

    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if grouped:
                g = perm_cpu[i1 + i] // gs
                if not have_group[g]:
                    cols = pos[g * gs:(g + 1) * gs]  # processing indices of the group's columns, all >= i1 + i
                    cur = W[:, cols].clone()
                    inside = cols < i2
                    cur[:, inside] = W1[:, cols[inside] - i1]
                    # Columns after this block have not had this block's lazy update yet: apply it here.
                    cur[:, ~inside] -= Err1[:, :i] @ U[i1:i1 + i, cols[~inside]]
                    cur.masked_fill_(pruned[:, cols], 0.0)  # the grid is for the weights it keeps
                    s, z = qparams(cur, col_spec)
                    scale[:, g:g + 1], zero[:, g:g + 1] = s, z
                    have_group[g] = True
                col_scale, col_zero = scale[:, g:g + 1], zero[:, g:g + 1]
            w = W1[:, i:i + 1]  # [N, 1]
            q = dequantize(quantize(w, col_scale, col_zero, col_spec), col_scale, col_zero, col_spec)
            q.masked_fill_(pruned[:, i1 + i:i1 + i + 1], 0.0)
            err = (w - q) / U1[i, i]  # [N, 1]
            W1[:, i:] -= err * U1[i:i + 1, i:]
            Q1[:, i:i + 1] = q
            Err1[:, i:i + 1] = err
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]

    return W[:, pos], scale, zero


@dataclass(frozen=True)
class GPTQ(Int4Options):
    """GPTQ onto the W4A16 kernel."""

    name: ClassVar[str] = "gptq"
    needs_data: ClassVar[bool] = True
    act_order: bool = True
    damp: float = 0.01
    search_grid: bool = True  # shrink each group's range where that lowers its rounding error
    sequential: bool = True  # solve qkv, o, gate_up, down in turn, each on inputs through the solved ones


@register(GPTQ)
def gptq(model, config: GPTQ, progress=None, samples=None) -> dict[str, dict]:
    """Calibrate block by block; each projection is solved on its Hessian, then packed for the kernel."""
    records = {}

    def solve(index, block, linears):
        for name, (linear, hessian) in linears.items():
            g = group_for(linear.in_features, config.group_size)
            spec = QuantSpec(4, symmetric=False, granularity="group", group_size=g)
            w_q, scale, zero = gptq_quantize(linear.weight.float(), hessian.value, spec, damp=config.damp,
                                             act_order=config.act_order, search_grid=config.search_grid)
            linear.weight.data = w_q  # on the grid in float32; the packing below reads its codes back
            new = W4A16Linear.from_float(linear, g, qparams=(scale, zero))
            replace_module(model, name, new)
            records[name] = new.record()
            if progress:
                progress(name)

    calibrate(model, samples, solve, lambda linear: Hessian(linear.in_features), sequential=config.sequential)
    return records
