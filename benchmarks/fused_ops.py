"""What leanlm's fused elementwise ops buy an eager bf16 model on the CPU: `LLM.generate` of random prompts (256 in /
128 out, greedy, ignore_eos) with `models.layers.fused_ops` on (RMSNorm, SiLU-and-multiply and the rotary embedding
one C++ op each) and off (the torch expressions), alternating in one process, fresh prompts every run (no prefix-cache
hits), output tokens/s.

    python benchmarks/fused_ops.py [--model smollm2-135m] [--prompts 1,32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import torch

import leanlm.models.layers as layers
from leanlm.bench.probe import device_name
from leanlm.engine import LLM
from leanlm.generation.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="1,32", help="prompts a run, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm, fused = LLM(args.model, dtype="bfloat16", quiet=True), layers.fused_ops
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)

    def tokens_per_s(n: int) -> float:
        prompts = torch.randint(100, 20000, (n, 256), generator=gen).tolist()
        start = time.perf_counter()
        llm.generate(prompts, params, progress=False)
        return n * 128 / (time.perf_counter() - start)

    tokens_per_s(2)  # the first run's one-time costs (kernel switches, allocator) in no row
    print(f"{args.model}, eager bf16, 256 in / 128 out, {device_name()}: output tok/s\n")
    print("| prompts | round | fused ops | torch ops | ratio |\n|---:|---:|---:|---:|---:|")
    try:
        for n in map(int, args.prompts.split(",")):
            for r in range(args.rounds):
                layers.fused_ops = fused
                on = tokens_per_s(n)
                layers.fused_ops = lambda *_: None
                off = tokens_per_s(n)
                print(f"| {n} | {r + 1} | {on:.0f} | {off:.0f} | {on / off:.2f}x |", flush=True)
    finally:
        layers.fused_ops = fused


if __name__ == "__main__":
    main()
