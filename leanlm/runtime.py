"""Where and how a model runs: device choice, dtype default, and the thread count the runtime picks."""

from __future__ import annotations

import os
import time

import torch

from leanlm.errors import LeanLMError


def resolve_device(name: str | None = None) -> torch.device:
    """'cuda' when present unless told otherwise; a clear error for a device that is not there."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise LeanLMError(f"unknown device {name!r}; choose cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise LeanLMError("--device cuda was asked for, but no CUDA GPU is available here; use --device cpu")
    return torch.device(name)


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 everywhere: fast matrix products on this CPU (AVX512-BF16) and on GPUs, fp32's range."""
    return torch.bfloat16


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(n: int) -> None:
    if n < 1:
        raise LeanLMError(f"threads must be >= 1, got {n}")
    torch.set_num_threads(n)


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
    from leanlm.cache.static import StaticCache

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


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock timings are real (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
