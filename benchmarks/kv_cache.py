"""KV-cache storage in the serving engine's paged pool: the model's dtype, int8 (a scale per token and head) and
int4 (KIVI: keys per channel over each block, values per token in groups of 32, the newest block's keys in full
precision), for quality, capacity and speed.

    python benchmarks/kv_cache.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--budget 16384] [--context 4096]
                                  [--decode 32] [--prompt 384] [--new 64]

Quality: the first --budget tokens of the built-in evaluation split cut into windows of --context tokens, all fed
at once through an engine whose pool holds just them (the "context budget"), each window's prompt log-probabilities
read back (chunked prefill: every chunk attends to the keys and values read from the pool, quantized ones
included). Perplexity over every position after a window's first, its gap to the model-dtype pool, and the mean
absolute change of a token's log-probability. Capacity: tokens and sequences of --context tokens that a 1 GiB
pool holds (the engine's own sizing: int4's side pool for max_num_seqs open blocks included). Speed: --decode
sequences of --prompt held-out tokens, --new greedy tokens each, output tokens per second (one run, after the
quality pass on the same engine: no extra warm-up).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from rich.console import Console
from rich.table import Table

from leanlm.cache.int4 import Int4KVPool
from leanlm.cache.paged import KVPool, cdiv
from leanlm.engine import LLM, Engine, EngineConfig
from leanlm.eval.datasets import load_text
from leanlm.generation.sampling import SamplingParams
from leanlm.models.loading import load

KINDS = ("auto", "int8", "int4")
GiB = 1 << 30


def run_kind(net, tok, kv: str, ids: list[int], args) -> dict:
    windows = [ids[i : i + args.context] for i in range(0, args.budget, args.context)]
    seqs = max(len(windows), args.decode)
    cfg, bs = net.config, EngineConfig.block_size
    capacity = Engine(net, tok, EngineConfig(kv_cache=kv, kv_cache_memory=GiB)).pool.num_blocks * bs
    blocks = cdiv(args.budget, bs) + seqs  # the budget's tokens, each window's token of output, nothing more
    if kv == "int4":
        memory = blocks * Int4KVPool.bytes_per_block(cfg, bs) + Int4KVPool.side_bytes(cfg, bs, net.dtype, seqs)
    else:
        memory = blocks * KVPool.bytes_per_block(cfg, bs, net.dtype, kv == "int8")
    llm = LLM(net, tok, config=EngineConfig(kv_cache=kv, max_num_seqs=seqs, kv_cache_memory=memory), quiet=True)
    start = time.perf_counter()
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    quality_s = time.perf_counter() - start
    logprobs = torch.tensor([t.logprob for o in outs for t in o.prompt_logprobs[1:]])
    prompts = [ids[i * args.prompt : (i + 1) * args.prompt] for i in range(args.decode)]
    start = time.perf_counter()
    done = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True))
    decode_s = time.perf_counter() - start
    return dict(logprobs=logprobs, ppl=math.exp(-logprobs.mean().item()), quality_s=quality_s,
                tokens_per_gib=capacity, seqs_per_gib=capacity // (args.context + 1),
                pool_tokens=llm.engine.capacity, out_tok_s=sum(len(o.outputs[0].token_ids) for o in done) / decode_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    p.add_argument("--budget", type=int, default=16384, help="tokens of context the pool holds and the text fills")
    p.add_argument("--context", type=int, default=4096, help="tokens per evaluation window")
    p.add_argument("--decode", type=int, default=32, help="sequences in the decode-speed run")
    p.add_argument("--prompt", type=int, default=384)
    p.add_argument("--new", type=int, default=64)
    args = p.parse_args()
    err = Console(stderr=True)
    for model in args.models.split(","):
        net, tok = load(model, "bfloat16", progress=False)
        ids = tok.encode(load_text(None))[: args.budget]
        results = {}
        for kv in KINDS:
            err.print(f"{model}: {kv} KV cache ...")
            results[kv] = run_kind(net, tok, kv, ids, args)
        base = results["auto"]
        table = Table(title=f"{model} (bfloat16): {args.budget} held-out tokens in windows of {args.context} through "
                            f"a pool of that budget; {args.decode} x ({args.prompt} + {args.new}) decode")
        for col in ("KV cache", "perplexity", "gap", "mean |Δ logprob|", "tokens in 1 GiB",
                    f"sequences of {args.context} in 1 GiB", "x bf16", "quality pass s", "decode out tok/s"):
            table.add_column(col, justify="left" if col == "KV cache" else "right")
        for kv, r in results.items():
            table.add_row(
                {"auto": "bfloat16", "int8": "int8 (per token/head)", "int4": "int4 (KIVI)"}[kv], f"{r['ppl']:.3f}",
                f"{(r['ppl'] / base['ppl'] - 1) * 100:+.2f}%", f"{(r['logprobs'] - base['logprobs']).abs().mean():.4f}",
                f"{r['tokens_per_gib']}", f"{r['seqs_per_gib']}", f"{r['tokens_per_gib'] / base['tokens_per_gib']:.2f}x",
                f"{r['quality_s']:.1f}", f"{r['out_tok_s']:.0f}")
        Console(width=200).print(table)


if __name__ == "__main__":
    main()
