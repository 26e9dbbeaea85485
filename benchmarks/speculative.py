"""Speculative decoding vs plain decoding of the same target, greedy, eager, batch 1, one run.

    python benchmarks/speculative.py [--threads 2] [--new-tokens 96]

Rows: qwen2.5-coder-0.5b drafting for qwen2.5-coder-1.5b on code prompts (bfloat16), and prompt lookup on
input-grounded prompts (edit, continue, quote a given passage) on the default model (bfloat16 and float32).
Each row runs `leanlm bench ... --json` in a fresh process; speedups are ratios measured within that process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from rich.console import Console
from rich.table import Table

ROWS = [
    ("qwen2.5-coder-1.5b", ["--draft", "qwen2.5-coder-0.5b"], "bfloat16"),
    ("smollm2-135m", ["--prompt-lookup", "3"], "bfloat16"),
    ("smollm2-135m", ["--prompt-lookup", "3"], "float32"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args()
    table = Table(title=f"speculative decoding, greedy, batch 1, eager, {args.threads} thread(s), "
                        f"{args.new_tokens} new tokens per prompt")
    for col in ("target", "proposer", "dtype", "K", "acceptance a", "tokens/forward", "draft share", "c",
                "predicted", "measured", "measured/predicted", "plain tok/s", "spec tok/s", "same output"):
        table.add_column(col, justify="right")
    for model, extra, dtype in ROWS:
        cmd = [sys.executable, "-m", "leanlm.cli", "bench", model, *extra, "--dtype", dtype, "--threads",
               str(args.threads), "--new-tokens", str(args.new_tokens), "--json"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        proposer = f"draft {r['draft']}" if r["draft"] else f"prompt lookup n<={r['prompt_lookup']}"
        table.add_row(model, proposer, dtype, str(r["k"]), f"{r['acceptance']:.1%}", f"{r['tokens_per_target_forward']:.2f}",
                      f"{r['draft_time_share']:.0%}", f"{r['cost_ratio']:.2f}", f"{r['predicted_speedup']:.2f}x",
                      f"{r['measured_speedup']:.2f}x", f"{r['measured_speedup'] / r['predicted_speedup']:.0%}",
                      f"{r['plain_tokens_per_s']:.1f}", f"{r['spec_tokens_per_s']:.1f}", f"{r['identical_outputs']}/{r['prompts']}")
        Console(stderr=True).print(f"[dim]{model} {proposer} {dtype}: measured {r['measured_speedup']:.2f}x[/]")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
