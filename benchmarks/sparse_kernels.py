"""2:4-sparse int8 weights in their compact form (int8_24_gemv, 0.625 bytes a weight) against the dense int8 kernel
(int8_gemv, 1 byte) on the same codes: the default model's projections and larger matrices, M = 1, 2, 4, 8 rows.

    python benchmarks/sparse_kernels.py [--threads 2] [--rounds 5] [--baseline REV]
    python benchmarks/sparse_kernels.py --e2e DIR [--lm-head 8]  # DIR: `leanlm prune MODEL --method sparsegpt
                                                                 #   --pattern 2:4 --bits 8 -o DIR`

Weights rotate through ~256 MB of copies so every call reads them from memory, as decode does. The two kernels
alternate within each round; a cell is the median over rounds. The most the smaller format can give is 1.6x.
--baseline REV adds int8_24_gemv as built from git revision REV's kernel sources (a change's before and after, timed
in the same rounds); ns/64 is nanoseconds per 64 weights.
--e2e: batch-1 greedy decode (compiled step) of that model as saved (W8A16Sparse24Linear) against the same codes
in W8A16Linear, alternating in one process: tokens/s per round and the median ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from leanlm import kernels
from leanlm.compress.sparse.masks import nm_mask
from leanlm.lowbit.sparse24 import pack_24

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "2048x8192": (2048, 8192), "8192x2048": (8192, 2048)}  # [N, K]; the first four: SmolLM2-135M


def seconds(fn, calls: list[tuple], reps: int) -> float:
    for args in calls[:2]:
        fn(*args)
    start = time.perf_counter()
    for i in range(reps):
        fn(*calls[i % len(calls)])
    return (time.perf_counter() - start) / reps


def baseline_ops(rev: str):
    """The kernels as they were at git revision rev (cpu.cpp, sparse.cpp, common.h), built under their own namespace."""
    from torch.utils.cpp_extension import load

    sources = [kernels.SOURCE, *kernels.SOURCES[1:], kernels.HEADER]
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    commit = subprocess.check_output(["git", "rev-parse", "--short", rev], text=True).strip()
    tmp = Path(tempfile.mkdtemp(prefix=f"leanlm-{commit}-"))
    for src in sources:
        text = subprocess.check_output(["git", "show", f"{commit}:{src.resolve().relative_to(root)}"], text=True)
        (tmp / src.name).write_text(text)
    name = f"leanlm_base_{commit}"
    flags = ["-O3", "-march=native", "-fopenmp", f"-DLEANLM_NS={name}"]
    load(name=f"{name}_kernels", sources=[str(tmp / s.name) for s in sources[:-1]], extra_cflags=flags,
         extra_ldflags=["-fopenmp"], is_python_module=False)
    return getattr(torch.ops, name)


def e2e(path: str, rounds: int, lm_head: int, new_tokens: int = 64) -> None:
    """Decode tokens/s of the compact model and its dense-int8 twin, measured in alternation."""
    import copy

    from leanlm.compress.registry import apply
    from leanlm.pipeline import make_config
    from leanlm.generation.compiled import CompiledDecoder
    from leanlm.generation.decode import prefill
    from leanlm.lowbit.linear import W8A16Linear, W8A16Sparse24Linear
    from leanlm.lowbit.record import replace
    from leanlm.models.loading import load_model

    compact = load_model(path, torch.bfloat16)
    if lm_head in (4, 8):
        apply(compact, make_config("lm_head", {"bits": lm_head, "group_size": 64}))
    dense = copy.deepcopy(compact)
    for name, m in list(dense.named_modules()):
        if isinstance(m, W8A16Sparse24Linear):
            w8 = W8A16Linear(m.in_features, m.out_features, m.bias)
            w8.weight, w8.scales = m.codes(), m.scales.clone()
            replace(dense, name, w8)
    models = {"dense int8": dense, "2:4 compact": compact}
    decoders = {k: CompiledDecoder(m) for k, m in models.items()}
    prompt = torch.randint(0, compact.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0)).tolist()
    rates: dict[str, list[float]] = {k: [] for k in models}
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 compiles and warms up
            for key, model in models.items():
                logits, cache = prefill(model, prompt, new_tokens)
                tokens, steps = logits.argmax(-1), []
                for _ in range(new_tokens - 1):
                    start = time.perf_counter()
                    tokens = decoders[key].decode_step(cache, tokens).argmax(-1)
                    steps.append(time.perf_counter() - start)
                if r:
                    rates[key].append(1 / statistics.median(steps))
    table = Table(title=f"batch-1 decode of {path} (compiled step, lm_head {lm_head}-bit, {torch.get_num_threads()} "
                        f"threads): tokens/s per round")
    for col in ("model", *[f"round {i + 1}" for i in range(rounds)], "median"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for key, rs in rates.items():
        table.add_row(key, *[f"{x:.1f}" for x in rs], f"{statistics.median(rs):.1f}")
    ratios = [c / d for c, d in zip(rates["2:4 compact"], rates["dense int8"])]
    table.add_row("compact / dense", *[f"{x:.2f}x" for x in ratios], f"{statistics.median(ratios):.2f}x")
    Console(width=150).print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,2,4,8", help="values of M, comma-separated")
    ap.add_argument("--baseline", metavar="REV", help="also time int8_24_gemv as built from this git revision")
    ap.add_argument("--e2e", metavar="DIR", help="a 2:4 + int8 model saved by leanlm prune: decode speed instead")
    ap.add_argument("--lm-head", type=int, default=8, help="--e2e: lm_head bits, 8 or 4 (16: left as saved)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.e2e:
        return e2e(args.e2e, args.rounds, args.lm_head)
    ops = kernels.ops()
    base = baseline_ops(args.baseline) if args.baseline else None
    table = Table(title=f"2:4 int8 vs dense int8, {args.threads} threads, loops {ops.sparse_isa()} / {ops.isa()}: "
                        f"ns per 64 weights (GB/s of weight bytes read), median of {args.rounds} interleaved rounds")
    kinds = ["dense", *(["2:4 " + args.baseline] if base else []), "2:4"]
    for col in ("matrix", "M", *[{"dense": "dense int8", "2:4": "2:4 compact"}.get(k, k) for k in kinds],
                *[f"{k} speedup" for k in kinds[1:]]):
        table.add_column(col, justify="left" if col == "matrix" else "right")
    g = torch.Generator().manual_seed(0)
    for name, (N, K) in SHAPES.items():
        copies = max(2, int(256e6 // (N * K)))
        dense = []
        for _ in range(copies):
            q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
            dense.append(q.masked_fill(nm_mask(torch.rand(N, K, generator=g), 2, 4), 0))
        packed = [pack_24(q) for q in dense]
        scale = torch.rand(N, generator=g).bfloat16()
        reps = max(20, min(400, int(2e9 // (N * K))))
        compact_bytes = N * K // 2 + N * ((K + 7) // 8)
        for M in [int(m) for m in args.rows.split(",")]:
            x = torch.randn(M, K, generator=g).bfloat16()
            runs = {"dense": (ops.int8_gemv, [(x, q, scale) for q in dense], N * K),
                    "2:4": (ops.int8_24_gemv, [(x, v, m, scale) for v, m in packed], compact_bytes)}
            if base:
                runs[kinds[1]] = (base.int8_24_gemv, runs["2:4"][1], compact_bytes)
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.rounds):
                for key, (fn, calls, _) in runs.items():
                    times[key].append(seconds(fn, calls, reps))
            t = {k: statistics.median(v) for k, v in times.items()}
            cells = [f"{t[k] * 1e9 / (N * K / 64):.2f} ({(runs[k][2] + 2 * N) / t[k] / 1e9:.1f})" for k in kinds]
            table.add_row(f"{name} {N}x{K}", str(M), *cells, *[f"{t['dense'] / t[k]:.2f}x" for k in kinds[1:]])
        del dense, packed
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
