"""Paged KV cache: keys and values in fixed-size blocks from one pool, handed out by a block manager with reference
counts and prefix caching.  PagedAttention: https://arxiv.org/abs/2309.06180

A sequence owns a block table (block ids, in order); token position p lives in slot
`table[p // block_size] * block_size + p % block_size` of every layer's pool. A full block is keyed by a chained
SHA-256 of (its parent's key, its token ids): a new sequence whose prompt starts with the same tokens reuses those
blocks instead of computing them again. A freed block keeps its contents and key until the pool needs it back
(least recently freed first), so a prompt seen a while ago can still be found.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Protocol

import torch

from leanlm import kernels
from leanlm.cache.int8 import dequantize_per_token, int8_bytes_per_head, quantize_per_token
from leanlm.errors import LeanLMError
from leanlm.models.config import ModelConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The pool slot holding token `position` of the sequence with this block table."""
    return block_table[position // block_size] * block_size + position % block_size


def keys_by_block(dtype: torch.dtype, device, block_size: int, int8: bool = False) -> bool:
    """Whether a pool of these entries keeps its keys by block (KVPool): on a CPU, blocks a multiple of 16 tokens,
    bf16 entries where the kernels have bf16 dot products, int8 codes where they have AVX-512 VNNI (int16 pair
    products), and both on AVX2 (FMAs on each pair's halves; `vpmaddwd`). Their decode and prefill attention read
    them in place; elsewhere (plain loops) a gather by block would cost more than the layout saves."""
    if torch.device(device or "cpu").type != "cpu" or block_size % 16 or (dtype != torch.bfloat16 and not int8):
        return False
    ops = kernels.ops()
    if ops is None:
        return False
    return ops.isa() in ("avx512", "avx2") if int8 else kernels.packed_bf16()


def put(store: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """store[slots] = x  # x [N, Hkv, D]; store [slots, Hkv, D], or keys by block [blocks, Hkv, D / 2, bs, 2] (bf16
    or int8)"""
    if store.dim() == 3:
        store.index_copy_(0, slots, x)
    else:
        kernels.ops().put_keys(store, slots, x)


def take(store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """store[slots], as put writes them  # slots [...] -> [..., Hkv, D]"""
    if store.dim() == 3:
        return store[slots]
    bs = store.shape[3]
    return store.permute(0, 3, 1, 2, 4)[slots // bs, slots % bs].flatten(-2)


class KVPool:
    """Every layer's keys and values, slot by slot: k[layer] [num_blocks * block_size, Hkv, D]. With int8=True the
    entries are int8 codes with a float32 scale per (slot, head) (cache.int8): about half the bytes.

    A CPU pool keeps its keys by block instead where the kernels read them so (keys_by_block), k[layer] [num_blocks,
    Hkv, D / 2, block_size, 2]: the channel pair p of 16 tokens of a kv head side by side, so that the paged-attention
    kernel's scores are products of whole vectors with a query's pair (kernels: BlockedKeys), with no sums across
    lanes; an int8 pool's scales stay by slot. `put` and `take` write and read either layout by slot."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device=None,
                 int8: bool = False):
        if num_blocks < 2:
            raise LeanLMError(f"the KV cache budget holds {num_blocks} blocks of {block_size} tokens; give it more memory")
        self.num_blocks, self.block_size, self.dtype, self.int8 = num_blocks, block_size, dtype, int8
        self.value_basis: torch.Tensor | None = None  # read's values are v times this orthogonal matrix (cache.int4)
        # empty, not zeros: the OS commits pages as blocks are first written (zeroing 4 GiB took 11 s), and
        # attention reads only slots that were written (paged_attention.PagedStep)
        shape = (num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        store = torch.int8 if int8 else dtype
        blocked = keys_by_block(dtype, device, block_size, int8)
        keys = (num_blocks, cfg.num_kv_heads, cfg.head_dim // 2, block_size, 2) if blocked else shape
        self.k = [torch.empty(keys, dtype=store, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.empty(shape, dtype=store, device=device) for _ in range(cfg.num_layers)]
        scale = (shape[0], shape[1], 1)
        self.k_scale = [torch.empty(scale, device=device) for _ in range(cfg.num_layers)] if int8 else None
        self.v_scale = [torch.empty(scale, device=device) for _ in range(cfg.num_layers)] if int8 else None

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, int8: bool = False) -> int:
        """2 (k and v) x layers x tokens x kv heads x (head_dim x bytes per element, + a float32 scale if int8)."""
        per_head = int8_bytes_per_head(cfg.head_dim) if int8 else cfg.head_dim * dtype.itemsize
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * per_head

    @classmethod
    def from_budget(cls, cfg: ModelConfig, memory: int, block_size: int, dtype: torch.dtype, device=None,
                    int8: bool = False, extra_per_block: int = 0) -> KVPool:
        """As many blocks as `memory` bytes hold, each also costing `extra_per_block` (a draft model's blocks, kept
        block for block beside these)."""
        per_block = cls.bytes_per_block(cfg, block_size, dtype, int8) + extra_per_block
        return cls(cfg, memory // per_block, block_size, dtype, device, int8)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v + (self.k_scale or []) + (self.v_scale or []))

    def prepare(self, slots: torch.Tensor, firsts: list[int] = ()) -> None:
        """Called once per step, before any layer writes, with every slot the step writes and those of them that
        hold a sequence's first token (cache.int4 plans there)."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' keys and values  # slots [N]; k, v [N, Hkv, D]"""
        if not self.int8:
            put(self.k[layer], slots, k)
            self.v[layer].index_copy_(0, slots, v)
            return
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = quantize_per_token(x)
            put(codes[layer], slots, q)
            scales[layer].index_copy_(0, slots, scale)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at these slots, in the model dtype  # slots [...] -> [..., Hkv, D]"""
        if not self.int8:
            return take(self.k[layer], slots), self.v[layer][slots]
        return (dequantize_per_token(take(self.k[layer], slots), self.k_scale[layer][slots], self.dtype),
                dequantize_per_token(self.v[layer][slots], self.v_scale[layer][slots], self.dtype))

    def attend_kernel(self, ops, layer: int, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """Single-token queries against their sequences' keys and values in this layer, by leanlm's paged-attention
        kernel (ops: kernels.ops())  # q [B, H, D]; tables [B, width], lens [B] int32 -> [B, H, D]"""
        scales = (self.k_scale[layer], self.v_scale[layer]) if self.int8 else (None, None)
        return ops.paged_attention(q, self.k[layer], self.v[layer], tables, lens, self.block_size, *scales)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src to block dst in every layer (a forked sequence's partial last block)."""
        if not pairs:
            return
        src_blocks, dst_blocks = (torch.tensor(list(b), device=self.v[0].device) for b in zip(*pairs))
        offsets = torch.arange(self.block_size, device=self.v[0].device)
        src, dst = ((b[:, None] * self.block_size + offsets).flatten() for b in (src_blocks, dst_blocks))  # slots
        for store in (self.k, self.v, self.k_scale or [], self.v_scale or []):
            for t in store:
                if t.dim() == 5:  # keys by block
                    t[dst_blocks] = t[src_blocks]
                else:
                    t[dst] = t[src]


# The parent key of a sequence's first block.
ROOT_KEY = hashlib.sha256(b"leanlm prefix cache").digest()


def block_key(parent: bytes | None, tokens: list[int]) -> bytes:
    """SHA-256 of (parent key, the block's ids as int64): equal keys mean equal prefixes, collisions aside, which
    Python's `hash` (not collision resistant) could not promise: a collision would hand one request another's KV."""
    return hashlib.sha256((parent or ROOT_KEY) + array("q", tokens).tobytes()).digest()


class HasBlocks(Protocol):
    token_ids: list[int]      # prompt and output so far
    block_table: list[int]
    block_keys: list[bytes]   # prefix keys of the leading full blocks that are registered
    num_cached: int           # leading tokens found in the prefix cache at allocation
    max_len: int              # tokens it may hold when it ends: its blocks are kept in a row where they can be


class BlockManager:
    """Who holds which block: reference counts, the prefix cache (key -> block) and the free blocks, least
    recently freed first; each sequence's blocks placed in a row where they can be (`_next`). Owns no tensors: the
    runner reads and writes the pool by the block tables."""

    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref = [0] * num_blocks
        self.key_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> block holding exactly those tokens after exactly that prefix
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.shared = [False] * num_blocks  # found by a prefix hit since its contents were written
        self.reach = [0] * num_blocks  # a held block's span ends here: its holder may grow up to it
        self.cursor = 0  # where the next run of blocks is looked for
        self.queries = self.hits = 0  # prefix-cache lookups and hits, in tokens

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by a running sequence."""
        return 1 - len(self.free) / self.num_blocks

    def _take(self, block: int | None = None) -> int:
        """Take `block` (free), or else the least recently freed one; its cached contents are forgotten."""
        if block is None:
            block, _ = self.free.popitem(last=False)
        else:
            del self.free[block]
        key = self.key_of[block]
        if key is not None:  # evicted: its contents are about to be overwritten
            if self.cached.get(key) == block:
                del self.cached[key]
            self.key_of[block] = None
            self.shared[block] = False
        self.ref[block] = 1
        return block

    def _next(self, seq: HasBlocks) -> int:
        """Take the block seq's next positions go in. A sequence's blocks in order are read faster than scattered
        ones (benchmarks/kernels.py, section a), so: the block after its last one if that is free, else the first of
        a run of free blocks long enough for all seq may still write (its span), looked for from where the last run
        was placed (next fit), past the spans other sequences have yet to grow into. Blocks that a prefix hit found
        are left to the least-recently-freed order, taken only when no free block is in reach."""
        table = seq.block_table
        if table and table[-1] + 1 < self.num_blocks and self._loose(table[-1] + 1):
            self.reach[table[-1] + 1] = max(self.reach[table[-1]], table[-1] + 2)
            return self._take(table[-1] + 1)
        want = max(1, cdiv(seq.max_len, self.block_size) - len(table))
        start, _ = self._run(want)
        if start is None:  # the free blocks are all in others' spans: take the second half of the longest gap
            start, length = self._run(want, fenced=False)
            if start and self.ref[start - 1]:
                start += length // 2
        if start is None:
            block = self._take()
            self.reach[block] = block + 1
            return block
        self.reach[start] = min(start + want, self.num_blocks)
        self.cursor = self.reach[start] % self.num_blocks
        return self._take(start)

    def _loose(self, block: int) -> bool:
        """Free, and not a block a prefix hit found."""
        return self.ref[block] == 0 and not self.shared[block]

    def _run(self, want: int, fenced: bool = True) -> tuple[int | None, int]:
        """(first block, length) of the first run of `want` loose blocks from the cursor on, or else of the longest
        run (None: no loose block); fenced, past every held block's span. Runs do not wrap past the pool's end."""
        best, best_length = None, 0
        for block, end in ((self.cursor, self.num_blocks), (0, self.cursor)):
            length = 0
            while block < end:
                if fenced and self.ref[block]:
                    block, length = max(block + 1, self.reach[block]), 0
                    continue
                length = length + 1 if self._loose(block) else 0
                if length > best_length:
                    best, best_length = block - length + 1, length
                    if length >= want:
                        return best, best_length
                block += 1
        return best, best_length

    def allocate(self, seq: HasBlocks, reserve: int = 0, reuse: bool = True) -> bool:
        """Admit seq: take the longest cached prefix of its tokens (never the block of the last token, which must be
        computed to give logits; none with reuse=False, when every position's logits are wanted); the rest come with
        `grow`, chunk by chunk. False, with nothing taken, if all its tokens would leave fewer than `reserve` blocks
        free."""
        bs, tokens = self.block_size, seq.token_ids
        hits, keys, key = [], [], None
        if self.prefix_caching and reuse:
            for i in range((len(tokens) - 1) // bs):
                key = block_key(key, tokens[i * bs : (i + 1) * bs])
                if (block := self.cached.get(key)) is None:
                    break
                hits.append(block)
                keys.append(key)
        fresh = cdiv(len(tokens), bs) - len(hits)
        if fresh + sum(self.ref[b] == 0 for b in hits) + reserve > len(self.free):
            return False
        for block in hits:
            if self.ref[block] == 0:
                del self.free[block]
            self.ref[block] += 1
            self.shared[block] = True
        seq.block_table = hits
        seq.block_keys, seq.num_cached = keys, len(hits) * bs
        self.queries += len(tokens)
        self.hits += seq.num_cached
        return True

    def grow(self, seq: HasBlocks, num_tokens: int) -> bool:
        """Room for seq's first num_tokens tokens; False (nothing taken) if not enough blocks are free."""
        need = cdiv(num_tokens, self.block_size) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._next(seq))
        return True

    def room(self, seq: HasBlocks) -> int:
        """Tokens seq could hold with its blocks and every free one."""
        return (len(seq.block_table) + len(self.free)) * self.block_size

    def commit(self, seq: HasBlocks, num_computed: int) -> None:
        """Register the full blocks whose keys and values are now computed, so later prompts can reuse them."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_keys), num_computed // bs):
            key = block_key(seq.block_keys[-1] if seq.block_keys else None, seq.token_ids[i * bs : (i + 1) * bs])
            block = seq.block_table[i]
            self.cached.setdefault(key, block)  # a twin computed concurrently keeps the first one
            self.key_of[block] = key
            seq.block_keys.append(key)

    def fork(self, parent: HasBlocks, child: HasBlocks) -> list[tuple[int, int]] | None:
        """Give child parent's blocks: full ones shared (ref count up), the partial last one copied. Returns the
        (src, dst) copies for the pool, or None (nothing taken) if no block is free for the copy."""
        full = len(parent.token_ids) // self.block_size
        partial = len(parent.block_table) > full
        if partial and not self.free:
            return None
        for block in parent.block_table[:full]:
            self.ref[block] += 1
        child.block_table = parent.block_table[:full]
        child.block_keys, child.num_cached = list(parent.block_keys[:full]), 0
        if not partial:
            return []
        child.block_table.append(self._next(child))
        return [(parent.block_table[full], child.block_table[-1])]

    def release(self, seq: HasBlocks) -> None:
        """Drop seq's hold on its blocks; unheld ones join the free list, keeping their contents and keys."""
        for block in reversed(seq.block_table):  # the tail is evicted first: a prefix is only found whole
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None
        seq.block_table, seq.block_keys = [], []
