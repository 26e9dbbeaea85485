"""Quantization: what each scheme costs in quality and buys in speed and memory, as one table per model.

    python benchmarks/quantization.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--samples 128]
                                      [--max-tokens 16384] [--repeats 3] [--no-speed | --no-quality]

Every variant is made by `leanlm quantize` (the CLI a user runs) into $LEANLM_CACHE/bench-quant/ and reused
by later runs (delete that folder to re-quantize). Quality: perplexity on the first --max-tokens of the
built-in evaluation text (windows 1024, stride 512), KL and top-1 agreement to the bf16 model, in one process.
Speed (the first model only): batch-1 decode tokens/s of `leanlm bench --compile` in a fresh process per
variant, in --repeats round-robin rounds (median shown), as ratios to bf16 and to the fastest 16-bit dtype
measured in the same run. Run it on an otherwise idle machine: on two cores a second busy process halves speeds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from leanlm.bench.compare import quality, speed
from leanlm.fetch import cache_dir
from leanlm.lowbit.record import RECORD, VERSION

err = Console(stderr=True)

# name -> quantize options; "bf16" is the base model itself. 4-bit variants name their head: quantize gives
# them an int8 one unless told --lm-head 16
VARIANTS = {
    "rtn-w8a16": ["--method", "rtn", "--bits", "8"],
    "rtn-w8a16+head8": ["--method", "rtn", "--bits", "8", "--lm-head", "8"],
    "rtn-w4a16-g128": ["--method", "rtn", "--bits", "4", "--group-size", "128", "--lm-head", "16"],
    "rtn-w4a16-g128+head8": ["--method", "rtn", "--bits", "4", "--group-size", "128", "--lm-head", "8"],
    "rtn-w4a16-g128+head4": ["--method", "rtn", "--bits", "4", "--group-size", "128", "--lm-head", "4"],
    "gptq-w4a16-g128": ["--method", "gptq", "--group-size", "128", "--lm-head", "16"],
    "awq-w4a16-g128": ["--method", "awq", "--group-size", "128", "--lm-head", "16"],
    "rtn-w8a8": ["--method", "rtn", "--bits", "8", "--act-bits", "8"],
    "rtn-w4a8-g128": ["--method", "rtn", "--bits", "4", "--act-bits", "8", "--group-size", "128", "--lm-head", "16"],
    "gptq-w4a8-g128": ["--method", "gptq", "--act-bits", "8", "--group-size", "128", "--lm-head", "16"],
    "smoothquant-w8a8": ["--method", "smoothquant"],
    "llm-int8": ["--method", "llm_int8"],
    # recipes (written next to the variant): QuaRot's offline rotation before the quantization
    "rotate+rtn-w8a8": ["--recipe", "- method: rotate\n- {method: rtn, bits: 8, act_bits: 8}\n"],
    "rotate+rtn-w8a16": ["--recipe", "- method: rotate\n- {method: rtn, bits: 8}\n"],
    "rotate+smoothquant-w8a8": ["--recipe", "- method: rotate\n- method: smoothquant\n"],
    "rotate+gptq-w4a16-g128": ["--recipe", "- method: rotate\n- {method: gptq, group_size: 128}\n",
                               "--lm-head", "16"],
    "rotate+gptq-w4a8-g128": ["--recipe", "- method: rotate\n- {method: gptq, group_size: 128, act_bits: 8}\n",
                              "--lm-head", "16"],
    # and with QuaRot's online Hadamard on down_proj's input (leanlm-only models)
    "rotate-online+rtn-w8a8": ["--recipe", "- {method: rotate, online: true}\n- {method: rtn, bits: 8, act_bits: 8}\n"],
    "rotate-online+smoothquant-w8a8": ["--recipe", "- {method: rotate, online: true}\n- method: smoothquant\n"],
    "rotate-online+gptq-w4a8-g128": ["--recipe", "- {method: rotate, online: true}\n- {method: gptq, group_size: 128, "
                                     "act_bits: 8}\n", "--lm-head", "16"],
}  # fp8 is left out: on CPU its weights are upcast on the fly, 25-45x slower than bf16 (see FP8Linear)
CALIBRATED = ("gptq", "awq", "smoothquant")
SPEED = ("bf16", "fp16", "rtn-w8a16", "rtn-w8a16+head8", "rtn-w4a16-g128", "rtn-w4a16-g128+head8",
         "rtn-w4a16-g128+head4", "rtn-w8a8")


def quantized(model: str, variant: str, samples: int, seq_len: int) -> Path:
    """The variant's directory, made by `leanlm quantize` unless a previous run left it."""
    options = list(VARIANTS[variant])
    calibrated = any(m in o for o in options for m in CALIBRATED)
    tag = f"{variant}-n{samples}x{seq_len}" if calibrated else variant
    out = cache_dir() / "bench-quant" / model / tag
    if out.exists() and json.loads((out / RECORD).read_text()).get("version") != VERSION:
        shutil.rmtree(out)  # made by an older leanlm
    if "--recipe" in options:  # the YAML text -> a file
        i = options.index("--recipe") + 1
        recipe = out.parent / f"{tag}.yaml"
        recipe.parent.mkdir(parents=True, exist_ok=True)
        recipe.write_text(options[i])
        options[i] = str(recipe)
    if not out.exists():
        cmd = [sys.executable, "-m", "leanlm.cli", "quantize", model, *options, "-o", str(out)]
        if calibrated:
            cmd += ["--samples", str(samples), "--seq-len", str(seq_len)]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        err.print(f"[dim]{model} {variant}: quantized in {time.perf_counter() - start:.0f} s[/]")
    return out


