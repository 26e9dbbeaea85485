"""Does `leanlm optimize --quick` report what its recommendation delivers? (#38)

    python benchmarks/optimize_served.py [--model smollm2-135m] [--requests 16] [--output-len 64]

1. `leanlm optimize --quick` from a cold cache (a fresh LEANLM_CACHE; the pulled model, the built-in text and the
   machine's probed peaks are linked in, as they are on any machine that ran leanlm before), timed end to end.
2. The recommended variant served with the exact command the report printed, started cold, and measured with
   `leanlm bench serve --max-concurrency 1` on prompts the sweep never saw: passages of the built-in *calibration*
   text (the sweep times on the evaluation text), half as chat requests, as a JSONL --prompts file.
3. A table: every variant's reported TPOT, RPS at the SLO and frontier membership; the served check's median TPOT
   against the report's; and each speculative variant against its plain twin (does speculation pay here?).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from leanlm.bench.serve import LocalServer, leanlm_command
from leanlm.bench.workload import passage_prompts
from leanlm.fetch import cache_dir
from leanlm.models.zoo import pull
from leanlm.tokenizer import Tokenizer


def cold_cache(tmp: Path) -> dict:
    """An environment whose LEANLM_CACHE holds only what a prior leanlm run leaves that optimize does not measure."""
    home = tmp / "cache"
    home.mkdir()
    for name in ("models", "data", "probe.json"):
        if (cache_dir() / name).exists():
            (home / name).symlink_to(cache_dir() / name)
    return {**os.environ, "LEANLM_CACHE": str(home)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=16, help="requests of the served check")
    ap.add_argument("--output-len", type=int, default=64, help="tokens a request (as the quick sweep times)")
    args = ap.parse_args()
    source = pull(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = cold_cache(tmp)
        start = time.perf_counter()
        subprocess.run(leanlm_command("optimize", args.model, "--quick", "-o", str(tmp / "out")), env=env, check=True,
                       stdout=sys.stderr)
        minutes = (time.perf_counter() - start) / 60
        report = json.loads((tmp / "out" / "results.json").read_text())
        best = report["rows"][report["recommended"]]
        held = tmp / "held_out.jsonl"
        held.write_text("".join(json.dumps({"messages" if isinstance(p, list) else "prompt": p}) + "\n"
                                for p in passage_prompts(Tokenizer(source), 64, 128, "calibration", seed=1)))
        command = shlex.split(report["serve_command"])
        assert command[:2] == ["leanlm", "serve"], command
        with LocalServer.leanlm(command[2], "recommended", command[3:]) as server:
            proc = subprocess.run(leanlm_command("bench", "serve", server.url, "--max-concurrency", "1",
                                                 "--num-prompts", str(args.requests), "--prompts", str(held),
                                                 "--output-len", str(args.output_len), "--json"),
                                  capture_output=True, text=True, check=True)
        served = json.loads(proc.stdout)
    print(f"`leanlm optimize --quick` on {args.model}, cold cache: {minutes:.1f} min (target <= 10); "
          f"SLO {', '.join(report['slo'])}\n")
    print("| variant | ppl | TPOT ms (report) | TTFT ms | RPS at SLO | tok/s, top load | frontier |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in report["rows"]:
        mark = " (recommended)" if r["name"] == best["name"] else ""
        print(f"| {r['name']}{mark} | {r['perplexity']:.3f} | {r['tpot_ms']:.2f} | {r['ttft_ms']:.0f} | {r['rps']:.2f} "
              f"| {r['throughput']:.0f} | {', '.join(r['on_frontier']) or '-'} |")
    ratio = served["tpot_ms"]["p50"] / best["tpot_ms"]
    verdict = "within" if abs(ratio - 1) <= 0.15 else "outside"
    print(f"\nrecommended: {best['name']}; served with `{report['serve_command']}` and measured by `leanlm bench serve "
          f"--max-concurrency 1` on {args.requests} held-out prompts: median TPOT {served['tpot_ms']['p50']:.2f} ms "
          f"against the report's {best['tpot_ms']:.2f} ms: {ratio:.2f}x ({verdict} 15%)")
    by_steps = {}
    for r in report["rows"]:
        weights = json.dumps([r["variant"][k] for k in ("steps", "dtype", "kv_cache")])
        by_steps.setdefault(weights, []).append(r)
    for twins in by_steps.values():
        plain = next((r for r in twins if not r["variant"]["prompt_lookup"] and not r["variant"].get("draft")), None)
        for r in twins:
            if plain is not None and r is not plain:
                rps = f"{r['rps'] / plain['rps']:.2f}x" if plain["rps"] else f"{r['rps']:.2f} against 0"
                print(f"speculation: {r['name']} against {plain['name']}: TPOT {plain['tpot_ms'] / r['tpot_ms']:.2f}x "
                      f"faster, RPS at SLO {rps}")


if __name__ == "__main__":
    main()
