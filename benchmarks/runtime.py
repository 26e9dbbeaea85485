"""Decode speed of the default model: leanlm (eager and compiled) vs transformers' generate, one run.

    python benchmarks/runtime.py [--model smollm2-135m] [--threads N] [--new-tokens 64]

Prints one table: decode tokens/s at batch 1 for every dtype, the ratio to transformers in the same dtype
and thread count, and MBU (bytes read per token / TPOT / measured peak bandwidth).
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from leanlm.api import load
from leanlm.bench.latency import bench
from leanlm.bench.probe import peaks
from leanlm.models.zoo import resolve


def transformers_decode_tps(path, dtype, prompt_tokens: int, new_tokens: int) -> float:
    """Decode tokens/s of transformers' generate: (time for 1 + n tokens - time for 1 token) / n."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))

    def run(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    run(4)  # warm-up
    one, full = min(run(1) for _ in range(2)), run(1 + new_tokens)
    return new_tokens / (full - one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve(args.model)
    peak = peaks("cpu", args.threads)
    table = Table(title=f"{args.model}, batch 1, {args.threads} thread(s), decode after a {args.prompt_tokens}-token "
                        f"prompt; peak read bandwidth {peak.bandwidth_gbs:.1f} GB/s")
    for col in ("dtype", "transformers tok/s", "leanlm eager tok/s", "leanlm compiled tok/s", "compiled / transformers",
                "TPOT ms", "MBU"):
        table.add_column(col, justify="right")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        ref = transformers_decode_tps(path, dtype, args.prompt_tokens, args.new_tokens)
        model, _ = load(path, dtype, "cpu", progress=False)
        eager = bench(model, args.model, args.prompt_tokens, args.new_tokens)
        compiled = bench(model, args.model, args.prompt_tokens, args.new_tokens, compiled=True)
        table.add_row(name, f"{ref:.1f}", f"{eager.tokens_per_s:.1f}", f"{compiled.tokens_per_s:.1f}",
                      f"{compiled.tokens_per_s / ref:.2f}x", f"{compiled.tpot_ms:.2f}", f"{compiled.mbu:.0%}")
        Console().print(f"[dim]{name}: transformers {ref:.1f}, eager {eager.tokens_per_s:.1f} ({eager.mbu:.0%} MBU), "
                        f"compiled {compiled.tokens_per_s:.1f} tok/s[/]")
    Console().print(table)


if __name__ == "__main__":
    main()
