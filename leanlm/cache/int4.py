"""The int4 paged KV pool, as KIVI quantizes (https://arxiv.org/abs/2402.02750): keys per channel, values per token.

Keys have outlier channels (a few channels large in every token), so each channel of a block gets its own grid:
a float16 scale and minimum per (block, head, channel) over the block's tokens. Values have no such channels and are
quantized per token, in groups of 16 along the head dimension, after a rotation: each value is stored as v Q for a
random-sign Hadamard matrix Q of order head_dim (QuaRot's head rotation, done by the pool rather than folded into
v_proj), which spreads a value's large channels over its groups; since attention is linear in the values, the
attention output is rotated back once (PagedStep multiplies it by Q^T), not every value read. Codes are 4-bit, two
to a byte (channel 2i in the low nibble). A block's keys can be quantized only once all its tokens are known, so a
block still filling (each sequence's newest tokens, at most block_size - 1 of them) keeps its keys in full
precision in a small side pool with one entry per open block: KIVI's full-precision window. A sequence that stops
mid-block leaves its entry behind; when entries run out the least recently written one is quantized over the
tokens it holds, and should its block be written again it is opened again from the codes.

Each sequence's first token is kept exact besides its codes (one entry per sequence, least recently written
dropped first): most heads park their attention on it (an attention sink), so its rounding reaches every query.

Bytes per token and head at head_dim 64: 32 + 16 (keys: codes, a scale and a minimum per channel over 16 tokens)
+ 32 + 16 (values: codes, a scale and a minimum per group of 16) = 96, against 256 in bfloat16 and 136 in int8.
Measured on SmolLM2-135M (16k held-out tokens in four 4096-token windows; benchmarks/kv_cache.py), perplexity gap:
values in groups of 32 +1.21%, of 16 +0.86%; rotated groups of 16 +1.20%, and +0.74% with the first token exact.
The gap moves by a few tenths of a percent with small changes in the rounding of a few tokens (rotated values
rounded to bfloat16 before their grid: +0.64% without the exact first token; the first token left out of its
block's key grid: +0.95% with it), so read differences under ~0.3% as noise. Clipping the grids to their
least-squares ranges made it worse.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from leanlm import kernels
from leanlm.cache.paged import KVPool
from leanlm.errors import LeanLMError
from leanlm.lowbit.hadamard import rotation
from leanlm.models.config import ModelConfig

GROUP = 16  # values: channels per (scale, minimum); head_dim must be a multiple


def fit(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit grid over `dim`: codes uint8 in [0, 15], and the float16 scale and minimum (kept dim) that
    dequantize them as codes * scale + minimum. The codes are rounded under the float16 values that are stored."""
    x = x.float()
    low = x.amin(dim, keepdim=True).half()
    scale = ((x.amax(dim, keepdim=True) - low.float()) / 15).clamp(min=1e-7).half()
    codes = ((x - low.float()) / scale.float()).round_().clamp_(0, 15).to(torch.uint8)
    return codes, scale, low


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes in [0, 15] -> [..., D / 2] bytes (channel 2i low, 2i + 1 high)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., D / 2] bytes -> [..., D] float32 codes."""
    return torch.stack((packed & 15, packed >> 4), -1).flatten(-2).float()


@dataclass
class _Plan:
    """A step's key writes, as tensors. Keys of blocks that stay open go straight to their side entries
    (`direct_rows` of the step -> flat side rows `direct_side`). Blocks that fill up, and blocks opened again from
    their codes, gather their keys in a work buffer [W, block_size, Hkv, D] (from their side entry, `side_*`, or
    their codes, `codes_*`), take the new keys (`work_rows` -> `work_at`), then are quantized (`close_*`) or go back
    to a side entry (`back_*`). `evict`: (entry, block, tokens) side entries quantized and given up first."""
    count: int
    direct_rows: torch.Tensor
    direct_side: torch.Tensor
    width: int
    work_rows: torch.Tensor
    work_at: torch.Tensor
    side_work: torch.Tensor
    side_entry: torch.Tensor
    codes_work: torch.Tensor
    codes_block: torch.Tensor
    close_work: torch.Tensor
    close_block: torch.Tensor
    back_work: torch.Tensor
    back_entry: torch.Tensor
    evict: list[tuple[int, int, int]]
    sink_rows: torch.Tensor
    sink_entry: torch.Tensor


class Int4KVPool(KVPool):
    """KVPool (cache.paged) with 4-bit keys (per channel over each block) and values (rotated, per token, groups
    of 16).

    k[layer], v[layer]: packed codes [slots, Hkv, D / 2] (uint8); k_scale, k_min [blocks, Hkv, D] and
    v_scale, v_min [slots, Hkv, D / 16] (float16); side[layer] [open_blocks * block_size, Hkv, D] in the model dtype:
    the keys of blocks still filling. Written step by step: `prepare` (once per step, with every slot the step
    writes) plans which blocks close, open and move between side entries; `write` then stores each layer's keys and
    values by that plan."""

    int8 = False

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device=None,
                 open_blocks: int = 256):
        if num_blocks < 2:
            raise LeanLMError(f"the KV cache budget holds {num_blocks} blocks of {block_size} tokens; give it more memory")
        D, H = cfg.head_dim, cfg.num_kv_heads
        if D % GROUP:
            raise LeanLMError(f"the int4 KV cache quantizes values in groups of {GROUP} channels; this model's "
                              f"head_dim {D} is not a multiple: use --kv-cache int8")
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.open_blocks = open_blocks = min(open_blocks, num_blocks)
        slots, layers = num_blocks * block_size, range(cfg.num_layers)

        def empty(*shape, dt=torch.float16):
            return [torch.empty(shape, dtype=dt, device=device) for _ in layers]

        self.k, self.v = empty(slots, H, D // 2, dt=torch.uint8), empty(slots, H, D // 2, dt=torch.uint8)
        self.k_scale, self.k_min = empty(num_blocks, H, D), empty(num_blocks, H, D)
        self.v_scale, self.v_min = empty(slots, H, D // GROUP), empty(slots, H, D // GROUP)
        self.side = empty(open_blocks * block_size, H, D, dt=dtype)
        self.value_basis = rotation(D).float().to(device)  # values are stored (and read) as v Q
        self.entry_of = torch.full((num_blocks,), -1, dtype=torch.long, device=device)  # block -> side entry, or -1
        self.open: OrderedDict[int, list[int]] = OrderedDict()  # block -> [entry, tokens held], least recent first
        self.free_entries = list(range(open_blocks))
        # each sequence's first token (an attention sink: most heads attend to it), kept exact besides its codes
        self.sink_k, self.sink_v = empty(open_blocks, H, D, dt=dtype), empty(open_blocks, H, D, dt=dtype)
        self.sink_of = torch.full((num_blocks,), -1, dtype=torch.long, device=device)  # block -> sink entry, or -1
        self.sinks: OrderedDict[int, int] = OrderedDict()  # block -> sink entry, least recently written first
        self.free_sinks = list(range(open_blocks))
        self.evicted: dict[int, int] = {}  # block -> tokens its codes hold, for blocks given up before they filled
        self._plan: _Plan | None = None

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int) -> int:
        """Layers x kv heads x (keys: codes + a float16 scale and minimum per channel; values: codes + a float16
        scale and minimum per token and group)."""
        D = cfg.head_dim
        keys = block_size * D // 2 + 4 * D
        values = block_size * (D // 2 + 4 * (D // GROUP))
        return cfg.num_layers * cfg.num_kv_heads * (keys + values)

    @staticmethod
    def side_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, open_blocks: int) -> int:
        """The full-precision keys of `open_blocks` blocks still filling, and as many sequences' first tokens."""
        return open_blocks * (block_size + 2) * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    @classmethod
    def from_budget(cls, cfg: ModelConfig, memory: int, block_size: int, dtype: torch.dtype, device=None,
                    open_blocks: int = 256, extra_per_block: int = 0) -> Int4KVPool:
        """As many blocks as `memory` bytes hold besides the side pool, each also costing `extra_per_block` (as
        KVPool.from_budget)."""
        left = max(memory - cls.side_bytes(cfg, block_size, dtype, open_blocks), 0)
        blocks = left // (cls.bytes_per_block(cfg, block_size) + extra_per_block)
        return cls(cfg, blocks, block_size, dtype, device, open_blocks)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v + self.k_scale + self.k_min + self.v_scale + self.v_min
                   + self.side + self.sink_k + self.sink_v)

    def prepare(self, slots: torch.Tensor, firsts: list[int] = ()) -> None:
        """Plan the step that writes these slots (all layers write the same ones); `firsts`: those of them that
        hold a sequence's first token."""
        bs, slot_list = self.block_size, slots.tolist()
        span: dict[int, list[int]] = {}  # block -> [first, last] offset written
        for s in slot_list:
            b, o = divmod(s, bs)
            lo_hi = span.setdefault(b, [o, o])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], o), max(lo_hi[1], o)
        source, tokens = {}, {}  # block -> where its earlier keys are ("side", "codes", None), tokens it will hold
        for b, (lo, hi) in span.items():
            if lo == 0:  # a block (re)starting: nothing before it counts
                source[b], tokens[b] = None, hi + 1
                self.evicted.pop(b, None)
            elif b in self.open:
                source[b], tokens[b] = "side", max(self.open[b][1], hi + 1)
            else:  # quantized already (full, or evicted): open it again from its codes
                source[b], tokens[b] = "codes", max(self.evicted.pop(b, bs), hi + 1)
        work = {b: i for i, b in enumerate(b for b in span if tokens[b] >= bs or source[b] == "codes")}
        side_src = [(work[b], self.open[b][0]) for b in work if source[b] == "side"]
        close = [b for b in work if tokens[b] >= bs]
        for b in close:
            self._release(b)
        evict = []
        for b in span:
            if tokens[b] < bs:
                if b not in self.open:
                    if not self.free_entries:
                        evict.append(self._evict(exclude=span))
                    self.open[b] = [self.free_entries.pop(), 0]
                    self.entry_of[b] = self.open[b][0]
                self.open[b][1] = tokens[b]
                self.open.move_to_end(b)
        direct, worked = [], []
        for i, s in enumerate(slot_list):
            b, o = divmod(s, bs)
            if b in work:
                worked.append((i, work[b] * bs + o))
            else:
                direct.append((i, self.open[b][0] * bs + o))
        sinks = self._place_sinks(span, firsts, {s: i for i, s in enumerate(slot_list)})
        dev = self.entry_of.device

        def pair(items):
            first, second = zip(*items) if items else ((), ())
            return torch.tensor(first, dtype=torch.long, device=dev), torch.tensor(second, dtype=torch.long, device=dev)

        self._plan = _Plan(len(slot_list), *pair(direct), len(work), *pair(worked), *pair(side_src),
                           *pair([(work[b], b) for b in work if source[b] == "codes"]),
                           *pair([(work[b], b) for b in close]),
                           *pair([(work[b], self.open[b][0]) for b in work if b in self.open]), evict, *pair(sinks))

    def _place_sinks(self, span: dict[int, list[int]], firsts: list[int], row_of: dict[int, int]) -> list[tuple]:
        """(row of the step, sink entry) for each first token written; a block restarting with another token
        loses its sink. When entries run out the least recently written one is dropped (its codes stay)."""
        for b, (lo, _) in span.items():
            if lo == 0 and b * self.block_size not in firsts:
                self._drop_sink(b)
        placed = []
        for slot in firsts:
            b = slot // self.block_size
            placed.append((row_of[slot], self._sink(b)))
        return placed

    def _sink(self, block: int) -> int:
        """The block's sink entry, made (dropping the least recently written one if none is free) if it has none."""
        if block not in self.sinks:
            if not self.free_sinks:
                self._drop_sink(next(iter(self.sinks)))
            self.sinks[block] = self.free_sinks.pop()
            self.sink_of[block] = self.sinks[block]
        self.sinks.move_to_end(block)
        return self.sinks[block]

    def _drop_sink(self, block: int) -> None:
        if (entry := self.sinks.pop(block, None)) is not None:
            self.free_sinks.append(entry)
            self.sink_of[block] = -1

    def _release(self, block: int) -> None:
        held = self.open.pop(block, None)
        if held is not None:
            self.free_entries.append(held[0])
            self.entry_of[block] = -1

    def _evict(self, exclude) -> tuple[int, int, int]:
        """Give up the least recently written side entry of a block this step does not touch."""
        block = next((b for b in self.open if b not in exclude), None)
        if block is None:
            raise LeanLMError(f"the int4 KV cache has {self.open_blocks} full-precision entries for blocks still "
                              "filling, and one step fills more: raise open_blocks (the engine: max_num_seqs)")
        entry, tokens = self.open[block]
        self._release(block)
        self.evicted[block] = tokens
        return entry, block, tokens

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' keys and values by the plan of `prepare(slots)`  # k, v [N, Hkv, D]"""
        p = self._plan
        if p is None or p.count != len(slots):
            raise LeanLMError("Int4KVPool.write needs prepare() with the step's slots first")
        bs, (N, H, D) = self.block_size, k.shape
        k, side = k.to(self.dtype), self.side[layer]
        blocks = side.view(-1, bs, H, D)
        if p.width:  # read every source before the step's writes land in reused side entries
            work = torch.zeros(p.width, bs, H, D, dtype=self.dtype, device=k.device)
            work[p.side_work] = blocks[p.side_entry]
            if len(p.codes_block):
                work[p.codes_work] = self._keys_of_blocks(layer, p.codes_block)
        for entry, block, tokens in p.evict:
            self._store_keys(layer, torch.tensor([block], device=k.device), blocks[entry : entry + 1, :tokens])
        side.index_copy_(0, p.direct_side, k[p.direct_rows] if len(p.direct_rows) < N else k)
        if p.width:
            work.view(-1, H, D).index_copy_(0, p.work_at, k[p.work_rows])
            if len(p.close_block):
                self._store_keys(layer, p.close_block, work[p.close_work])
            blocks[p.back_entry] = work[p.back_work]
        rotated = v.float() @ self.value_basis  # [N, H, D]
        if (ops := self._ops()) is not None:
            codes, scale, low = ops.quantize_int4(rotated.view(N * H, D))
            codes, scale, low = codes.view(N, H, -1), scale.view(N, H, -1), low.view(N, H, -1)
        else:
            codes, scale, low = fit(rotated.view(N, H, D // GROUP, GROUP), -1)
            codes, scale, low = pack(codes.flatten(-2)), scale[..., 0], low[..., 0]
        self.v[layer].index_copy_(0, slots, codes)
        self.v_scale[layer].index_copy_(0, slots, scale)
        self.v_min[layer].index_copy_(0, slots, low)
        if len(p.sink_rows):
            self.sink_k[layer][p.sink_entry] = k[p.sink_rows]
            self.sink_v[layer][p.sink_entry] = rotated[p.sink_rows].to(self.dtype)

    def _store_keys(self, layer: int, blocks: torch.Tensor, keys: torch.Tensor) -> None:
        """Quantize whole blocks' keys per channel  # blocks [n]; keys [n, T <= block_size, Hkv, D]"""
        codes, scale, low = fit(keys, 1)
        T, bs = keys.shape[1], self.block_size
        slots = (blocks[:, None] * bs + torch.arange(T, device=blocks.device)).flatten()
        self.k[layer].index_copy_(0, slots, pack(codes).flatten(0, 1))
        self.k_scale[layer].index_copy_(0, blocks, scale[:, 0])
        self.k_min[layer].index_copy_(0, blocks, low[:, 0])

    def _keys_of_blocks(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """blocks [n] -> their quantized keys [n, block_size, Hkv, D]"""
        slots = blocks[:, None] * self.block_size + torch.arange(self.block_size, device=blocks.device)
        return self._keys(layer, slots)

    def _keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        blocks = slots // self.block_size
        return (unpack(self.k[layer][slots]) * self.k_scale[layer][blocks] + self.k_min[layer][blocks]).to(self.dtype)

    def _ops(self):
        """leanlm's C++ ops where they read and write this pool (CPU, a float32 or bfloat16 model), else None."""
        on_cpu = self.entry_of.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
        return kernels.ops() if on_cpu else None

    def _tensors(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The layer's pool as the C++ int4 ops take it."""
        return (self.k[layer], self.v[layer], self.k_scale[layer], self.k_min[layer], self.v_scale[layer],
                self.v_min[layer], self.side[layer], self.entry_of, self.sink_k[layer], self.sink_v[layer], self.sink_of)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at these slots in the model dtype (keys of open blocks from the side pool); the values in
        the rotated basis (v Q: attention over them gives its output times Q)"""
        if (ops := self._ops()) is not None:
            keys, values = ops.read_int4(*self._tensors(layer), slots.reshape(-1).contiguous(), self.block_size)
            return keys.view(*slots.shape, *keys.shape[1:]), values.view(*slots.shape, *values.shape[1:])
        keys = self._keys(layer, slots)
        entry = self.entry_of[slots // self.block_size]
        is_open = entry >= 0
        if bool(is_open.any()):
            side = self.side[layer][entry.clamp(min=0) * self.block_size + slots % self.block_size]
            keys = torch.where(is_open[..., None, None], side, keys)
        codes = unpack(self.v[layer][slots]).unflatten(-1, (-1, GROUP))
        values = codes * self.v_scale[layer][slots][..., None] + self.v_min[layer][slots][..., None]
        values = values.flatten(-2).to(self.dtype)
        sink = self.sink_of[slots // self.block_size]
        is_sink = (sink >= 0) & (slots % self.block_size == 0)
        if bool(is_sink.any()):
            is_sink, sink = is_sink[..., None, None], sink.clamp(min=0)
            keys = torch.where(is_sink, self.sink_k[layer][sink], keys)
            values = torch.where(is_sink, self.sink_v[layer][sink], values)
        return keys, values

    def attend_kernel(self, ops, layer: int, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """KVPool.attend_kernel over the codes, side pool and sinks (the output in the values' rotated basis)"""
        return ops.paged_attention_int4(q, *self._tensors(layer), tables, lens, self.block_size)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src to block dst in every layer, its side entry too if it is still filling."""
        bs, dev = self.block_size, self.entry_of.device
        for src, dst in pairs:
            s, d = torch.arange(src * bs, src * bs + bs, device=dev), torch.arange(dst * bs, dst * bs + bs, device=dev)
            for store in (self.k, self.v, self.v_scale, self.v_min):
                for t in store:
                    t[d] = t[s]
            for store in (self.k_scale, self.k_min):
                for t in store:
                    t[dst] = t[src]
            self._release(dst)
            self.evicted.pop(dst, None)
            self._drop_sink(dst)
            if src in self.sinks:  # dst's first token is src's
                self.sinks.move_to_end(src)  # not the one dropped to make room
                entry = self._sink(dst)
                for t in self.sink_k + self.sink_v:
                    t[entry] = t[self.sinks[src]]
            if src in self.evicted:
                self.evicted[dst] = self.evicted[src]
            if src in self.open:
                if not self.free_entries:
                    self._store_evicted(*self._evict(exclude={src}))
                entry = self.free_entries.pop()
                self.open[dst] = [entry, self.open[src][1]]
                self.entry_of[dst] = entry
                for t in self.side:
                    t.view(-1, bs, *t.shape[1:])[entry] = t.view(-1, bs, *t.shape[1:])[self.open[src][0]]

    def _store_evicted(self, entry: int, block: int, tokens: int) -> None:
        """Quantize an evicted side entry's keys into its block, in every layer (outside a step)."""
        blocks = torch.tensor([block], device=self.entry_of.device)
        for layer, t in enumerate(self.side):
            self._store_keys(layer, blocks, t.view(-1, self.block_size, *t.shape[1:])[entry : entry + 1, :tokens])
