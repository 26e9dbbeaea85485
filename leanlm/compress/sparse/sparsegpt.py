"""SparseGPT as pure math: prune W [N, K] column block by column block, choosing each block's mask by the OBS
saliency w^2 / [H^-1]_qq^2 and spreading every pruned (or rounded) column's error onto the columns not yet
processed through the inverse-Hessian Cholesky factor; optionally quantizing the kept weights in the same pass.

Paper: https://arxiv.org/abs/2301.00774 (Frantar & Alistarh, Algorithm 1: adaptive mask selection per block of
Bs columns, N:M inside the loop, joint quantization). The column loop, the damped inverse Cholesky factor and the
column-by-column grid are GPTQ's too (leanlm/compress/obs.py): this file only chooses the mask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from leanlm.compress.calibrate import calibrate
from leanlm.compress.obs import ColumnGrid, Pending, check_solver_args, inverse_cholesky, obs_update, solver_inputs
from leanlm.compress.quant.rtn import check_int4_group, group_for
from leanlm.compress.registry import register
from leanlm.compress.sparse.masks import check_pattern_fits, check_sparsity, layer_record, nm_mask, prune_lowest
from leanlm.compress.sparse.options import SparsityOptions
from leanlm.compress.stats import Hessian
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear, W8A16Linear
from leanlm.lowbit.primitives import QuantSpec, quantize
from leanlm.lowbit.record import replace as replace_module


class SparseGPTResult(NamedTuple):
    weight: torch.Tensor  # [N, K] float32, exact zeros where pruned; on the grid of scale/zero when quantized
    scale: torch.Tensor | None  # as compute_qparams shapes it for the spec ([N, 1], [N, K/g], []), None in float
    zero: torch.Tensor | None


def sparsegpt_prune(W: torch.Tensor, H: torch.Tensor, sparsity: float, pattern: tuple[int, int] | None = None,
                    block_size: int = 128, damp: float = 0.01, quant_spec: QuantSpec | None = None) -> SparseGPTResult:
    """SparseGPT-prune W [N, K] given H = 2 X^T X / rows [K, K] (https://arxiv.org/abs/2301.00774).

    Unstructured: at the start of each block of columns, every row prunes its lowest-saliency weights of the
    block (saliency from the error-updated weights), round(sparsity * i2) - round(sparsity * i1) of them for the
    block [i1, i2), so each row ends at round(sparsity * K) pruned. N:M (`pattern` (n, m)): the mask of every m
    columns is chosen when the loop reaches them. quant_spec: kept weights are rounded onto its grid as they are
    processed (channel/tensor grids from the whole W up front, a group's grid when its first column comes up),
    and the rounding error is spread like the pruning error."""
    check_solver_args("sparsegpt", W, H, block_size, damp)
    check_sparsity(sparsity)
    N, K = W.shape
    check_pattern_fits(pattern, K)
    if pattern is not None and block_size % pattern[1]:
        raise LeanLMError(f"block_size={block_size} must be a multiple of the pattern's M={pattern[1]}")
    W, H = solver_inputs(W, H)
    grid = None if quant_spec is None else ColumnGrid(W, quant_spec)
    gs = None if grid is None else grid.group_size
    if gs and block_size % gs:
        raise LeanLMError(f"block_size={block_size} must be a multiple of group_size={gs}")
    U = inverse_cholesky(H, damp)  # H^-1 = U^T U
    d2 = U.diagonal().square()  # [H^-1]_qq for column q
    pruned = torch.zeros(N, K, dtype=torch.bool, device=W.device)

    def column(j: int, w: torch.Tensor, pending: Pending) -> torch.Tensor:
        if pattern is None and j % block_size == 0:  # a block's mask, from its error-updated weights
            i2 = min(j + block_size, K)
            count = round(sparsity * i2) - round(sparsity * j)
            pruned[:, j:i2] = prune_lowest(pending(range(j, i2)).square() / d2[j:i2], count)
        if pattern is not None and j % pattern[1] == 0:
            m = pattern[1]
            pruned[:, j:j + m] = nm_mask(pending(range(j, j + m)).square() / d2[j:j + m], *pattern)
        q = w.masked_fill(pruned[:, j:j + 1], 0.0)
        if grid is None:
            return q
        if grid.needs_fit(j):  # j starts its group: fit its grid to the weights it keeps (known-pruned ones as 0)
            grid.fit(j, pending(range(j, j + gs)).masked_fill_(pruned[:, j:j + gs], 0))
        return grid.round(q, j)  # 0 is a grid point of every spec, so pruned weights stay exactly 0

    W = obs_update(W, U, block_size, column)
    return SparseGPTResult(W, None if grid is None else grid.scale, None if grid is None else grid.zero)


@dataclass(frozen=True)
class SparseGPT(SparsityOptions):
    """SparseGPT; with bits 8 (int8 per-channel, the W8A16 kernel) or 4 (int4 groups, W4A16) the kept weights
    are quantized in the same pass (joint sparse + quantized)."""

    name: ClassVar[str] = "sparsegpt"
    needs_data: ClassVar[bool] = True
    bits: int | None = None
    group_size: int = 128
    block_size: int = 128
    damp: float = 0.01
    sequential: bool = True  # solve qkv, o, gate_up, down in turn, each on inputs through the pruned ones

    def __post_init__(self):
        super().__post_init__()
        if self.bits not in (None, 4, 8):
            raise LeanLMError(f"sparsegpt quantizes the kept weights to --bits 8 or 4 (or leaves them in float), "
                              f"got {self.bits}")
        if self.bits == 4:
            check_int4_group(self.group_size)


def _quant_spec(config: SparseGPT, K: int) -> QuantSpec | None:
    if config.bits == 8:
        return QuantSpec(8, symmetric=True, granularity="channel")  # W8A16Linear's grid
    if config.bits == 4:
        return QuantSpec(4, symmetric=False, granularity="group", group_size=group_for(K, config.group_size))
    return None


def _packed(linear, result: SparseGPTResult, spec: QuantSpec):
    """The runtime module holding the result's codes as they are (no second rounding)."""
    if spec.bits == 4:
        linear.weight.data = result.weight.to(linear.weight.device)
        return W4A16Linear.from_float(linear, spec.group_size, qparams=(result.scale, result.zero))
    bias = None if linear.bias is None else linear.bias.detach().clone()
    new = W8A16Linear(linear.in_features, linear.out_features, bias)
    new.weight = quantize(result.weight, result.scale, result.zero, spec)
    new.scales = result.scale.reshape(-1).to(torch.bfloat16)  # rounding the scale rescales a row by < 0.4%
    return new.to(linear.weight.device)


@register(SparseGPT)
def sparsegpt(model, config: SparseGPT, progress=None, samples=None) -> dict[str, dict]:
    config.check_fits(model)
    records = {}

    def solve(index, block, linears):
        for name, (linear, hessian) in linears.items():
            spec = _quant_spec(config, linear.in_features)
            result = sparsegpt_prune(linear.weight.float(), hessian.value, config.target, config.nm,
                                     config.block_size, config.damp, spec)
            record = layer_record(result.weight, config.nm)
            if spec is None:
                linear.weight.data = result.weight.to(linear.weight.dtype)
            else:
                new = _packed(linear, result, spec)
                replace_module(model, name, new)
                record = {**new.record(), **record}
            records[name] = record
            if progress:
                progress(name)

    calibrate(model, samples, solve, lambda linear: Hessian(linear.in_features), sequential=config.sequential)
    return records
