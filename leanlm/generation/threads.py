"""The thread count a model decodes fastest with, measured on this machine rather than assumed."""

from __future__ import annotations

import time

import torch

from leanlm.cache.static import StaticCache
from leanlm.runtime import cpu_count, set_threads, synchronize


@torch.inference_mode()
def pick_threads(model, requested: int | None = None, steps: int = 6) -> tuple[int, dict[int, float]]:
    """Use `requested`, or time a few decode steps at each thread count and keep the fastest.

    Two OpenMP threads collapse when another process holds a core, so the choice is measured, not assumed.
    Returns (threads, {threads: seconds per step}).
    """
    if requested is not None:
        set_threads(requested)
        return requested, {}
    if model.device.type != "cpu":
        return torch.get_num_threads(), {}
    timings = {}
    for n in sorted({1, max(1, cpu_count() // 2), cpu_count()}):
        torch.set_num_threads(n)
        timings[n] = decode_step_seconds(model, steps)
    threads = min(timings, key=timings.get)
    torch.set_num_threads(threads)
    return threads, timings


@torch.inference_mode()
def decode_step_seconds(model, steps: int = 6) -> float:
    """Best time of one single-token forward with a short cache (after a warm-up)."""
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    cache = StaticCache(model.config, 1, steps + 2, model.dtype, model.device)
    model(token, torch.zeros(1, 1, dtype=torch.long, device=model.device), cache)
    best = float("inf")
    for i in range(steps):
        synchronize(model.device)
        start = time.perf_counter()
        model(token, torch.tensor([[i + 1]], device=model.device), cache, last_only=True)
        synchronize(model.device)
        best = min(best, time.perf_counter() - start)
    return best
