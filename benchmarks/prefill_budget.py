"""How many prompt tokens should a step that also decodes take? `leanlm serve --max-prefill-tokens B` for each B,
each server started cold and loaded by `leanlm bench serve` with requests arriving as a Poisson process (random
token ids, 256 in / 128 out, greedy, ignore_eos), so that prompts keep arriving while others decode.

    python benchmarks/prefill_budget.py [--model smollm2-135m] [--budgets 0,64,128,256,512] [--rate 2]
                                        [--num-prompts 96]

A prompt chunk in a step lengthens that step for every sequence decoding in it: the inter-token latency's tail
(ITL p99) is what a smaller budget protects; the price is the new requests' time to first token. 0 is no budget of
its own (a step's whole --max-num-batched-tokens, 1024, minus its decodes). Prints one row per budget.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from rich.console import Console
from rich.table import Table

from leanlm.bench.probe import device_name
from leanlm.bench.serve import leanlm_command


def run(model: str, budget: int, rate: float, prompts: int) -> dict:
    """One `leanlm bench serve MODEL` run against a server started cold with this budget."""
    cmd = leanlm_command("bench", "serve", model, "--request-rate", str(rate), "--num-prompts", str(prompts),
                         "--input-len", "256", "--output-len", "128", "--json",
                         "--serve-args", f"--max-prefill-tokens {budget}")
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budgets", default="0,64,128,256,512")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    ap.add_argument("--num-prompts", type=int, default=96)
    args = ap.parse_args()
    table = Table(title=f"{args.model}, {args.rate:g} requests/s (Poisson), 256 in / 128 out, {device_name()}")
    for head in ("max prefill tokens", "output tok/s", "ITL p50 / p99 ms", "TPOT p50 / p99 ms",
                 "TTFT p50 / p99 ms", "E2E p50 ms"):
        table.add_column(head, justify="right")
    for budget in (int(b) for b in args.budgets.split(",")):
        r = run(args.model, budget, args.rate, args.num_prompts)
        print(f"budget {budget}: {r['output_throughput']:.0f} tok/s", file=sys.stderr, flush=True)
        both = lambda k: f"{r[k]['p50']:.1f} / {r[k]['p99']:.1f}"  # noqa: E731
        table.add_row(str(budget or "none"), f"{r['output_throughput']:.0f}", both("itl_ms"), both("tpot_ms"),
                      both("ttft_ms"), f"{r['e2el_ms']['p50']:.0f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
