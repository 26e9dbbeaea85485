"""Does compression make the server faster? leanlm bf16 against its W8A16, W8A8 (SmoothQuant) and W4A16 variants of the
same model, each served as a user starts it and loaded by `leanlm bench serve` (random token ids, 256 in / 128 out,
greedy, ignore_eos), one server at a time, no warm-up beyond the one request each bench run sends.

    python benchmarks/serving_variants.py [--model smollm2-135m] [--levels 1,4,16,32] [--compile]

Prints output tokens/s (and median TPOT) per variant and concurrency, and each variant's ratio to bf16. The variants
are made once with `leanlm quantize` into ~/.cache/leanlm/bench (as benchmarks/serving.py makes them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from leanlm.bench.probe import device_name
from leanlm.bench.serve import leanlm_command

CACHE = Path.home() / ".cache/leanlm/bench"
VARIANTS = {"W8A16 (rtn)": ("--method", "rtn", "--bits", "8"), "W8A8 (SmoothQuant)": ("--method", "smoothquant"),
            "W4A16 (rtn, g128)": ("--method", "rtn", "--bits", "4")}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def quantized(model: str, label: str, args: tuple[str, ...]) -> str:
    path = CACHE / f"{Path(model).name}-{label.split()[0].lower()}"
    if not path.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        log(f"quantizing {model} -> {path}")
        subprocess.run(leanlm_command("quantize", model, *args, "-o", str(path)), check=True, stdout=sys.stderr)
    return str(path)


def sweep(model: str, levels: list[int], serve_args: str) -> dict[int, dict]:
    """One `leanlm bench serve MODEL --sweep` run: a server started cold for it, every level in turn."""
    n = max(8, 2 * max(levels))
    cmd = leanlm_command("bench", "serve", model, "--sweep", ",".join(map(str, levels)), "--num-prompts", str(n),
                         "--input-len", "256", "--output-len", "128", "--json", "--serve-args", serve_args)
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return {row["max_concurrency"]: row for row in json.loads(r.stdout)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--levels", default="1,4,16,32")
    ap.add_argument("--compile", action="store_true", help="serve every variant with --compile")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    serve_args = "--compile" if args.compile else ""
    rows = {"bf16": sweep(args.model, levels, serve_args)}
    log(f"bf16: {[round(rows['bf16'][lv]['output_throughput']) for lv in levels]} tok/s")
    for label, qargs in VARIANTS.items():
        rows[label] = sweep(quantized(args.model, label, qargs), levels, serve_args)
        log(f"{label}: {[round(rows[label][lv]['output_throughput']) for lv in levels]} tok/s")
    print(f"{args.model}, {'--compile' if args.compile else 'eager'}, 256 in / 128 out, {device_name()}: output tok/s "
          "(median TPOT ms), and against bf16\n")
    print("| variant | " + " | ".join(f"{lv} concurrent" for lv in levels) + " |")
    print("|---|" + "---:|" * len(levels))
    base = rows["bf16"]
    for label, curve in rows.items():
        ratio = {lv: curve[lv]["output_throughput"] / base[lv]["output_throughput"] for lv in levels}
        cells = [f"{curve[lv]['output_throughput']:.0f} ({curve[lv]['tpot_ms']['p50']:.1f})"
                 + ("" if label == "bf16" else f", {ratio[lv]:.2f}x") for lv in levels]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
