"""~2 bits a weight: AQLM's additive codebooks (`leanlm quantize --method aqlm`) next to 4-bit leanlm and llama.cpp's
Q2_K, and the decode kernel that reads them.

    python benchmarks/codebook.py [--model smollm2-135m] [--bits 2] [--samples 128] [--iters 100]
                                  [--distill-steps 200] [--distill-lr LR] [--sections k,m] [--wide PROJ,...]
                                  [--skip NAME,...] [--codes S] [--rotate]

k (kernel): microseconds of one decoder layer's gate_up_proj + down_proj (the default model's shapes) at 1-16 rows of
  x, over 40 layers' distinct weights in turn so that weights come from memory as in a model: bf16 (torch's GEMM and
  leanlm's bf16_gemm), int4 groups of 64 (the W4A16 kernel), additive codebooks with 2 and 3 codebooks
  (codebook_gemv), and the codebooks dequantized for one bf16 GEMM (the path past GEMV_ROWS).
m (model): each variant made once in a fresh process on the same --samples x 512 calibration windows and cached
  under $LEANLM_CACHE/bench-codebook/ with its time and peak RSS (delete that folder to re-make); Q2_K is leanlm's
  k-quant GGUF writer with an importance matrix from the same windows (within 0.01% of llama-quantize's perplexity
  in llama.cpp: benchmarks/kquants.py). All scored by leanlm on the first 16384 tokens of the evaluation split
  (perplexity, KL and top-1 against bf16); the GGUF is dequantized to float for it, which leaves out the 8-bit
  rounding of activations its llama.cpp dot products add (in its favour). bits/weight: the decoder projections'
  stored bits (codes, codebooks, scales; Q2_K's file types, including the Q4_K/Q5_0 fallbacks llama-quantize
  picks for rows 256 does not divide). Decode: `leanlm bench` batch-1 tokens/s in a fresh process (compiled).
  "+ distillation" is the recipe `[aqlm, {method: distill, steps: --distill-steps}]` (AQLM's end-to-end fine-tuning:
  codebooks, scales and norms trained on the bf16 model's distributions over the calibration split, 4 x 256 tokens
  a step): its distill step runs on the AQLM row's cached model, as the pipeline runs it after the aqlm step, and
  its seconds are both steps'. --wide mlp.down_proj,self_attn.o_proj adds AQLM with one more codebook on those
  projections (a recipe's `layers`; bits/weight still counts every projection), distilled the same way.
  --codes S lets the codes learn in the distill step too (PV-tuning's V step on at most S of each layer's groups every
  10 steps); --distill-lr its peak learning rate (cosine decay after warm-up). --rotate makes each AQLM row after
  the rotate step (QuaRot's Hadamard rotations folded into the weights, as QuIP# makes its weights incoherent before
  its codebooks; the tied lm_head untied, still bf16).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from pruning import distill_child, measured, quantize_child, wait_quiet, write_calibration  # shared with frontier.py

err = Console(stderr=True)
SHAPES = [(3072, 576), (576, 1536)]  # SmolLM2-135M's gate_up_proj and down_proj, (N, K)
LAYERS = 40  # distinct copies: 40 x 5.3 MB of bf16 weights, beyond the L3 cache


def kernel_table() -> Table:
    from leanlm import kernels

    ops = kernels.ops()
    gen = torch.Generator().manual_seed(0)

    def copies(make):
        return [[make(N, K) for N, K in SHAPES] for _ in range(LAYERS)]

    def codebook(C):
        return lambda N, K: (torch.randint(0, 256, (K // 8, C, N), dtype=torch.uint8, generator=gen),
                             torch.randn(C, 8, 256, generator=gen).to(torch.bfloat16),
                             torch.rand(N, generator=gen).to(torch.bfloat16))

    bf16 = copies(lambda N, K: torch.randn(N, K, generator=gen).to(torch.bfloat16))
    int4 = copies(lambda N, K: (torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen),
                                torch.rand(K // 64, N, generator=gen).to(torch.bfloat16),
                                torch.rand(K // 64, N, generator=gen).to(torch.bfloat16)))
    two, three = copies(codebook(2)), copies(codebook(3))
    variants = {  # name -> (the layers' weights, the product)
        "bf16 (torch)": (bf16, F.linear),
        "bf16 (bf16_gemm)": (bf16, lambda x, w: ops.bf16_gemm(x, w)),
        "int4 g64 (int4_gemv)": (int4, lambda x, w: ops.int4_gemv(x, *w, 64)),
        "2 codebooks (codebook_gemv)": (two, lambda x, w: ops.codebook_gemv(x, *w)),
        "3 codebooks (codebook_gemv)": (three, lambda x, w: ops.codebook_gemv(x, *w)),
        "2 codebooks dequantized + bf16 GEMM": (two, lambda x, w: F.linear(x, ops.codebook_dequant(*w))),
    }
    rows = (1, 2, 4, 8, 16)
    t = Table(title=f"one layer's gate_up + down from memory (us), {torch.get_num_threads()} threads, "
                    f"{ops.isa()} loops")
    t.add_column("weights")
    for m in rows:
        t.add_column(f"{m} rows", justify="right")
    wait_quiet()
    with torch.inference_mode():
        for name, (layers, f) in variants.items():
            times = []
            for m in rows:
                xs = [torch.randn(m, K, generator=gen).to(torch.bfloat16) for _, K in SHAPES]
                for layer in layers:  # once untimed
                    [f(x, w) for x, w in zip(xs, layer)]
                best = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    for layer in layers:
                        [f(x, w) for x, w in zip(xs, layer)]
                    best = min(best, (time.perf_counter() - start) / len(layers))
                times.append(best * 1e6)
            t.add_row(name, *(f"{us:.0f}" for us in times))
    return t


def q2k_child(model: str, calibration: str, output: str) -> None:
    """In a fresh process: leanlm's Q2_K GGUF with an importance matrix from the windows of `calibration`."""
    from safetensors.torch import load_file

    from leanlm.compress.quant.gguf_export import export_gguf, importance_matrix
    from leanlm.models.loading import load_model
    from leanlm.models.zoo import resolve
    from leanlm.runtime import peak_rss_mb

    net = load_model(resolve(model), "bfloat16")  # as `leanlm export --type` loads a bf16 model
    start = time.perf_counter()
    matrix = importance_matrix(net, load_file(calibration)["input_ids"])
    export_gguf(net, resolve(model), Path(output), False, "Q2_K", matrix)
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_mb": peak_rss_mb()}))


