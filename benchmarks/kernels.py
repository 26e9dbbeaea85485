"""Decode matrix-vector products on the default model's shapes: leanlm's int8 kernel against torch's int8 and
int4 kernels and the compiled bf16 reduction the 16-bit decode step uses, as one table.

    python benchmarks/kernels.py [--threads 2] [--group-size 64]

Weights rotate through ~256 MB of copies so that every call reads them from memory, as decode does.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from leanlm import kernels
from leanlm.lowbit.linear import pack_int4

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}  # SmolLM2-135M, [N, K]


def seconds(fn, calls: list[tuple], reps: int = 60) -> float:
    for args in calls[:3]:
        fn(*args)
    start = time.perf_counter()
    for i in range(reps):
        fn(*calls[i % len(calls)])
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=64, help="int4 group (K = 576 takes 32 or 64)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops, G = kernels.ops(), args.group_size
    reduction = torch.compile(lambda x, w: (x.float() * w.float()).sum(-1).to(x.dtype), dynamic=False)
    table = Table(title=f"batch-1 products, {args.threads} threads, leanlm's kernels built for {ops.isa()}: "
                        "microseconds (GB/s of weights read)")
    for col in ("matrix", "bf16 reduction", "torch int8pack", "leanlm int8", "torch int4pack", "leanlm int4"):
        table.add_column(col, justify="left" if col == "matrix" else "right")
    for name, (N, K) in SHAPES.items():
        copies = max(2, int(256e6 // (N * K * 2)))
        x = torch.randn(1, K, dtype=torch.bfloat16)
        q8 = [torch.randint(-127, 128, (N, K), dtype=torch.int8) for _ in range(copies)]
        q4 = [torch.randint(0, 16, (N, K), dtype=torch.int32) for _ in range(copies)]
        s8, s4 = torch.rand(N, dtype=torch.bfloat16), torch.rand(N, K // G, dtype=torch.bfloat16)
        sz = torch.stack([s4, s4], -1).transpose(0, 1).contiguous()  # torch's [K/g, N, 2] scales and zeros
        runs = {  # name -> (fn, calls, bytes per weight)
            "bf16": (reduction, [(x, w.bfloat16()) for w in q8], 2),
            "int8pack": (torch.ops.aten._weight_int8pack_mm, [(x, w, s8) for w in q8], 1),
            "int8": (ops.int8_gemv, [(x, w, s8) for w in q8], 1),
            "int4pack": (torch.ops.aten._weight_int4pack_mm_for_cpu,
                         [(x, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), G, sz) for q in q4], 0.5),
            "int4": (ops.int4_gemv, [(x, pack_int4(q.to(torch.uint8)), s4.t().contiguous(), s4.t().contiguous(), G)
                                     for q in q4], 0.5),
        }
        cells = []
        for fn, calls, nbytes in runs.values():
            t = seconds(fn, calls)
            cells.append(f"{t * 1e6:.0f} ({N * K * nbytes / t / 1e9:.1f})")
        table.add_row(f"{name} {N}x{K}", *cells)
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
