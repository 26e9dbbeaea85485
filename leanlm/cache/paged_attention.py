"""Attention for one engine step: the packed new tokens of many sequences against their keys and values in the
block pool, with the metadata (slot mapping, context lengths, block tables) passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from leanlm import kernels
from leanlm.cache.paged import KVPool, cdiv, slot_of
from leanlm.models.layers import decode_attention


@dataclass
class Chunk:
    """A sequence's prompt chunk: `length` new tokens at packed rows [start, start + length), ending at position
    `context - 1`; it attends over `context` tokens stored at `slots`, causally (`mask`, None when all are new)."""
    start: int
    length: int
    context: int
    slots: torch.Tensor  # [context]
    mask: torch.Tensor | None  # [length, context]


def paged_kernel(pool: KVPool):
    """leanlm's kernel ops if their paged attention can read this pool (a CPU pool of a float32 or bfloat16 model),
    else None."""
    on_cpu = pool.k[0].device.type == "cpu" and pool.dtype in (torch.float32, torch.bfloat16)
    return kernels.ops() if on_cpu else None


def prefill_kernel(pool: KVPool):
    """leanlm's kernel ops if their prompt attention runs on this pool: a bf16 model's, its entries bf16 or int8
    codes, and native bf16 dot products, else None. Elsewhere torch's flash kernel on gathered keys is faster: with
    plain loops by over 15x; with AVX2's packed tiles level at 256 tokens of context and 0.6-0.7x at 1024-2048 (Zen 3,
    benchmarks/kernels.py --sections c)."""
    ops = paged_kernel(pool)
    entries = pool.k[0].dtype in (torch.bfloat16, torch.int8)
    return ops if ops is not None and pool.dtype == torch.bfloat16 and entries and kernels.native_bf16() else None


def slots_of(block_table: list[int], block_size: int, end: int, device=None) -> torch.Tensor:
    """Pool slots of token positions [0, end)  # [end]"""
    table = torch.tensor(block_table[: cdiv(end, block_size)], device=device)
    return (table[:, None] * block_size + torch.arange(block_size, device=device)).flatten()[:end]


class PagedStep:
    """The KVCache (cache.base) the model sees in an engine step: its tokens are packed in one row (B = 1).

    Sequences that feed one token (decodes) come first and are attended to in one call: leanlm's paged-attention
    kernel reads their keys and values in place through the block tables (CPU; int8 pools too), or elsewhere a
    gather into a padded, masked [B, S] batch. Each longer chunk (a prompt) attends causally over its context:
    leanlm's prefill kernel reads it in place where the CPU has bf16 dot products (a bf16 or int8 pool; 2.2-3.7x
    torch's flash kernel at 256 new tokens), else its T queries share one gather for SDPA."""

    def __init__(self, pool: KVPool, tables: list[list[int]], starts: list[int], lengths: list[int], device=None):
        """Each sequence's block table, first new position and number of new tokens (single tokens first)."""
        self.pool, bs = pool, pool.block_size
        self.num_single = ns = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
        new_slots, self.chunks = [], []
        if ns:
            width = max(cdiv(s + 1, bs) for s in starts[:ns])
            rows = [t[:width] + [0] * (width - len(t[:width])) for t in tables[:ns]]
            self.tables = torch.tensor(rows, dtype=torch.int32, device=device)  # [B, width]
            self.lens = torch.tensor([s + 1 for s in starts[:ns]], dtype=torch.int32, device=device)  # [B]
            new_slots.append(torch.tensor([slot_of(t, s, bs) for t, s in zip(tables, starts[:ns])], device=device))
        row = ns
        for table, begin, n in zip(tables[ns:], starts[ns:], lengths[ns:]):
            slots = slots_of(table, bs, begin + n, device)
            mask = None if begin == 0 else _causal(n, begin + n, device)
            self.chunks.append(Chunk(row, n, begin + n, slots, mask))
            new_slots.append(slots[begin:])
            row += n
        self.slot_mapping = torch.cat(new_slots)  # [N] where each new token's key and value go
        pool.prepare(self.slot_mapping, [t[0] * bs for t, s in zip(tables, starts) if s == 0])
        self.kernel, self.prefill = paged_kernel(pool), prefill_kernel(pool)

    def attention_mask(self, T: int):
        return None, False

    def advance(self, T: int) -> None:
        pass

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               is_causal: bool) -> torch.Tensor:
        """Store k, v; attend  # q [1, N, H, D]; k, v [1, N, Hkv, D] -> [1, N, H, D] (the masks are this step's own)"""
        q, k, v = q[0], k[0], v[0]  # [N, H or Hkv, D]
        self.pool.write(layer, self.slot_mapping, k, v)
        outs = [self._decodes(layer, q[: self.num_single])] if self.num_single else []
        for c in self.chunks:
            if self.prefill is not None and q.dtype == torch.bfloat16:
                scales = (self.pool.k_scale[layer], self.pool.v_scale[layer]) if self.pool.int8 else ()
                outs.append(self.prefill.prefill_attention(q[c.start : c.start + c.length], self.pool.k[layer],
                                                           self.pool.v[layer], c.slots, *scales))
                continue
            keys, values = self.pool.read(layer, c.slots)  # [C, Hkv, D]
            qc = q[c.start : c.start + c.length].transpose(0, 1)[None]  # [1, H, T, D]
            out = F.scaled_dot_product_attention(qc, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                                 attn_mask=c.mask, is_causal=c.mask is None,
                                                 enable_gqa=k.shape[1] != q.shape[1])
            outs.append(out[0].transpose(0, 1))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        if (Q := self.pool.value_basis) is not None:  # the values were read as v Q: so is their weighted sum
            out = (out.float() @ Q.T).to(out.dtype)
        return out[None]

    def _decodes(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, D] -> [B, H, D]"""
        if self.kernel is not None:
            return self.pool.attend_kernel(self.kernel, layer, q.contiguous(), self.tables, self.lens)
        bs, width = self.pool.block_size, self.tables.shape[1]
        position = torch.arange(width * bs, device=q.device)[None]  # [1, S]
        mask = position < self.lens[:, None]
        # past its length a row reads its last token again (masked out): every slot read was written
        position = torch.minimum(position, self.lens[:, None] - 1).long()
        slots = self.tables.long().gather(1, position // bs) * bs + position % bs  # [B, S]
        keys, values = self.pool.read(layer, slots)  # [B, S, Hkv, D]
        out = decode_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), mask[:, None, None])
        return out[:, :, 0]


def _causal(T: int, C: int, device) -> torch.Tensor:
    """Query i (position C - T + i) sees keys 0 .. C - T + i  # [T, C]"""
    return torch.arange(C, device=device)[None] <= torch.arange(C - T, C, device=device)[:, None]
