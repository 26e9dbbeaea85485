"""GPTQ as pure math: quantize a weight [N, K] column by column onto a QuantSpec grid, feeding each column's
rounding error into the not-yet-quantized columns through the inverse layer Hessian.

Paper: https://arxiv.org/abs/2210.17323 (Frantar et al., Algorithm 1: Cholesky form, lazy block updates). The
column loop, the damped inverse Cholesky factor and the column-by-column grid are SparseGPT's too
(leanlm/compress/obs.py): this file only chooses the column order and when each group's grid is fitted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from leanlm.compress.calibrate import calibrate
from leanlm.compress.obs import ColumnGrid, Pending, check_solver_args, inverse_cholesky, obs_update, solver_inputs
from leanlm.compress.quant.rtn import Int4Options, group_for
from leanlm.compress.registry import register
from leanlm.compress.stats import Hessian
from leanlm.lowbit.linear import W4A16Linear
from leanlm.lowbit.primitives import QuantSpec, compute_qparams, search_qparams
from leanlm.lowbit.record import replace as replace_module


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
    check_solver_args("gptq_quantize", W, H, block_size, damp)
    # Weights that are exactly 0 were pruned (SparseGPT, Wanda, ...): they stay 0 (a grid point of every spec),
    # and what the error updates pile onto them is passed on to later columns like any rounding error.
    pruned = W.detach() == 0
    W, H = solver_inputs(W, H)
    grid = ColumnGrid(W, spec, search_qparams if search_grid else compute_qparams)

    K = W.shape[1]
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if act_order else torch.arange(K, device=W.device)
    W, H, pruned = W[:, perm], H[perm][:, perm], pruned[:, perm]
    perm_cpu = perm.tolist()  # perm_cpu[processing index] = original column
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(K, device=W.device)  # pos[original column] = processing index

    def column(j: int, w: torch.Tensor, pending: Pending) -> torch.Tensor:
        k = perm_cpu[j]
        if grid.needs_fit(k):
            g, gs = k // grid.group_size, grid.group_size
            cols = pos[g * gs:(g + 1) * gs]  # processing indices of the group's columns, all >= j
            grid.fit(k, pending(cols).masked_fill_(pruned[:, cols], 0.0))  # the grid is for the weights it keeps
        return grid.round(w, k).masked_fill_(pruned[:, j:j + 1], 0.0)

    W = obs_update(W, inverse_cholesky(H, damp), block_size, column)
    return W[:, pos], grid.scale, grid.zero


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
            spec = QuantSpec(4, symmetric=config.symmetric, granularity="group", group_size=g)
            w_q, scale, zero = gptq_quantize(linear.weight.float(), hessian.value, spec, damp=config.damp,
                                             act_order=config.act_order, search_grid=config.search_grid)
            linear.weight.data = w_q  # on the grid in float32; the packing below reads its codes back
            new = config.activations(W4A16Linear.from_float(linear, g, qparams=(scale, zero),
                                                            symmetric=config.symmetric))
            replace_module(model, name, new)
            records[name] = new.record()
            if progress:
                progress(name)

    calibrate(model, samples, solve, lambda linear: Hessian(linear.in_features), sequential=config.sequential)
    return records
