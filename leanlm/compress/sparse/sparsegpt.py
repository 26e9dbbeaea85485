"""SparseGPT as pure math: prune W [N, K] column block by column block, choosing each block's mask by the OBS
saliency w^2 / [H^-1]_qq^2 and spreading every pruned (or rounded) column's error onto the columns not yet
processed through the inverse-Hessian Cholesky factor; optionally quantizing the kept weights in the same pass.

Paper: https://arxiv.org/abs/2301.00774 (Frantar & Alistarh, Algorithm 1: adaptive mask selection per block of
Bs columns, N:M inside the loop, joint quantization). The Hessian, its damping and the inverse Cholesky factor are
GPTQ's (leanlm/compress/quant/gptq.py): one solver shape for both."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple

import torch

from leanlm.compress.calibrate import calibrate
from leanlm.compress.quant.gptq import _inverse_cholesky, solver_inputs
from leanlm.compress.quant.rtn import check_int4_group, group_for
from leanlm.compress.registry import register
from leanlm.compress.sparse.magnitude import SparsityOptions
from leanlm.compress.sparse.masks import check_pattern_fits, check_sparsity, layer_record, nm_mask, prune_lowest
from leanlm.compress.stats import Hessian
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear, W8A16Linear
from leanlm.lowbit.primitives import QuantSpec, compute_qparams, dequantize, quantize
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
    if W.dim() != 2 or H.shape != (W.shape[1], W.shape[1]):
        raise LeanLMError(f"sparsegpt needs W [N, K] and H [K, K]; got W {tuple(W.shape)}, H {tuple(H.shape)}")
    if not isinstance(block_size, int) or block_size < 1:
        raise LeanLMError(f"block_size={block_size!r} is invalid; use a positive integer such as 128")
    if damp < 0:
        raise LeanLMError(f"damp={damp!r} is negative; use a small non-negative ratio such as 0.01")
    check_sparsity(sparsity)
    N, K = W.shape
    check_pattern_fits(pattern, K)
    if pattern is not None and block_size % pattern[1]:
        raise LeanLMError(f"block_size={block_size} must be a multiple of the pattern's M={pattern[1]}")
    grouped = quant_spec is not None and quant_spec.granularity == "group"
    if quant_spec is not None:
        if quant_spec.granularity == "token":
            raise LeanLMError("granularity='token' is for activations; quantize weights per 'channel', 'group' "
                              "or 'tensor'")
        quant_spec.check(W)
        if grouped and block_size % quant_spec.group_size:
            raise LeanLMError(f"block_size={block_size} must be a multiple of group_size={quant_spec.group_size}")
    W, H = solver_inputs(W, H)
    H.diagonal().add_(damp * H.diagonal().mean())
    U = _inverse_cholesky(H)  # H^-1 = U^T U; row q of U is what removing column q does to the later columns

    scale = zero = col_scale = col_zero = None
    if quant_spec is not None:
        col_spec = replace(quant_spec, granularity="channel", group_size=None)  # one column [N, 1] at a time
        if grouped:
            scale = torch.zeros(N, K // quant_spec.group_size, device=W.device)
            zero = torch.zeros(N, K // quant_spec.group_size, dtype=torch.int32, device=W.device)
        else:
            scale, zero = compute_qparams(W, quant_spec)
            col_scale, col_zero = scale.expand(N, 1), zero.expand(N, 1)

    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        d2 = U1.diagonal().square()  # [H^-1]_qq for column q of the block
        if pattern is None:
            pruned = prune_lowest(W1.square() / d2, round(sparsity * i2) - round(sparsity * i1))
        else:
            pruned = torch.zeros_like(W1, dtype=torch.bool)
        for i in range(i2 - i1):
            if pattern is not None and i % pattern[1] == 0:
                m = pattern[1]
                pruned[:, i:i + m] = nm_mask(W1[:, i:i + m].square() / d2[i:i + m], *pattern)
            if grouped and (i1 + i) % quant_spec.group_size == 0:
                g, gs = (i1 + i) // quant_spec.group_size, quant_spec.group_size
                # The group's grid fits the weights it will keep (those of its columns known to be pruned left out).
                s, z = compute_qparams(W1[:, i:i + gs].masked_fill(pruned[:, i:i + gs], 0), col_spec)
                scale[:, g:g + 1], zero[:, g:g + 1] = s, z
                col_scale, col_zero = s, z
            w = W1[:, i:i + 1]  # [N, 1]
            q = w.masked_fill(pruned[:, i:i + 1], 0.0)
            if quant_spec is not None:  # 0 is a grid point of every spec, so pruned weights stay exactly 0
                q = dequantize(quantize(q, col_scale, col_zero, col_spec), col_scale, col_zero, col_spec)
            err = (w - q) / U1[i, i]  # [N, 1]
            W1[:, i:] -= err * U1[i:i + 1, i:]
            Q1[:, i:i + 1] = q
            Err1[:, i:i + 1] = err
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]  # the block's errors reach the later columns in one product
    return SparseGPTResult(W, scale, zero)


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