def quality_table(model: str, args) -> Table:
    dirs = {v: quantized(model, v, args.samples, args.seq_len) for v in args.variants}
    rows = {r.model: r for r in quality(model, [str(d) for d in dirs.values()], "bfloat16", "cpu", args.max_tokens)}
    base = rows.pop(model)
    results = {"bf16": base} | {v: rows[str(d)] for v, d in dirs.items()}
    gap = {v: r.perplexity - base.perplexity for v, r in results.items()}

    def target(v: str) -> str:
        checks = {  # variant -> (the variant it is held against, the largest share of that gap, the goal)
            "rtn-w8a16": ("bf16", None, "within 0.5% of bf16"),
            "gptq-w4a16-g128": ("rtn-w4a16-g128", 0.5, "gap <= 1/2 RTN W4's"),
            "awq-w4a16-g128": ("rtn-w4a16-g128", 1.0, "better than RTN W4"),
            "smoothquant-w8a8": ("rtn-w8a8", 0.5, "gap <= 1/2 naive W8A8's"),
            "rotate+rtn-w8a8": ("smoothquant-w8a8", 0.5, "gap <= 1/2 SmoothQuant's"),
            "rotate+smoothquant-w8a8": ("smoothquant-w8a8", 0.5, "gap <= 1/2 SmoothQuant's"),
            "rotate-online+rtn-w8a8": ("smoothquant-w8a8", 0.5, "gap <= 1/2 SmoothQuant's"),
            "rotate-online+smoothquant-w8a8": ("smoothquant-w8a8", 0.5, "gap <= 1/2 SmoothQuant's"),
        }
        if v not in checks or checks[v][0] not in gap:
            return ""
        against, share, text = checks[v]
        ok = gap[v] <= 0.005 * base.perplexity if share is None else gap[v] <= share * gap[against]
        return f"{'[green]pass' if ok else '[red]FAIL'}[/] {text}"

    table = Table(title=f"{model}: quality on {args.max_tokens} tokens of the built-in evaluation "
                        f"text (bf16 activations; calibration {args.samples} x {args.seq_len} tokens)")
    for col in ("variant", "bits/weight", "disk MB", "memory MB", "formula MB", "perplexity", "gap", "KL", "top-1",
                "target"):
        table.add_column(col, justify="left" if col in ("variant", "target") else "right")
    for v, r in results.items():
        table.add_row(v, f"{r.bits_per_weight:.2f}", f"{r.disk_mb:.0f}", f"{r.memory_mb:.0f}", f"{r.formula_mb:.0f}",
                      f"{r.perplexity:.3f}", f"{gap[v] / base.perplexity:+.2%}", f"{r.kl:.4f}", f"{r.top1:.1%}", target(v))
    return table


def speed_table(model: str, args) -> Table:
    where = {}
    for v in SPEED:
        path = {"bf16": (model, "bfloat16"), "fp16": (model, "float16")}.get(v)
        where[v] = path or (str(quantized(model, v, args.samples, args.seq_len)), "bfloat16")
    trials = {v: [] for v in SPEED}
    for trial in range(args.repeats):  # round-robin, so that a slow spell of the machine hits every variant
        for v, (name, dtype) in where.items():
            trials[v].append(speed(name, dtype, args.threads))
            err.print(f"[dim]{trial + 1}/{args.repeats} {v:22} {trials[v][-1]['tokens_per_s']:6.1f} tok/s[/]")
    runs = {v: sorted(t, key=lambda r: r["tokens_per_s"])[len(t) // 2] for v, t in trials.items()}  # the median
    bf16 = runs["bf16"]["tokens_per_s"]
    fastest16 = max(runs["bf16"]["tokens_per_s"], runs["fp16"]["tokens_per_s"])
    goals = {"rtn-w8a16": 1.6, "rtn-w8a16+head8": 1.6, "rtn-w4a16-g128": 2.5, "rtn-w4a16-g128+head8": 2.5,
             "rtn-w4a16-g128+head4": 2.5}
    table = Table(title=f"{model}: batch-1 compiled decode, {args.threads} threads, 64 tokens after 64 "
                        f"(each a fresh process; median of {args.repeats} rounds)")
    # bytes limit: the ratio to bf16 if both streamed their weights at the same bandwidth (a bf16 lm_head keeps
    # W4A16 below 2.5x whatever the kernels do)
    for col in ("variant", "weights read MB", "tok/s", "vs bf16", "bytes limit", "vs fastest 16-bit", "target vs bf16",
                "MBU"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v, r in runs.items():
        t = r["tokens_per_s"]
        goal = goals.get(v)
        mark = "" if goal is None else f"{'[green]' if t / bf16 >= goal else '[red]'}>= {goal}x[/]"
        limit = runs["bf16"]["weight_bytes"] / r["weight_bytes"]
        table.add_row(v, f"{r['weight_bytes'] / 2**20:.0f}", f"{t:.1f}", f"{t / bf16:.2f}x", f"{limit:.2f}x",
                      f"{t / fastest16:.2f}x", mark, f"{r['mbu']:.0%}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--samples", type=int, default=128, help="calibration windows")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    ap.add_argument("--max-tokens", type=int, default=16384, help="evaluation tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="speed rounds (the median is shown)")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="quality: these variants only")
    args = ap.parse_args()
    args.variants = args.variants.split(",")
    out = Console(width=170)
    models = args.models.split(",")
    if not args.no_speed:
        out.print(speed_table(models[0], args))
    for model in models if not args.no_quality else []:
        out.print(quality_table(model, args))


if __name__ == "__main__":
    main()
