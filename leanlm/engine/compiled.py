"""Compiled decode steps for the engine: a step where every sequence feeds one token runs as one torch.compile'd
graph (inductor fuses each layer's elementwise work; at one sequence the projections become the batch-1 runtime's
streaming GEMVs). Shapes must be static, so the batch is padded up to a power of two (one graph per bucket) and
the block tables to the longest a context can need; padded rows write their keys and values to a scratch block."""

from __future__ import annotations

import bisect
import time

import torch

from leanlm import kernels
from leanlm.cache.paged import KVPool, cdiv, put, slot_of
from leanlm.cache.paged_attention import paged_kernel
from leanlm.generation.compiled import StepCompiler

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _SlotWrites:
    """The KVCache of a compiled decode step: writes at given slots, attends by the paged-attention kernel."""

    def __init__(self, k, v, slots, tables, lens, block_size):
        self.k, self.v, self.slots, self.tables, self.lens, self.block_size = k, v, slots, tables, lens, block_size

    def attention_mask(self, T: int):
        return None, False

    def advance(self, T: int) -> None:
        pass

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               is_causal: bool) -> torch.Tensor:
        """q [1, B, H, D]; k, v [1, B, Hkv, D] -> [1, B, H, D]: one token per sequence"""
        put(self.k[layer], self.slots, k[0])
        self.v[layer].index_copy_(0, self.slots, v[0])
        return kernels.ops().paged_attention(q[0].contiguous(), self.k[layer], self.v[layer], self.tables, self.lens,
                                             self.block_size)[None]


def _paged_step(model, tokens, positions, slots, tables, lens, k, v, block_size):
    """tokens, positions, slots, lens [B]; tables [B, W] -> logits [B, V]"""
    cache = _SlotWrites(k, v, slots, tables, lens, block_size)
    return model(tokens[None], positions[None], cache)[0]


class CompiledPagedDecoder:
    """Decode steps of up to BUCKETS[-1] sequences through compiled graphs; `scratch` is a block no sequence owns."""

    def __init__(self, model, pool: KVPool, scratch: int):
        self.model, self.pool, self.scratch = model, pool, scratch
        self.width = cdiv(model.config.max_position, pool.block_size)
        self.compiler = StepCompiler(model, _paged_step)

    def build(self, max_seqs: int, log=lambda text: None) -> None:
        """Compile now the graph of every bucket a batch of up to `max_seqs` sequences pads to (a step of that many
        rows on the scratch block each), so that no request pays a compilation."""
        sizes = BUCKETS[: bisect.bisect_left(BUCKETS, max_seqs) + 1]
        first = time.perf_counter()
        for size in sizes:
            start = time.perf_counter()
            self.run([[self.scratch]] * size, [0] * size, [0] * size)
            log(f"compiled the decode step of {size} sequence{'s' * (size > 1)} in {time.perf_counter() - start:.0f} s")
        log(f"{len(sizes)} compiled decode steps ready in {time.perf_counter() - first:.0f} s")

    @staticmethod
    def supports(pool: KVPool) -> bool:
        """The kernel reads the pool, and the step writes raw entries (no int8 or int4 quantization in the graph)."""
        return pool.k[0].dtype == pool.dtype and paged_kernel(pool) is not None

    @torch.inference_mode()
    def run(self, tables: list[list[int]], positions: list[int], tokens: list[int]) -> torch.Tensor:
        """One token per sequence at `positions` -> logits [B, V] (B = len(tokens) <= BUCKETS[-1])."""
        B, bs = len(tokens), self.pool.block_size
        size = next(b for b in BUCKETS if b >= B)
        pad = size - B
        table = torch.zeros(size, self.width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        slots = [slot_of(t, p, bs) for t, p in zip(tables, positions)] + [self.scratch * bs] * pad
        inputs = dict(tokens=torch.tensor(tokens + [0] * pad), positions=torch.tensor(positions + [0] * pad),
                      slots=torch.tensor(slots), tables=table, lens=torch.tensor([p + 1 for p in positions] + [1] * pad,
                                                                               dtype=torch.int32),
                      k=self.pool.k, v=self.pool.v, block_size=bs)
        return self.compiler((size, bs), inputs)[:B]
