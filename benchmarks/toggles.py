"""What one of leanlm's CPU paths buys a bf16 model (eager): `LLM.generate` of random prompts (256 in /
128 out, greedy, ignore_eos) with the path on and off, alternating in one process, fresh prompts every run (no
prefix-cache hits), output tokens/s. The paths:

- `fused-ops`: `models.layers.fused_ops` (RMSNorm, SiLU-and-multiply and the rotary embedding one C++ op each;
  off: the torch expressions);
- `prefill-attention`: leanlm's prefill kernel for prompt chunks (`cache.paged_attention.prefill_kernel`; off: the
  context gathered for torch's SDPA);
- `int8-keys-by-block`: an int8 KV pool (`kv_cache="int8"`, 1 GiB) keeping its keys by block
  (`cache.paged.keys_by_block`; off: by slot). The layout is chosen when a pool is made, so each side has its own
  engine, both loaded before the first run;

    python benchmarks/toggles.py [--path fused-ops|prefill-attention|int8-keys-by-block]
                                 [--model smollm2-135m] [--prompts 1,32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import torch

import leanlm.cache.paged as paged
import leanlm.cache.paged_attention as paged_attention
import leanlm.models.layers as layers
from leanlm.bench.probe import device_name
from leanlm.engine import LLM
from leanlm.generation.sampling import SamplingParams

PATHS = {"fused-ops": (layers, "fused_ops"), "prefill-attention": (paged_attention, "prefill_kernel"),
         "int8-keys-by-block": (paged, "keys_by_block")}


def engines(path: str, model: str):
    """A function from on/off to the LLM to run, turning the path on or off; and one that restores it."""
    module, name = PATHS[path]
    on_fn = getattr(module, name)

    def restore() -> None:
        setattr(module, name, on_fn)

    if path == "int8-keys-by-block":
        llms = {}
        for on in (True, False):
            setattr(module, name, on_fn if on else lambda *_: False)
            llms[on] = LLM(model, dtype="bfloat16", quiet=True, kv_cache="int8", kv_cache_memory="1GiB")
        restore()
        return llms.get, restore
    llm = LLM(model, dtype="bfloat16", quiet=True)

    def use(on: bool) -> LLM:
        setattr(module, name, on_fn if on else lambda *_: None)
        return llm

    return use, restore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", choices=sorted(PATHS), default="fused-ops")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="1,32", help="prompts a run, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    use, restore = engines(args.path, args.model)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)

    def tokens_per_s(on: bool, n: int) -> float:
        llm = use(on)
        prompts = torch.randint(100, 20000, (n, 256), generator=gen).tolist()
        start = time.perf_counter()
        llm.generate(prompts, params, progress=False)
        return n * 128 / (time.perf_counter() - start)

    for on in (True, False):  # the first run's one-time costs (kernel switches, allocator) in no row
        tokens_per_s(on, 2)
    print(f"{args.model}, eager bf16, 256 in / 128 out, {device_name()}, {args.path}: output tok/s\n")
    print("| prompts | round | on | off | ratio |\n|---:|---:|---:|---:|---:|")
    try:
        for n in map(int, args.prompts.split(",")):
            for r in range(args.rounds):
                on, off = tokens_per_s(True, n), tokens_per_s(False, n)
                print(f"| {n} | {r + 1} | {on:.0f} | {off:.0f} | {on / off:.2f}x |", flush=True)
    finally:
        restore()


if __name__ == "__main__":
    main()
