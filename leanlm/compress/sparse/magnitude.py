"""Magnitude pruning: zero the weights of smallest |W_ij| (no data needed). The baseline every data-aware method
must beat (https://arxiv.org/abs/1506.02626, Han et al.)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from leanlm.compress.registry import decoder_linears, register
from leanlm.compress.sparse.masks import apply_mask, global_masks, layer_mask, layer_record, mask_for
from leanlm.compress.sparse.options import SparsityOptions
from leanlm.errors import LeanLMError

SCOPES = ("row", "layer", "global")


def magnitude_prune(W: torch.Tensor, sparsity: float, pattern: tuple[int, int] | None = None,
                    scope: str = "row") -> torch.Tensor:
    """W with its smallest |W_ij| zeroed: per row or per layer at `sparsity`, or N:M  # [N, K] -> [N, K]"""
    score = W.detach().float().abs()
    pruned = layer_mask(score, sparsity) if scope == "layer" and pattern is None else mask_for(score, sparsity, pattern)
    return apply_mask(W, pruned)


@dataclass(frozen=True)
class Magnitude(SparsityOptions):
    """|W| compared per output row (`row`), within each projection (`layer`) or over all of them (`global`)."""

    name: ClassVar[str] = "magnitude"
    needs_data: ClassVar[bool] = False
    scope: str = "row"

    def __post_init__(self):
        super().__post_init__()
        if self.scope not in SCOPES:
            raise LeanLMError(f"magnitude scope {self.scope!r} is unknown; use one of {', '.join(SCOPES)}")


@register(Magnitude)
def magnitude(model, config: Magnitude, progress=None, samples=None) -> dict[str, dict]:
    config.check_fits(model)
    linears = dict(decoder_linears(model))
    masks = None
    if config.scope == "global" and config.nm is None:  # one threshold over every projection
        masks = global_masks([m.weight.detach().float().abs() for m in linears.values()], config.target)
    records = {}
    for i, (name, linear) in enumerate(linears.items()):
        W = linear.weight.data
        linear.weight.data = apply_mask(W, masks[i]) if masks else magnitude_prune(W, config.target, config.nm,
                                                                                      config.scope)
        records[name] = layer_record(linear.weight, config.nm)
        if progress:
            progress(name)
    return records
