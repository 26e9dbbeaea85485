"""Compiled decode steps for the engine: a step where every sequence feeds one token runs as one torch.compile'd
graph (inductor fuses each layer's elementwise work; at one sequence the projections become the batch-1 runtime's
streaming GEMVs). The batch size is a symbolic dimension of the graph, so a step runs exactly its sequences' rows,
no padding, and a few graphs cover every batch: one for a single sequence, one for each range of rows between the
row counts at which a module changes path (its row_splits(): where a Linear picks another product).
The default model's graph takes ~1-1.5 minutes to build cold on 2 cores (most of it g++), ~12 s from inductor's
cache; a graph per power-of-two batch, as before, made a cold `serve --compile` take 12 minutes on a Zen 3. Block
tables are as wide as the longest a context can need."""

from __future__ import annotations

import os
import pickle
import time

import torch

from leanlm import kernels
from leanlm.cache.paged import KVPool, cdiv, put, slot_of
from leanlm.cache.paged_attention import paged_kernel
from leanlm.engine import skeleton
from leanlm.generation.compiled import StepCompiler

MAX_SEQS = 256  # the most sequences a compiled step runs


def row_ranges(model, max_seqs: int = MAX_SEQS) -> list[tuple[int, int]]:
    """The batch sizes each graph covers, (first, last), up to max_seqs: one sequence alone (its own graph: the
    GEMV path), then ranges split after each row count at which one of the model's modules changes path (its
    `row_splits()`, such as kernels.bf16_rows() for a bf16 Linear)."""
    cuts = {t for m in model.modules() if hasattr(m, "row_splits") for t in m.row_splits() if 1 < t < MAX_SEQS}
    bounds = [1, *sorted(cuts), MAX_SEQS]
    ranges = [(1, 1)] + [(lo + 1, hi) for lo, hi in zip(bounds, bounds[1:])]
    return [(lo, hi) for lo, hi in ranges if lo <= max_seqs]


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
    """Decode steps of up to MAX_SEQS sequences through compiled graphs; `scratch` is a block no sequence owns (the
    steps `build` runs write it)."""

    def __init__(self, model, pool: KVPool, scratch: int):
        self.model, self.pool, self.scratch = model, pool, scratch
        self.width = cdiv(model.config.max_position, pool.block_size)
        self.compiler = StepCompiler(model, _paged_step)
        self.ranges = row_ranges(model)

    def build(self, max_seqs: int, log=lambda text: None) -> None:
        """Compile now every graph a batch of up to `max_seqs` sequences runs (a step on the scratch block each), so
        that no request pays a compilation. With a core to spare, a helper process compiles every other graph into
        inductor's caches meanwhile (g++ builds a graph on one core), and this process then loads those."""
        sizes = [lo for lo, _ in self.ranges if lo <= max_seqs]
        first = time.perf_counter()
        aside = sizes[-1::-2] if len(sizes) > 1 else ()  # the last range and every other one below it
        helper = self._helper(aside, log) if aside else None
        aside = aside if helper is not None else ()
        log(f"compiling {len(sizes)} decode steps, for {', '.join(self._describe(n) for n in sizes)} sequences "
            "(~1-2 minutes each on 2 cores, ~12 s once in inductor's cache"
            + (f"; {', '.join(self._describe(n) for n in aside)} in a helper process" if aside else "") + ")")
        for size in sizes:
            if size not in aside:
                self.run(*_scratch_batch(self.scratch, size))
        if helper is not None and (why := helper.wait(timeout=3600)):
            log(f"the helper process did not compile its decode steps ({why}): compiling them here")
        for size in aside:
            self.run(*_scratch_batch(self.scratch, size))
        log(f"{len(sizes)} compiled decode steps ready in {time.perf_counter() - first:.0f} s")

    def _describe(self, size: int) -> str:
        lo, hi = self._range(size)
        return str(lo) if lo == hi else f"{lo}-{hi}"

    def _range(self, size: int) -> tuple[int, int]:
        return next(r for r in self.ranges if r[0] <= size <= r[1])

    def _helper(self, sizes: tuple[int, ...], log) -> skeleton.Helper | None:
        """A process compiling the graphs of these batch sizes, on a CPU with a core to spare (CUDA graphs need no
        g++)."""
        if self.pool.v[0].device.type != "cpu" or len(os.sched_getaffinity(0)) < 2:
            return None
        try:
            return skeleton.Helper(compile_steps, self.model, self.pool, self.scratch, sizes)
        except (pickle.PicklingError, TypeError, AttributeError, RuntimeError, OSError) as e:  # not sent: build here
            log(f"compiling every decode step here: the model does not go to a helper process ({e})")
            return None

    @staticmethod
    def takes(num_seqs: int) -> bool:
        """Whether a decode step of num_seqs sequences runs compiled (a graph not built yet is compiled now)."""
        return num_seqs <= MAX_SEQS

    @staticmethod
    def supports(pool: KVPool) -> bool:
        """The kernel reads the pool, and the step writes raw entries (no int8 or int4 quantization in the graph)."""
        return pool.k[0].dtype == pool.dtype and paged_kernel(pool) is not None

    @torch.inference_mode()
    def run(self, tables: list[list[int]], positions: list[int], tokens: list[int]) -> torch.Tensor:
        """One token per sequence at `positions` -> logits [B, V] (B = len(tokens) <= MAX_SEQS)."""
        rows = self._range(len(tokens))
        return self.compiler((rows, self.pool.block_size), self._inputs(tables, positions, tokens),
                             batch=None if rows[0] == rows[1] else rows)

    def _inputs(self, tables: list[list[int]], positions: list[int], tokens: list[int]) -> dict:
        """_paged_step's inputs for one token per sequence, block tables as wide as the longest context."""
        bs = self.pool.block_size
        table = torch.zeros(len(tables), self.width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return dict(tokens=torch.tensor(tokens), positions=torch.tensor(positions),
                    slots=torch.tensor([slot_of(t, p, bs) for t, p in zip(tables, positions)]), tables=table,
                    lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32), k=self.pool.k, v=self.pool.v,
                    block_size=bs)


def compile_steps(model, pool: KVPool, scratch: int, sizes: tuple[int, ...]) -> None:
    """Compile the graphs of these batch sizes into inductor's on-disk caches (a helper process's work)."""
    decoder = CompiledPagedDecoder(model, pool, scratch)
    for size in sizes:
        decoder.run(*_scratch_batch(scratch, size))


def _scratch_batch(scratch: int, size: int) -> tuple[list[list[int]], list[int], list[int]]:
    """(tables, positions, tokens) of `size` sequences at position 0 of the scratch block."""
    return [[scratch]] * size, [0] * size, [0] * size
