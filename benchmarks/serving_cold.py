"""A server as a user starts it: how long until `leanlm serve` answers, and how fast its first requests run.

    python benchmarks/serving_cold.py [--model smollm2-135m] [--concurrency 24] [--input-len 384] [--output-len 96]
                                      [--servers first,compile,eager]

Each server started cold: `first`, `leanlm serve --compile` on an empty inductor cache (its first start on a
machine: every graph compiled by g++); `compile`, the same again on the cache that start left; `eager`, `leanlm
serve`. For each, seconds until /health answers, then two waves of 4 x concurrency requests (random token ids,
greedy, ignore_eos) with no warm-up request at all; the first wave is what the first users get. A compiled server
builds every batch bucket's graph before it answers, so its first wave should run as fast as its second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from leanlm.bench.probe import device_name
from leanlm.bench.serve import LocalServer, random_prompts, run_load, summarize
from leanlm.models.zoo import resolve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=384)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--servers", default="first,compile,eager", help="which servers, in order (see above)")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="inductor-first-start-")  # empty until `first` fills it
    servers = {"first": ("leanlm serve --compile, first start", ["--compile"], {"TORCHINDUCTOR_CACHE_DIR": cache}),
               "compile": ("leanlm serve --compile, started again", ["--compile"], {"TORCHINDUCTOR_CACHE_DIR": cache}),
               "eager": ("leanlm serve (eager)", [], {})}
    n = 4 * args.concurrency
    print(f"{args.model}, {device_name()}: {args.concurrency} concurrent, {args.input_len} in / {args.output_len} out, "
          f"waves of {n} requests, no warm-up\n")
    print("| server | ready after s | first wave tok/s (TPOT p50 ms) | second wave tok/s (TPOT p50 ms) |")
    print("|---|---:|---:|---:|")
    for name in args.servers.split(","):
        label, serve_args, env = servers[name]
        start = time.perf_counter()
        with LocalServer.leanlm(str(resolve(args.model)), "model", serve_args, timeout=1800,
                                env={**os.environ, **env}) as server:
            ready = time.perf_counter() - start
            waves = []
            for wave in range(2):
                prompts = random_prompts(n, args.input_len, 32000, seed=100 + wave)
                results, seconds = asyncio.run(run_load(server.url, "model", prompts, args.output_len,
                                                        max_concurrency=args.concurrency, warmup=0))
                s = summarize(results, seconds)
                waves.append(f"{s['output_throughput']:.0f} ({s['tpot_ms']['p50']:.1f})")
        print(f"| {label} | {ready:.0f} | {waves[0]} | {waves[1]} |", flush=True)


if __name__ == "__main__":
    main()