def projection_bits(path: Path) -> float:
    """Stored bits per weight of the decoder projections: a leanlm directory's modules, or a GGUF's tensors."""
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        tensors = [t for t in GGUFReader(str(path)).tensors if t.name.startswith("blk.")
                   and t.name.split(".")[2] in parts]
        return sum(int(t.n_bytes) * 8 for t in tensors) / sum(int(t.n_elements) for t in tensors)
    from leanlm.lowbit.linear import quantized_layers
    from leanlm.models.loading import load_model

    layers = quantized_layers(load_model(path, "bfloat16")).values()
    return sum(m.bits_per_weight * m.in_features * m.out_features for m in layers) / sum(
        m.in_features * m.out_features for m in layers)


def model_table(args) -> Table:
    from leanlm.bench.compare import Compared, quality, speed
    from leanlm.fetch import cache_dir

    root = cache_dir() / "bench-codebook" / args.model / f"n{args.samples}x512"
    calibration = root / "calibration.safetensors"
    write_calibration(args.model, args.samples, 512, calibration)
    me = str(Path(__file__).resolve())
    variants = [("GPTQ W4A16 g128", "gptq", {}), ("RTN W4A16 g128", "rtn", {"bits": 4})]
    aqlm, rotated = ("rotate+aqlm", "rotation + ") if args.rotate else ("aqlm", "")
    variants += [(f"{rotated}AQLM {b}x8", aqlm, {"bits": b, "iters": args.iters}) for b in args.bits]
    variants = [v for v in variants if v[1].split("+")[-1] not in args.skip]
    wide = [p for p in args.wide.split(",") if p]
    variants += [(f"{rotated}AQLM {b}x8, {' and '.join(wide)} {b + 1}x8", aqlm,
                  {"bits": b, "iters": args.iters, "layers": {f"layers.*.{p}": b + 1 for p in wide}})
                 for b in args.bits if wide]
    runs = []
    for label, method, options in variants:
        layers = ",".join(p.split(".")[-1] for p in options.get("layers", {}))
        out = root / "-".join([method, *(f"{k}{v}" for k, v in sorted(options.items()) if k != "layers"),
                               *([f"wide-{layers}"] if layers else [])])
        err.print(f"[dim]{args.model}: {label}[/]")
        runs.append((label, out, measured([sys.executable, me, "--child", args.model, method, json.dumps(options),
                                           str(calibration), str(out)], out)))
        if method.endswith("aqlm") and args.distill_steps:
            codes = f"-codes{args.codes}" if args.codes else ""
            lr = f"-lr{args.distill_lr}" if args.distill_lr else ""
            tuned = out.with_name(f"{out.name}+distill-steps{args.distill_steps}{codes}{lr}")
            err.print(f"[dim]{args.model}: {label} + distillation[/]")
            cost = measured([sys.executable, me, "--distill-child", args.model, str(out), str(args.distill_steps),
                             str(tuned), str(args.codes), str(args.distill_lr or 0)], tuned)
            learn = (f", codes {args.codes}" if args.codes else "") + (f", lr {args.distill_lr}" if lr else "")
            runs.append((f"{label} + distillation ({args.distill_steps} steps{learn})", tuned,
                         {"seconds": runs[-1][2]["seconds"] + cost["seconds"], "peak_mb": cost.get("peak_mb")}))
    if "q2k" not in args.skip:
        q2k = root / "q2k-imatrix.gguf"
        err.print(f"[dim]{args.model}: Q2_K[/]")
        runs.append(("llama.cpp Q2_K + imatrix (leanlm's writer)", q2k,
                     measured([sys.executable, me, "--q2k-child", args.model, str(calibration), str(q2k)], q2k)))
    record = root / f"quality{args.max_tokens}.json"
    if record.exists() and [r["model"] for r in json.loads(record.read_text())[1:]] != [str(p) for _, p, _ in runs]:
        record.unlink()  # scored other variants
    if not record.exists():
        wait_quiet()
        rows = quality(args.model, [str(p) for _, p, _ in runs], "bfloat16", "cpu", args.max_tokens)
        record.write_text(json.dumps([r.to_dict() for r in rows]))
    base, *rows = [Compared(**r) for r in json.loads(record.read_text())]
    t = Table(title=f"{args.model}: {args.max_tokens} evaluation tokens, calibration {args.samples} x 512, AQLM "
                    f"{args.iters} tuning steps a block; bf16 perplexity {base.perplexity:.3f}")
    for col in ("variant", "bits/weight", "perplexity", "gap", "KL", "top-1", "decode tok/s", "s", "peak MB"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    wait_quiet()
    t.add_row("bf16", "16.00", f"{base.perplexity:.3f}", "", "", "", f"{speed(args.model)['tokens_per_s']:.1f}", "", "")
    for (label, path, cost), row in zip(runs, rows):
        tok_s = "" if path.suffix == ".gguf" else f"{speed(str(path))['tokens_per_s']:.1f}"
        t.add_row(label, f"{projection_bits(path):.2f}", f"{row.perplexity:.3f}",
                  f"{row.perplexity / base.perplexity - 1:+.2%}", f"{row.kl:.4f}", f"{row.top1:.1%}", tok_s,
                  f"{cost['seconds']:.0f}", "" if cost.get("peak_mb") is None else f"{cost['peak_mb']:.0f}")
    return t


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        model, method, options, calibration, output = sys.argv[2:7]
        return quantize_child(model, method, json.loads(options), calibration, output, torch.get_num_threads())
    if sys.argv[1:2] == ["--distill-child"]:
        model, source, steps, output, codes, lr = sys.argv[2:8]
        return distill_child(model, source, int(steps), output, float(codes), float(lr) or None)
    if sys.argv[1:2] == ["--q2k-child"]:
        return q2k_child(*sys.argv[2:5])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bits", default="2", help="AQLM codebooks (bits a weight), comma-separated")
    ap.add_argument("--samples", type=int, default=128, help="calibration windows of 512 tokens")
    ap.add_argument("--iters", type=int, default=100, help="AQLM tuning steps a block")
    ap.add_argument("--distill-steps", type=int, default=200,
                    help="steps of AQLM's end-to-end distillation after each AQLM row (0: none)")
    ap.add_argument("--codes", type=float, default=0.0,
                    help="the distillation's codes learn too: the share of groups a code update may change (0: fixed)")
    ap.add_argument("--distill-lr", type=float, default=None,
                    help="the distillation's peak learning rate (default: the distill step's, 1e-3 after AQLM)")
    ap.add_argument("--max-tokens", type=int, default=16384, help="evaluation tokens")
    ap.add_argument("--wide", default="", help="also AQLM with one more codebook on these projections, "
                                               "comma-separated (e.g. mlp.down_proj,self_attn.o_proj)")
    ap.add_argument("--skip", default="", help="variants not to make: gptq, rtn, aqlm (the uniform rows), q2k")
    ap.add_argument("--sections", default="k,m", help="k: kernel, m: models")
    ap.add_argument("--rotate", action="store_true", help="the AQLM rows after the rotate step")
    args = ap.parse_args()
    args.bits = [int(b) for b in args.bits.split(",")]
    args.skip = {name for name in args.skip.split(",") if name}
    if unknown := args.skip - {"gptq", "rtn", "aqlm", "q2k"}:
        ap.error(f"--skip: unknown variants {', '.join(sorted(unknown))}")
    out = Console(width=160)
    if "k" in args.sections:
        out.print(kernel_table())
    if "m" in args.sections:
        out.print(model_table(args))


if __name__ == "__main__":
    main()
