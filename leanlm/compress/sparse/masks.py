"""Pruning masks, written once: which weights of W [N, K] become zero, given a score (higher = keep).

A mask is a bool tensor shaped like the weight, True where the weight is pruned (set to exactly 0).
- per row (`row_mask`): every output row prunes the same count, round(sparsity * K): exact to one weight;
- per layer (`layer_mask`) and over several tensors (`global_masks`): one threshold for all their scores;
- N:M (`nm_mask`): every M consecutive input columns of a row keep their N best (2:4 keeps 2 of 4, the
  pattern sparse tensor cores run; https://arxiv.org/abs/2104.08378);
- OWL (`owl_sparsities`): a per-layer sparsity that spares layers with many outliers
  (https://arxiv.org/abs/2310.05175).
"""

from __future__ import annotations

import torch

from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W8A16Sparse24Linear


def check_sparsity(sparsity: float) -> float:
    """The fraction of weights to prune, checked to lie in [0, 1)."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
        raise LeanLMError(f"sparsity {sparsity!r} is out of range; give the fraction of weights to prune, "
                          "in [0, 1) (0.5 prunes half)")
    return float(sparsity)


def parse_pattern(pattern: str | None) -> tuple[int, int] | None:
    """'2:4' -> (2, 4): N weights kept of every M consecutive inputs; None (or 'unstructured') -> None."""
    if pattern is None or pattern == "unstructured":
        return None
    n, sep, m = str(pattern).partition(":")
    if not (sep and n.strip().isdigit() and m.strip().isdigit()) or not 0 < int(n) < int(m):
        raise LeanLMError(f"pattern {pattern!r} is not N:M with 0 < N < M; use e.g. 2:4 (keep 2 of every 4) or 4:8")
    return int(n), int(m)


def pattern_sparsity(pattern: str | None, sparsity: float | None, default: float = 0.5) -> float:
    """The sparsity a method runs at: an N:M pattern fixes it to (M - N) / M; a sparsity given with it must agree."""
    nm = parse_pattern(pattern)
    if nm is None:
        return check_sparsity(default if sparsity is None else sparsity)
    implied = (nm[1] - nm[0]) / nm[1]
    if sparsity is not None and abs(check_sparsity(sparsity) - implied) > 1e-9:
        raise LeanLMError(f"pattern {pattern} prunes {implied:g} of the weights, not sparsity {sparsity}; "
                          f"drop the sparsity or give {implied:g}")
    return implied


def check_pattern_fits(pattern: tuple[int, int] | None, K: int, name: str = "the layer") -> None:
    if pattern is not None and K % pattern[1]:
        raise LeanLMError(f"pattern {pattern[0]}:{pattern[1]} needs in_features divisible by {pattern[1]}, "
                          f"but {name} has {K}; use a pattern whose M divides {K} or unstructured sparsity")


def prune_lowest(score: torch.Tensor, k: int) -> torch.Tensor:
    """Prune the k lowest scores of every row  # [N, K] -> bool [N, K]"""
    mask = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    if k > 0:
        mask.scatter_(1, torch.topk(score, k, dim=1, largest=False).indices, True)
    return mask


