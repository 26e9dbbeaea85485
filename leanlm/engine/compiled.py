"""Compiled decode steps for the engine: a step where every sequence feeds one token runs as one torch.compile'd
graph (inductor fuses each layer's elementwise work; at one sequence the projections become the batch-1 runtime's
streaming GEMVs). Shapes must be static, so the batch is padded up to a power of two (one graph per bucket) and
the block tables to the longest a context can need; padded rows write their keys and values to a scratch block.
Padding is not free where the products are compute-bound (24 sequences run 32 rows): each bucket's graph is timed
against eager steps when it is built (`build`, or its first use), and a batch runs eager where its bucket's graph
is measured slower."""

from __future__ import annotations

import bisect
import math
import os
import pickle
import time

import torch

from leanlm import kernels
from leanlm.cache.paged import KVPool, cdiv, put, slot_of
from leanlm.cache.paged_attention import paged_kernel
from leanlm.engine import skeleton
from leanlm.generation.compiled import StepCompiler

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_of(num_seqs: int) -> int:
    """The batch size a step of num_seqs sequences pads to (num_seqs <= BUCKETS[-1])."""
    return BUCKETS[bisect.bisect_left(BUCKETS, num_seqs)]


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
        self.fewest: dict[int, int] = {}  # bucket -> the fewest sequences its graph runs (measured when first used)
        self._eager: dict[int, float] = {}  # rows -> seconds of an eager step

    def build(self, max_seqs: int, log=lambda text: None) -> None:
        """Compile and measure now the graph of every bucket a batch of up to `max_seqs` sequences pads to (a step
        of that many rows on the scratch block each), so that no request pays a compilation. With a core to spare,
        a helper process compiles every other bucket into inductor's caches meanwhile (g++ builds a graph on one
        core), and this process then loads those from the caches; the timings run after it, alone."""
        sizes = BUCKETS[: bisect.bisect_left(BUCKETS, max_seqs) + 1]
        first = time.perf_counter()
        aside = sizes[-1::-2] if len(sizes) > 1 else ()  # the largest bucket and every other one below it
        helper = self._helper(aside, log) if aside else None
        aside = aside if helper is not None else ()
        log(f"compiling the decode steps of {', '.join(map(str, sizes))} sequences (~1 minute each on 2 cores"
            + (f"; {', '.join(map(str, aside))} in a helper process" if aside else "") + ")")
        for size in sizes:
            if size not in aside:
                self.run(*_scratch_batch(self.scratch, size))
        if helper is not None and (why := helper.wait(timeout=3600)):
            log(f"the helper process did not compile its decode steps ({why}): compiling them here")
        for size in sizes:
            self._measure(size)
        eager = ", ".join(f"{size // 2 + 1}-{n - 1} of {size}" for size in sizes
                          if (n := self.fewest[size]) > size // 2 + 1)
        log(f"{len(sizes)} compiled decode steps ready in {time.perf_counter() - first:.0f} s"
            + (f"; eager, where padding costs more than the graph saves: {eager} sequences" if eager else ""))

    def _helper(self, sizes: tuple[int, ...], log) -> skeleton.Helper | None:
        """A process compiling these buckets' graphs, on a CPU with a core to spare (CUDA graphs need no g++)."""
        if self.pool.v[0].device.type != "cpu" or len(os.sched_getaffinity(0)) < 2:
            return None
        try:
            return skeleton.Helper(compile_buckets, self.model, self.pool, self.scratch, sizes)
        except (pickle.PicklingError, TypeError, AttributeError, RuntimeError, OSError) as e:  # not sent: build here
            log(f"compiling every decode step here: the model does not go to a helper process ({e})")
            return None

    def takes(self, num_seqs: int) -> bool:
        """Whether a decode step of num_seqs sequences runs compiled: its bucket's graph measured faster than an
        eager step of that many rows (a bucket not built yet is compiled and measured now)."""
        if num_seqs > BUCKETS[-1]:
            return False
        size = bucket_of(num_seqs)
        if size not in self.fewest:
            self._measure(size)
        return num_seqs >= self.fewest[size]

    @torch.inference_mode()
    def _measure(self, size: int) -> None:
        """Compile the bucket's graph (if new) and set fewest[size] from its time and eager steps' at its size and
        the bucket below's, each the best of 3 on the scratch block (attention, the same kernel on both paths and
        one token here, is left out)."""
        batch = _scratch_batch(self.scratch, size)
        self.run(*batch)
        graph = _best_time(lambda: self.run(*batch))
        below = None if size == 1 else (size // 2, self._eager_time(size // 2))
        self.fewest[size] = fewest_compiled(size, graph, self._eager_time(size), below)

    def _eager_time(self, rows: int) -> float:
        if rows not in self._eager:
            inputs = self._inputs(*_scratch_batch(self.scratch, rows))
            self._eager[rows] = _best_time(lambda: _paged_step(self.model, **inputs))
        return self._eager[rows]

    @staticmethod
    def supports(pool: KVPool) -> bool:
        """The kernel reads the pool, and the step writes raw entries (no int8 or int4 quantization in the graph)."""
        return pool.k[0].dtype == pool.dtype and paged_kernel(pool) is not None

    @torch.inference_mode()
    def run(self, tables: list[list[int]], positions: list[int], tokens: list[int]) -> torch.Tensor:
        """One token per sequence at `positions` -> logits [B, V] (B = len(tokens) <= BUCKETS[-1])."""
        B = len(tokens)
        size = bucket_of(B)
        pad = size - B
        inputs = self._inputs(tables + [[self.scratch]] * pad, positions + [0] * pad, tokens + [0] * pad)
        return self.compiler((size, self.pool.block_size), inputs)[:B]

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


def compile_buckets(model, pool: KVPool, scratch: int, sizes: tuple[int, ...]) -> None:
    """Compile the graphs of these buckets into inductor's on-disk caches (a helper process's work)."""
    decoder = CompiledPagedDecoder(model, pool, scratch)
    for size in sizes:
        decoder.run(*_scratch_batch(scratch, size))


def fewest_compiled(size: int, graph: float, eager: float, below: tuple[int, float] | None) -> int:
    """The fewest sequences a bucket's graph should run: graph and eager, the seconds of its graph and of an eager
    step of `size` rows; below, (rows, eager seconds) of the bucket below (None for the first). The first B above
    `below` for which an eager step, taken as linear in B between the two eager times, is no faster than the graph;
    size + 1 if eager wins even unpadded."""
    if below is None:
        return 1
    lo, t_lo = below
    if graph <= t_lo:
        return lo + 1
    if graph > eager:
        return size + 1
    return lo + max(1, math.ceil((graph - t_lo) / (eager - t_lo) * (size - lo) - 1e-9))


def _best_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _scratch_batch(scratch: int, size: int) -> tuple[list[list[int]], list[int], list[int]]:
    """(tables, positions, tokens) of `size` sequences at position 0 of the scratch block."""
    return [[scratch]] * size, [0] * size, [0] * size
