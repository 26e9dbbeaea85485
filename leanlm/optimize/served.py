"""A variant timed the way it will run: `leanlm serve` started with exactly the flags the report prints, then loaded
by streamed requests one level of concurrency after another (`bench.serve.run_load`). Level 1 gives the batch-1
TTFT and TPOT; the whole curve gives the throughput-latency trade-off that `optimize.plan` reads the request rate
at an SLO from. Nothing is derived: a speculative variant's TPOT is its served TPOT on the same prompts.

Each server gets the one warm-up request every `leanlm bench serve` run sends; one started with `--compile` has
built every batch size's graph before it answered /health (10-35 s each on 2 cores), so none is built under load."""

from __future__ import annotations

import asyncio
import itertools
import shlex
from pathlib import Path

import torch

from leanlm.bench.latency import kv_bytes_per_value, peak_matmul_gflops, utilization
from leanlm.bench.probe import peaks
from leanlm.bench.serve import LocalServer, run_load, summarize
from leanlm.errors import LeanLMError
from leanlm.models.config import ModelConfig
from leanlm.runtime import process_peak_rss_mb

CURVE_KEYS = ("max_concurrency", "requests", "failed", "duration_s", "request_throughput", "output_throughput",
              "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def serve_args(variant: dict, compiled: bool, threads: int | None = None) -> list[str]:
    """`leanlm serve` options that run `variant` as measured: compiled decode steps when `compiled`, but for an
    int8 KV cache, whose steps the engine runs eager (its quantization sits outside the graph)."""
    args = ["--compile"] if compiled and variant["kv_cache"] != "int8" else []
    if variant["dtype"] != "bfloat16":
        args += ["--dtype", variant["dtype"]]
    if variant["kv_cache"] == "int8":
        args += ["--kv-cache", "int8"]
    if variant["prompt_lookup"]:
        args += ["--prompt-lookup", str(variant["prompt_lookup"])]
    if variant.get("draft"):
        args += ["--draft", variant["draft"]]
    if threads:
        args += ["--threads", str(threads)]
    return args


def serve_command(variant: dict, model_dir: Path, compiled: bool, threads: int | None = None) -> str:
    return shlex.join(["leanlm", "serve", str(model_dir), *serve_args(variant, compiled, threads)])


def measure_served(model_dir: Path, args: list[str], prompts: list, levels: tuple[int, ...], requests: int,
                   new_tokens: int) -> dict:
    """Serve `model_dir` with `args`; at each concurrency of `levels` send max(requests, 2 x level) streamed
    requests of `new_tokens` tokens (greedy, ignore_eos), cycling through `prompts`. Returns the level-1 TTFT/TPOT
    medians and mean prompt length, the curve (bench summaries), the top level's output tokens/s and the server's
    peak RSS."""
    if levels[0] != 1:
        raise LeanLMError("the first timing level must be concurrency 1 (it gives TTFT and TPOT)")
    queue = itertools.cycle(prompts)
    curve = []
    with LocalServer.leanlm(str(model_dir), "variant", args, timeout=1800) as server:  # --compile: its graphs first

        def load(n: int, level: int, warmup: int = 0):
            batch = list(itertools.islice(queue, warmup + n))  # the warm-up first
            return asyncio.run(run_load(server.url, "variant", batch, new_tokens, max_concurrency=level,
                                        warmup=warmup))

        for level in levels:
            results, seconds = load(max(requests, 2 * level), level, warmup=int(level == 1))
            ok = [r for r in results if r.ok]
            if not ok:
                raise LeanLMError(f"every request failed at concurrency {level}: {results[0].error}")
            if level == 1:
                prompt_tokens = sum(r.prompt_tokens for r in ok) / len(ok)
            curve.append({k: v for k, v in {**summarize(results, seconds), "max_concurrency": level}.items()
                          if k in CURVE_KEYS})
        peak_mb = process_peak_rss_mb(server.proc.pid)
    first = curve[0]
    return {"ttft_ms": first["ttft_ms"]["p50"], "tpot_ms": first["tpot_ms"]["p50"],
            "tokens_per_s": 1000 / first["tpot_ms"]["p50"], "throughput": curve[-1]["output_throughput"],
            "peak_memory_mb": peak_mb, "curve": curve, "prompt_tokens": prompt_tokens}


def served_utilization(model_dir: Path, dtype: str, kv_cache: str, weight_bytes: int, prompt_tokens: float,
                       new_tokens: int, ttft_ms: float, tpot_ms: float, threads: int) -> tuple[float, float]:
    """(MBU, MFU) of the served batch-1 request: bench.latency's arithmetic on the served TTFT and TPOT (which
    include the server's HTTP, scheduling and detokenizing time)."""
    cfg, torch_dtype, peak = ModelConfig.from_dir(Path(model_dir)), getattr(torch, dtype), peaks("cpu", threads)
    _, mbu, mfu = utilization(cfg, weight_bytes, kv_bytes_per_value(cfg, torch_dtype, kv_cache == "int8"),
                              prompt_tokens, new_tokens, ttft_ms / 1e3, tpot_ms / 1e3, 1, peak.bandwidth_gbs,
                              peak_matmul_gflops(peak, torch_dtype, torch.device("cpu")))
    return mbu, mfu

