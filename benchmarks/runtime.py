"""Decode speed of the default model: leanlm (eager and compiled) vs transformers' generate.

    python benchmarks/runtime.py [--model smollm2-135m] [--threads 2] [--dtypes float32,bfloat16,float16]

Prints one table: decode tokens/s at batch 1 in every dtype, the ratio to transformers in the same dtype and
thread count, and MBU (bytes read per token / TPOT / measured peak read bandwidth). Each measurement runs in
a fresh process, one after the other, so that compiled graphs and allocator state of one do not touch another.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


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
    one = min(run(1) for _ in range(3))
    full = min(run(1 + new_tokens) for _ in range(2))
    return new_tokens / (full - one)


def measure(kind: str, model: str, dtype: str, threads: int, prompt_tokens: int, new_tokens: int) -> dict:
    """One measurement in this process: kind is transformers, eager or compiled."""
    from leanlm.models.loading import load
    from leanlm.bench.latency import bench
    from leanlm.models.zoo import resolve

    torch.set_num_threads(threads)
    if kind == "transformers":
        return {"tokens_per_s": transformers_decode_tps(resolve(model), getattr(torch, dtype), prompt_tokens, new_tokens)}
    net, _ = load(model, dtype, "cpu", progress=False)
    return bench(net, model, prompt_tokens, new_tokens, compiled=kind == "compiled").to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--one", nargs=2, metavar=("KIND", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one[:1], args.model, args.one[1], args.threads, args.prompt_tokens, args.new_tokens)))
        return

    from rich.console import Console
    from rich.table import Table

    from leanlm.bench.probe import peaks

    def run(kind: str, dtype: str) -> dict:
        cmd = [sys.executable, __file__, "--one", kind, dtype, "--model", args.model, "--threads", str(args.threads),
               "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{kind} {dtype} failed:\n{proc.stderr[-2000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        Console(stderr=True).print(f"[dim]{kind:12} {dtype:8} {result['tokens_per_s']:6.1f} tok/s[/]")
        return result

    bandwidth = peaks("cpu", args.threads).bandwidth_gbs
    table = Table(title=f"{args.model}, batch 1, {args.threads} thread(s), {args.new_tokens} tokens decoded after a "
                        f"{args.prompt_tokens}-token prompt; peak read bandwidth {bandwidth:.1f} GB/s")
    for col in ("dtype", "transformers tok/s", "eager tok/s", "eager / transformers", "eager MBU",
                "compiled tok/s", "compiled / transformers", "compiled MBU"):
        table.add_column(col, justify="right")
    for dtype in args.dtypes.split(","):
        ref, eager, compiled = (run(kind, dtype) for kind in ("transformers", "eager", "compiled"))
        ref = ref["tokens_per_s"]
        table.add_row(dtype, f"{ref:.1f}", f"{eager['tokens_per_s']:.1f}", f"{eager['tokens_per_s'] / ref:.2f}x",
                      f"{eager['mbu']:.0%}", f"{compiled['tokens_per_s']:.1f}",
                      f"{compiled['tokens_per_s'] / ref:.2f}x", f"{compiled['mbu']:.0%}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
