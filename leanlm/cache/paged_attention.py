"""Attention for one engine step: the packed new tokens of many sequences against their keys and values in the
block pool, with the metadata (slot mapping, context lengths, block tables) passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from leanlm.cache.paged import KVPool
from leanlm.models.layers import decode_attention


@dataclass
class Chunk:
    """One sequence's share of the step: `length` new tokens at packed rows [start, start + length), ending at
    position `context - 1`; it attends over `context` tokens stored at `slots`."""
    start: int
    length: int
    context: int
    slots: torch.Tensor  # [context]


def slots_of(block_table: list[int], block_size: int, end: int, device=None) -> torch.Tensor:
    """Pool slots of token positions [0, end)  # [end]"""
    table = torch.tensor(block_table[: -(-end // block_size)], device=device)
    return (table[:, None] * block_size + torch.arange(block_size, device=device)).flatten()[:end]


class PagedStep:
    """The KVCache the model sees in an engine step (`attend` replaces update + attention).

    Sequences that feed one token (decodes) come first and are attended to in one batched call, their keys
    gathered into a [B, S] slot table padded to the longest context and masked; each longer chunk (a prefill)
    runs causal SDPA over its own gathered context."""

    def __init__(self, pool: KVPool, chunks: list[Chunk], device=None):
        self.pool, self.chunks = pool, chunks
        self.slot_mapping = torch.cat([c.slots[c.context - c.length :] for c in chunks])  # [N] where new k, v go
        self.num_single = next((i for i, c in enumerate(chunks) if c.length != 1), len(chunks))
        singles = chunks[: self.num_single]
        self.decode_slots = self.decode_mask = None
        if singles:
            longest = max(c.context for c in singles)
            self.decode_slots = torch.stack([F.pad(c.slots, (0, longest - c.context)) for c in singles])  # [B, S]
            lens = torch.tensor([c.context for c in singles], device=device)
            self.decode_mask = (torch.arange(longest, device=device)[None] < lens[:, None])[:, None, None]  # [B,1,1,S]
        self.masks = [None if c.context == c.length else _causal(c.length, c.context, device)
                      for c in chunks[self.num_single :]]

    @classmethod
    def build(cls, pool: KVPool, tables: list[list[int]], starts: list[int], lengths: list[int], device=None):
        """From each sequence's block table, first new position and number of new tokens (single tokens first)."""
        chunks, row = [], 0
        for table, begin, n in zip(tables, starts, lengths):
            chunks.append(Chunk(row, n, begin + n, slots_of(table, pool.block_size, begin + n, device)))
            row += n
        return cls(pool, chunks, device)

    def attention_mask(self, T: int):
        return None, False

    def advance(self, T: int) -> None:
        pass

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v; attend  # q [N, H, D]; k, v [N, Hkv, D] -> [N, H, D]"""
        self.pool.write(layer, self.slot_mapping, k, v)
        outs = []
        if self.decode_slots is not None:
            keys, values = self.pool.read(layer, self.decode_slots)  # [B, S, Hkv, D]
            B = self.decode_slots.shape[0]
            out = decode_attention(q[:B, :, None], keys.transpose(1, 2), values.transpose(1, 2), self.decode_mask)
            outs.append(out[:, :, 0])
        for c, mask in zip(self.chunks[self.num_single :], self.masks):
            keys, values = self.pool.read(layer, c.slots)  # [C, Hkv, D]
            qc = q[c.start : c.start + c.length].transpose(0, 1)[None]  # [1, H, T, D]
            out = F.scaled_dot_product_attention(qc, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                                 attn_mask=mask, is_causal=mask is None,
                                                 enable_gqa=k.shape[1] != q.shape[1])
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def _causal(T: int, C: int, device) -> torch.Tensor:
    """Query i (position C - T + i) sees keys 0 .. C - T + i  # [T, C]"""
    return torch.arange(C, device=device)[None] <= torch.arange(C - T, C, device=device)[:, None]
