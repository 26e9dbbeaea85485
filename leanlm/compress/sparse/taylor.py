"""First-order Taylor saliency: the loss change of zeroing w is about -w * dL/dw, so prune where |w * dL/dw|,
summed over the calibration batches, is smallest (Molchanov et al., https://arxiv.org/abs/1906.10771; the
gradient-based criterion next to magnitude and the Hessian-based OBD/OBS ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from leanlm.compress.registry import decoder_linears, register
from leanlm.compress.sparse.masks import apply_mask, layer_record, mask_for
from leanlm.compress.sparse.options import SparsityOptions
from leanlm.errors import LeanLMError


def taylor_saliency(model, samples: torch.Tensor, batch_size: int = 2) -> dict[str, torch.Tensor]:
    """sum over batches of |W * dL/dW| for every decoder projection, L the mean next-token cross-entropy of the
    batch (float32 scores)  # samples [n, T] -> {name: [N, K]}

    Summing absolute values per batch keeps saliencies whose gradient changes sign between batches (the sign of
    one batch's gradient is noise; the weight still matters)."""
    linears = dict(decoder_linears(model))
    weights = [m.weight for m in linears.values()]
    scores = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in weights]
    n, T = samples.shape
    if T < 2:
        raise LeanLMError("taylor needs calibration windows of at least 2 tokens (a next-token loss)")
    was = [w.requires_grad for w in weights]
    try:
        for w in weights:
            w.requires_grad_(True)
        for b in range(0, n, batch_size):
            tokens = samples[b:b + batch_size].to(model.device)
            positions = torch.arange(T, device=model.device)[None].expand(tokens.shape[0], -1)
            with torch.enable_grad():
                logits = model(tokens, positions)  # [B, T, V]
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
                grads = torch.autograd.grad(loss, weights)
            for s, w, g in zip(scores, weights, grads):
                s += (w.detach().float() * g.float()).abs_()
    finally:
        for w, flag in zip(weights, was):
            w.requires_grad_(flag)
    return dict(zip(linears, scores))


def taylor_prune(W: torch.Tensor, saliency: torch.Tensor, sparsity: float,
                 pattern: tuple[int, int] | None = None) -> torch.Tensor:
    """W with the lowest saliencies of each row (or N:M group) zeroed  # [N, K], [N, K] -> [N, K]"""
    return apply_mask(W, mask_for(saliency, sparsity, pattern))


@dataclass(frozen=True)
class Taylor(SparsityOptions):
    """One backward pass per calibration batch on the dense model, then every projection pruned at once."""

    name: ClassVar[str] = "taylor"
    needs_data: ClassVar[bool] = True
    batch_size: int = 2  # windows per backward pass: the [B, T, vocab] logits and their gradient bound memory

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise LeanLMError(f"taylor batch_size={self.batch_size!r} must be a positive integer")


@register(Taylor)
def taylor(model, config: Taylor, progress=None, samples=None) -> dict[str, dict]:
    config.check_fits(model)
    saliency = taylor_saliency(model, samples, config.batch_size)
    records = {}
    for name, linear in decoder_linears(model):
        linear.weight.data = taylor_prune(linear.weight.data, saliency.pop(name), config.target, config.nm)
        records[name] = layer_record(linear.weight, config.nm)
        if progress:
            progress(name)
    return records
