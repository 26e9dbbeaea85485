"""Mixed precision against uniform bits at equal size: per-projection sensitivity, then a knapsack per budget.

    python benchmarks/mixed_precision.py [--model smollm2-135m] [--options w4g128,w4g32,w8] [--chart-only prune50]
                                         [--tokens 512] [--eval-tokens 4096] [--out DIR]

1. Sensitivity: each decoder projection alone quantized with each --options entry (RTN), KL(float || model) on the
   first --tokens of the built-in *calibration* text (so the choice is not fitted to the evaluation text).
2. Budgets: the stored bytes of uniform w4g64 and of uniform w4g32 (the finer-group 4-bit configurations a user would
   otherwise pick), and of a hand rule in the spirit of llama.cpp's Q4_K_M (every mlp.down_proj in 8 bits, the
   rest w4g128). At each, the knapsack's assignment (no more bytes than the baseline) is applied with rtn, and
   written to --out as a `leanlm quantize --recipe` file.
3. Every variant against the float32 model on the first --eval-tokens of the built-in evaluation text (disjoint
   1024-token windows): KL, top-1 agreement, perplexity; bytes are the decoder projections' stored bytes
   (int4 scales and zeros included); the lm_head and embedding stay as they are in every variant.
Everything runs in float32 so that KL measures the quantization: in bf16 any change to one projection gives a
KL of ~1e-3 (bf16 rounding downstream), as large as an int8 projection's own. Not a timing benchmark.

Measured 2026-11 (smollm2-135m, 512 calibration tokens, 4096 evaluation tokens; KL / top-1 / perplexity):
uniform w4g64 (4.50 bits) 0.302 / 0.681 / 34.31 vs mixed w4g128+w4g32+w8 at <= its bytes 0.284 / 0.695 / 34.22;
uniform w4g32 (5.00) 0.277 / 0.684 / 33.23 vs mixed 0.144 / 0.778 / 30.76; the down_proj-w8 rule (5.38) 0.211 /
0.728 / 32.46 vs mixed 0.095 / 0.813 / 29.42. Mixing w4g128 and w8 only: 0.292 / 0.685 / 34.78 (perplexity worse
than uniform w4g64), 0.148, 0.099. The summed per-projection KLs over-predict the measured KL by 5-20%.
The sensitivity pass (120 projections x 4 options, 512 tokens) took 418 s on two Zen 4 cores (~0.9 s each).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from leanlm.analysis.memory import stored_bytes
from leanlm.models.loading import load
from leanlm.compress.quant.rtn import RTN
from leanlm.compress.registry import apply, decoder_linears
from leanlm.eval.datasets import load_text
from leanlm.eval.perplexity import score
from leanlm.optimize.sensitivity import (layer_sensitivity, mixed_assignment, mixed_config, mixed_recipe,
                                         parse_option, predicted_kl, sensitivity_chart)

err = Console(stderr=True)
MB = 1e6


def tokens_of(tok, split: str, n: int) -> torch.Tensor:
    text = load_text(None, split)
    return torch.tensor(tok.encode(text[: n * 8]))[:n]  # ~4 characters a token: 8 per token is plenty


def measure(name: str, base, reference, eval_ids, names: list[str], config=None, result=None) -> dict:
    """Apply `config` (if any) to a copy of `base` and score it against the float model."""
    model = copy.deepcopy(base)
    if config is not None:
        apply(model, config)
    nbytes = sum(stored_bytes(model.get_submodule(n)) for n in names)
    params = sum(reference.get_submodule(n).weight.numel() for n in names)
    t = time.time()
    ppl, agree = score(model, eval_ids, reference, window=1024, stride=1024)
    err.print(f"{name}: KL {agree.kl:.5f} ({time.time() - t:.0f} s)")
    row = dict(variant=name, mb=nbytes / MB, bits=nbytes * 8 / params, kl=agree.kl, top1=agree.top1,
               ppl=ppl.perplexity)
    if config is not None and result is not None:  # the knapsack's sum; unknown where an option was not measured
        predicted = predicted_kl(result, {n: _option_of(config, n) for n in names})
        if predicted < float("inf"):
            row["predicted_kl"] = predicted
    return row


def _option_of(config: RTN, name: str) -> str:
    bits, group = config.layer_bits(name)
    return "float" if bits == 16 else "w8" if bits == 8 else f"w4g{group}"


def uniform(option: str) -> RTN:
    o = parse_option(option)
    return RTN(o.bits, o.group_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--options", default="w4g128,w4g32,w8", help="RTN options the knapsack mixes (w8, w4g32|64|128)")
    ap.add_argument("--chart-only", default="", help="options measured for the chart only, e.g. prune50")
    ap.add_argument("--tokens", type=int, default=512, help="calibration tokens for the sensitivity pass")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=Path("/tmp/leanlm-mixed-precision"),
                    help="folder for sensitivity.json and sensitivity.png")
    args = ap.parse_args()
    options = args.options.split(",")
    reference, tok = load(args.model, "float32", "cpu", progress=False)
    names = [n for n, _ in decoder_linears(reference)]
    calib, eval_ids = tokens_of(tok, "calibration", args.tokens), tokens_of(tok, "evaluation", args.eval_tokens)

    t = time.time()
    done = [0]

    def tick(unit, option):
        done[0] += 1
        if done[0] % 20 == 0:
            err.print(f"sensitivity {done[0]} of {len(names)} projections x options ({time.time() - t:.0f} s)")

    measured_options = options + [o for o in args.chart_only.split(",") if o]
    result = layer_sensitivity(reference, calib, [parse_option(o) for o in measured_options], window=512,
                               progress=tick)
    err.print(f"sensitivity pass: {len(names)} projections x {len(measured_options)} options on {result.tokens} "
              "tokens in "
              f"{time.time() - t:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sensitivity.json").write_text(json.dumps(result.to_dict(), indent=1))
    sensitivity_chart(result, args.out / "sensitivity.png",
                      f"{args.model}: KL when one projection alone is quantized (or pruned)")
    err.print(f"wrote {args.out}/sensitivity.json and sensitivity.png")
    top = sorted(result.units, key=lambda u: -u.kl[options[0]])[:6]
    err.print("most sensitive at " + options[0] + ": " + ", ".join(f"{u.name} {u.kl[options[0]]:.4f}" for u in top))

    rows = [measure("float32 (reference)", reference, reference, eval_ids, names),
            measure("bf16, not quantized", load(args.model, "bfloat16", "cpu", progress=False)[0], reference,
                    eval_ids, names)]
    baselines = {f"uniform {o}": uniform(o) for o in ("w4g128", "w4g64", "w4g32", "w8")}
    rule = RTN(4, 128, layers={"layers.*.mlp.down_proj": 8})
    baselines["rule: down_proj w8, rest w4g128"] = rule
    measured = {}
    for name, config in baselines.items():
        measured[name] = measure(name, reference, reference, eval_ids, names, config, result)
        rows.append(measured[name])
    for name in ("uniform w4g64", "uniform w4g32", "rule: down_proj w8, rest w4g128"):
        budget = measured[name]["mb"] * MB
        mix = mixed_assignment(result, options, budget_bytes=budget)
        config = mixed_config(mix)
        counts = {o: list(mix.values()).count(o) for o in options}
        label = f"mixed {'/'.join(f'{o}:{c}' for o, c in counts.items())} <= {name.split(':')[0]}"
        rows.append(measure(label, reference, reference, eval_ids, names, config, result))
        recipe = args.out / f"mixed-{name.split(':')[0].replace(' ', '-')}.yaml"
        recipe.write_text(mixed_recipe(mix))
        err.print(f"{label}: recipe {recipe}")

    table = Table(title=f"{args.model}: mixed precision vs uniform bits (decoder projections; KL vs float32 on "
                        f"{args.eval_tokens} evaluation tokens)")
    for col in ("variant", "MB", "bits/weight", "predicted KL", "KL", "top-1", "perplexity"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"], f"{r['mb']:.2f}", f"{r['bits']:.3f}",
                      f"{r['predicted_kl']:.4f}" if "predicted_kl" in r else "", f"{r['kl']:.4f}",
                      f"{r['top1']:.4f}", f"{r['ppl']:.3f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    sys.exit(main())