def row_mask(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Every row prunes round(sparsity * K) weights (Wanda's per-output comparison group)  # [N, K] -> bool [N, K]"""
    return prune_lowest(score, round(check_sparsity(sparsity) * score.shape[1]))


def global_masks(scores: list[torch.Tensor], sparsity: float) -> list[torch.Tensor]:
    """Prune round(sparsity * total) weights with the lowest scores over all the tensors together; ties at the
    threshold are broken by position so the count is exact  # [[N_i, K_i]] -> [bool [N_i, K_i]]"""
    flat = torch.cat([s.reshape(-1).float() for s in scores])
    k = round(check_sparsity(sparsity) * flat.numel())
    pruned = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    if k > 0:
        pruned[torch.topk(flat, k, largest=False).indices] = True
    return [m.reshape(s.shape) for m, s in zip(pruned.split([s.numel() for s in scores]), scores)]


def layer_mask(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    """One threshold over the whole tensor: round(sparsity * numel) weights pruned  # [N, K] -> bool [N, K]"""
    return global_masks([score], sparsity)[0]


def nm_mask(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """In every group of m consecutive columns of a row, prune the m - n lowest  # [N, K] -> bool [N, K]"""
    N, K = score.shape
    check_pattern_fits((n, m), K)
    groups = score.reshape(N, K // m, m)
    mask = torch.zeros(groups.shape, dtype=torch.bool, device=score.device)
    mask.scatter_(2, torch.topk(groups, m - n, dim=2, largest=False).indices, True)
    return mask.reshape(N, K)


def mask_for(score: torch.Tensor, sparsity: float, pattern: tuple[int, int] | None) -> torch.Tensor:
    """The per-row mask at `sparsity`, or the N:M mask when a pattern is given  # [N, K] -> bool [N, K]"""
    return row_mask(score, sparsity) if pattern is None else nm_mask(score, *pattern)


def owl_sparsities(outlier_ratios: list[float], sparsity: float, lam: float = 0.08) -> list[float]:
    """OWL's per-layer sparsity: layers with a larger share of outlier scores are pruned less, each within
    sparsity +- lam and with the mean equal to `sparsity` (https://arxiv.org/abs/2310.05175, eq. 3)."""
    check_sparsity(sparsity)
    r = torch.tensor(outlier_ratios, dtype=torch.float64)
    spread = r.max() - r.min()
    density = torch.zeros_like(r) if spread == 0 else (r - r.min()) / spread * (2 * lam)
    density = density - density.mean() + (1 - sparsity)
    s = (1 - density).clamp(0.0, 0.99)
    return s.tolist()


def outlier_ratio(score: torch.Tensor, m: float = 5.0) -> float:
    """OWL's layer outlier ratio: the fraction of scores above m times their mean  # [N, K] -> float"""
    return (score > m * score.mean()).float().mean().item()


def apply_mask(W: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
    """W with pruned weights set to exactly 0  # [N, K] -> [N, K]"""
    return W.masked_fill(pruned, 0)


def sparsity_of(W: torch.Tensor) -> float:
    """Fraction of exact zeros  # [N, K] -> float"""
    return (W == 0).float().mean().item()


def layer_record(W: torch.Tensor, pattern: tuple[int, int] | None) -> dict:
    """What a pruned layer became, for the saved model's record."""
    return {"sparsity": round(sparsity_of(W), 6), "pattern": "unstructured" if pattern is None else "%d:%d" % pattern}


def zero_mask(module) -> torch.Tensor | None:
    """Where a projection's weights are exactly 0 as stored: a float weight's zeros, a compact 2:4 layer's zero
    codes; None for the other quantized layers, whose codes cannot tell a pruned weight from a small one rounded
    to the zero point (int4's zero point, int8's code 0: ~11% and ~1% of a dense model's weights)  # bool [N, K]"""
    if isinstance(module, W8A16Sparse24Linear):
        return module.codes() == 0
    return None if hasattr(module, "BITS") else module.weight == 0


def _zeros(module) -> tuple[float, int, dict[int, int]]:
    """(pruned weights, weights, {M: fewest pruned in any row's group of M consecutive inputs}) of a projection:
    a quantized one's from its pruning record (none: dense), the others' from their zeros."""
    numel = module.in_features * module.out_features
    record = getattr(module, "pruning", None)
    mask = None if record else zero_mask(module)
    if mask is None:
        sparsity, nm = (record or {}).get("sparsity", 0.0), parse_pattern((record or {}).get("pattern"))
        fewest = {M: (nm[1] - nm[0]) * M // nm[1] if nm and M % nm[1] == 0 else 0 for M in (4, 8)}
        return sparsity * numel, numel, {M: f for M, f in fewest.items() if module.in_features % M == 0}
    fewest = {M: int(mask.reshape(mask.shape[0], -1, M).sum(-1).min()) for M in (4, 8) if mask.shape[1] % M == 0}
    return float(mask.sum()), numel, fewest


def module_sparsity(module) -> float:
    """Fraction of a projection's weights that pruning set to 0: a float or compact 2:4 layer's zeros, a quantized
    layer's pruning record (lowbit.record.note_pruning; 0 without one)."""
    zeros, numel, _ = _zeros(module)
    return zeros / numel


def decoder_sparsity(model) -> tuple[float, str | None]:
    """(fraction of the decoder projections' weights that pruning set to 0, the N:M pattern every one of them
    follows or None): of M = 4 and 8, the pattern whose least-pruned group of M prunes the largest share (2:4
    before 4:8)."""
    stats = [_zeros(m) for name, m in model.named_modules() if name.startswith("layers.") and hasattr(m, "in_features")]
    if not stats:
        return 0.0, None
    zeros = sum(z for z, _, _ in stats) / sum(n for _, n, _ in stats)
    best, pattern = 0.0, None
    for M in (4, 8):
        if all(M in fewest for _, _, fewest in stats):
            least = min(fewest[M] for _, _, fewest in stats)
            if least / M > best:
                best, pattern = least / M, f"{M - least}:{M}"
    return zeros, pattern
