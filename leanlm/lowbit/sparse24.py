"""Compact 2:4 storage for int8 codes: of every 4 consecutive inputs of a row, the 2 kept codes and a 4-bit mask of
their positions, 5 bits a weight instead of 8 (what the int8_24_gemv kernel reads, leanlm/kernels/sparse.cpp).

    values [N, K/2] int8        the kept codes of each group of 4, in column order
    masks  [N, ceil(K/8)] uint8 group 2j's mask (exactly 2 bits set) in the low nibble of byte j, 2j + 1's in the high

A group with fewer than 2 nonzero codes keeps zeros at its first free positions, so every mask has 2 bits set.
"""

from __future__ import annotations

import torch

from leanlm.errors import LeanLMError

# nibble -> its 2 set positions, for the 6 valid nibbles (others map to (0, 0) and are rejected by unpack_24)
_POSITIONS = torch.tensor([[(b >> i) & 1 for i in range(4)] for b in range(16)])  # [16, 4]
_VALID = _POSITIONS.sum(1) == 2  # [16]
_PAIRS = torch.stack([torch.nonzero(p).flatten()[:2] if v else torch.zeros(2, dtype=torch.long)
                      for p, v in zip(_POSITIONS, _VALID)])  # [16, 2]


def is_24(q: torch.Tensor) -> bool:
    """Whether every group of 4 consecutive inputs of every row holds at most 2 nonzero codes  # [N, K] -> bool"""
    N, K = q.shape
    return K % 4 == 0 and bool(((q != 0).reshape(N, K // 4, 4).sum(-1) <= 2).all())


def pack_24(q: torch.Tensor, name: str = "the weight") -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes with at most 2 nonzeros per group of 4 inputs -> (values [N, K/2] int8, masks [N, ceil(K/8)] uint8)"""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise LeanLMError(f"pack_24 takes int8 codes [N, K]; {name} is {q.dtype} {tuple(q.shape)}")
    N, K = q.shape
    if K % 4:
        raise LeanLMError(f"2:4 storage needs in_features divisible by 4; {name} has {K}")
    groups = q.reshape(N, K // 4, 4)
    count = (groups != 0).sum(-1)  # [N, K/4]
    if (count > 2).any():
        n, g = (count > 2).nonzero()[0].tolist()
        raise LeanLMError(f"{name} is not 2:4 sparse: row {n}, inputs {4 * g}..{4 * g + 3} hold {count[n, g]} "
                          "nonzero codes (at most 2 of every 4); prune it with pattern 2:4 first")
    # keep the nonzero codes, then the earliest zeros: score 8 for a nonzero, minus the position to prefer early
    score = (groups != 0).to(torch.int8) * 8 - torch.arange(4, dtype=torch.int8)
    pos = score.topk(2, dim=-1).indices.sort(-1).values  # [N, K/4, 2]
    values = groups.gather(-1, pos).reshape(N, K // 2)
    nibbles = (1 << pos).sum(-1).to(torch.uint8)  # [N, K/4]
    if nibbles.shape[1] % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(N, 1)], 1)
    masks = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return values.contiguous(), masks.contiguous()


def unpack_24(values: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_24  # values [N, K/2] int8, masks [N, ceil(K/8)] uint8 -> q [N, K] int8"""
    N, K = values.shape[0], values.shape[1] * 2
    if K % 4 or masks.shape != (N, (K + 7) // 8) or masks.dtype != torch.uint8:
        raise LeanLMError(f"2:4 storage wants values [N, K/2] with K % 4 == 0 and uint8 masks [N, ceil(K/8)]; got "
                          f"values {tuple(values.shape)}, masks {masks.dtype} {tuple(masks.shape)}")
    m = masks.long()
    nibbles = torch.stack([m & 15, m >> 4], -1).reshape(N, -1)[:, : K // 4]  # [N, K/4]
    if not _VALID.to(masks.device)[nibbles].all():
        raise LeanLMError("2:4 masks hold a group without exactly 2 positions set; the stored model is damaged")
    pos = _PAIRS.to(masks.device)[nibbles]  # [N, K/4, 2]
    q = torch.zeros(N, K // 4, 4, dtype=torch.int8, device=values.device)
    return q.scatter_(-1, pos, values.reshape(N, K // 4, 2)).reshape(N, K)

