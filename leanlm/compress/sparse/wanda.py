"""Wanda: prune by |W_ij| * ||X_j||_2, compared within each output row; no weight update.

Paper: https://arxiv.org/abs/2306.11695 (Sun et al., "A Simple and Effective Pruning Approach for LLMs").
Optional OWL non-uniform layer sparsity: https://arxiv.org/abs/2310.05175 (Yin et al.)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from leanlm.compress.calibrate import calibrate
from leanlm.compress.registry import register
from leanlm.compress.sparse.masks import apply_mask, layer_record, mask_for, outlier_ratio, owl_sparsities
from leanlm.compress.sparse.options import SparsityOptions
from leanlm.compress.stats import ChannelNorm
from leanlm.errors import LeanLMError


def wanda_score(W: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j||_2: the output change a weight's removal causes, to first order  # [N, K], [K] -> [N, K]"""
    return W.detach().float().abs() * norms.float().to(W.device)[None, :]


def wanda_prune(W: torch.Tensor, norms: torch.Tensor, sparsity: float,
                pattern: tuple[int, int] | None = None) -> torch.Tensor:
    """W with the lowest Wanda scores of each row zeroed (or of each N:M group)  # [N, K], [K] -> [N, K]"""
    return apply_mask(W, mask_for(wanda_score(W, norms), sparsity, pattern))


@dataclass(frozen=True)
class Wanda(SparsityOptions):
    """owl: OWL's lambda, the most a block's sparsity may move from the target to spare its outliers (0: uniform;
    the paper uses 0.08 with an outlier threshold of 5 x the mean score)."""

    name: ClassVar[str] = "wanda"
    needs_data: ClassVar[bool] = True
    owl: float = 0.0
    sequential: bool = False  # as the reference: every projection of a block on the block's inputs

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.owl < 0.5:
            raise LeanLMError(f"wanda owl={self.owl!r} must lie in [0, 0.5) (0 turns it off; 0.08 is the paper's)")
        if self.owl and self.nm is not None:
            raise LeanLMError("OWL sets a sparsity per block, which an N:M pattern fixes; use one or the other")


def _norm_stats(linear) -> ChannelNorm:
    return ChannelNorm(linear.in_features, device=linear.weight.device)


def owl_block_sparsities(model, samples, config: Wanda) -> list[float]:
    """One calibration pass over the dense model: each block's share of outlier Wanda scores -> its sparsity."""
    ratios = []

    def measure(index, block, linears):
        counts = [(outlier_ratio(wanda_score(m.weight, s.value)), m.weight.numel()) for m, s in linears.values()]
        ratios.append(sum(r * n for r, n in counts) / sum(n for _, n in counts))

    calibrate(model, samples, measure, _norm_stats)
    return owl_sparsities(ratios, config.target, config.owl)


@register(Wanda)
def wanda(model, config: Wanda, progress=None, samples=None) -> dict[str, dict]:
    config.check_fits(model)
    per_block = owl_block_sparsities(model, samples, config) if config.owl else None
    records = {}

    def solve(index, block, linears):
        sparsity = per_block[index] if per_block else config.target
        for name, (linear, norms) in linears.items():
            linear.weight.data = wanda_prune(linear.weight.data, norms.value, sparsity, config.nm)
            records[name] = layer_record(linear.weight, config.nm)
            if progress:
                progress(name)

    calibrate(model, samples, solve, _norm_stats, sequential=config.sequential)
    return records
