"""Latency and throughput of one model: TTFT, TPOT, tokens/s, achieved GB/s, MBU, prefill MFU, peak memory."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch

from leanlm.analysis.memory import kv_bytes_per_token, param_count, weight_bytes_read
from leanlm.bench.probe import peaks
from leanlm.cache.static import StaticCache
from leanlm.cache.int8 import int8_bytes_per_head
from leanlm.generation.compiled import CompiledDecoder
from leanlm.generation.decode import decode_step, prefill
from leanlm.models.transformer import Transformer
from leanlm.runtime import matmul_dtype, peak_rss_mb, synchronize


@dataclass(frozen=True)
class BenchResult:
    """One measured configuration; tables and plots are made from lists of these."""

    model: str
    compiled: bool
    device: str
    dtype: str
    threads: int
    batch: int
    prompt_tokens: int
    new_tokens: int
    ttft_ms: float  # prefill of the prompt + first token
    tpot_ms: float  # median time per decoded token (per step of the whole batch)
    tokens_per_s: float  # decoded tokens per second, all rows together
    prefill_tokens_per_s: float
    weight_bytes: int  # read in full by every decode step
    gbs: float  # achieved bytes/s of a decode step (weights + KV read), in GB/s
    mbu: float  # gbs / peak bandwidth
    mfu: float  # prefill FLOP/s / peak matmul FLOP/s in this dtype
    peak_bandwidth_gbs: float
    peak_gflops: float
    peak_memory_mb: float  # peak resident memory of the process (CPU) or allocated device memory (CUDA)

    def to_dict(self) -> dict:
        return asdict(self)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mb()


@torch.inference_mode()
def bench(model: Transformer, name: str = "", prompt_tokens: int = 128, new_tokens: int = 64, batch: int = 1,
          warmup: int = 1, refresh_probe: bool = False, compiled: bool = False,
          cache_cls: type = StaticCache) -> BenchResult:
    """Time prefill and decode of random tokens (greedy, no early stop) on `model` as it is loaded.

    compiled: decode with a torch.compile'd step (the warm-up pass pays the compilation).
    cache_cls: StaticCache or cache.int8.Int8KVCache (GB/s then counts the int8 cache's bytes).
    """
    cfg, dev = model.config, model.device
    step = CompiledDecoder(model).decode_step if compiled else partial(decode_step, model)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_tokens), generator=gen).tolist()
    ttfts, steps = [], []
    for rep in range(warmup + 1):
        synchronize(dev)
        start = time.perf_counter()
        logits, cache = prefill(model, prompts, new_tokens, cache_cls=cache_cls)
        tokens = logits.argmax(-1)
        synchronize(dev)
        ttfts.append(time.perf_counter() - start)
        for _ in range(new_tokens - 1):
            start = time.perf_counter()
            tokens = step(cache, tokens).argmax(-1)
            synchronize(dev)
            if rep == warmup:
                steps.append(time.perf_counter() - start)
    ttft, tpot = ttfts[-1], statistics.median(steps)

    threads = torch.get_num_threads()
    peak = peaks(dev.type, threads, refresh=refresh_probe)
    dtype = str(model.dtype).removeprefix("torch.")
    weights = weight_bytes_read(model)
    peak_flops = peak_matmul_gflops(peak, model.dtype, dev)
    gbs, mbu, mfu = utilization(cfg, weights, kv_bytes_per_value(cfg, model.dtype, cache_cls is not StaticCache),
                                prompt_tokens, new_tokens, ttft, tpot, batch, peak.bandwidth_gbs, peak_flops)
    return BenchResult(
        model=name, compiled=compiled, device=str(dev), dtype=dtype, threads=threads, batch=batch,
        prompt_tokens=prompt_tokens, new_tokens=new_tokens,
        ttft_ms=ttft * 1e3, tpot_ms=tpot * 1e3, tokens_per_s=batch / tpot,
        prefill_tokens_per_s=batch * prompt_tokens / ttft, weight_bytes=weights,
        gbs=gbs, mbu=mbu, mfu=mfu,
        peak_bandwidth_gbs=peak.bandwidth_gbs, peak_gflops=peak_flops, peak_memory_mb=_peak_memory_mb(dev),
    )


def kv_bytes_per_value(cfg, dtype: torch.dtype, int8: bool) -> float:
    """Bytes a cached key or value element takes: the dtype's, or the int8 cache's (its scales included)."""
    return int8_bytes_per_head(cfg.head_dim) / cfg.head_dim if int8 else dtype.itemsize


def peak_matmul_gflops(peak, dtype: torch.dtype, device: torch.device) -> float:
    """The probed peak of the dtype prefill's products run in (float32 for fp16, and for bf16 on CPUs without a
    bf16 GEMM: runtime.matmul_dtype)."""
    compute = str(matmul_dtype(dtype, device)).removeprefix("torch.")
    return peak.matmul_gflops.get(compute, peak.matmul_gflops.get("float32"))


def utilization(cfg, weight_bytes: int, kv_item: float, prompt_tokens: float, new_tokens: int, ttft_s: float,
                tpot_s: float, batch: int, peak_gbs: float, peak_gflops: float) -> tuple[float, float, float]:
    """(GB/s, MBU, MFU): a decode step reads the weights and each row's KV cache (at its mean length over the
    decode), prefill computes 2 FLOPs per matmul weight per prompt token, attention and the last position's logits."""
    kv_read = kv_bytes_per_token(cfg, kv_item) * (prompt_tokens + new_tokens / 2) * batch
    gbs = (weight_bytes + kv_read) / tpot_s / 1e9
    counts = param_count(cfg)
    attn_flops = 2 * cfg.num_layers * cfg.q_size * prompt_tokens**2  # QK^T and PV, causal half of 4*T^2
    head_flops = 2 * cfg.vocab_size * cfg.hidden_size  # logits of the last position only
    flops = batch * (2 * (counts.attention + counts.mlp) * prompt_tokens + attn_flops + head_flops)
    return gbs, gbs / peak_gbs, flops / ttft_s / 1e9 / peak_gflops
