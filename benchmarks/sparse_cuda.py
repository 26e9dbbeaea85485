"""2:4 sparsity on an NVIDIA GPU: torch's semi-structured sparse products (cuSPARSELt / CUTLASS) against the dense
product of the same 16-bit weight, at decode and prefill row counts, on the default model's and larger shapes.

    python benchmarks/sparse_cuda.py [--dtype bfloat16] [--rows 1,16,128,2048]

Each cell is the median of 50 timed calls (CUDA events) after a warm-up; "speedup" is dense time / sparse time.
Semi-structured products pad a few rows up to the kernels' tile, so decode (1 row) is where it may not pay.
Prints a note and exits on a machine without an Ampere or later GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from leanlm.compress.sparse.masks import nm_mask

SHAPES = {"smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536), "qwen-1.5b gate_up": (17920, 1536),
          "qwen-1.5b down": (1536, 8960), "8192x8192": (8192, 8192)}  # [N, K]


def timed(fn, repeats: int = 50) -> float:
    """Median milliseconds of fn() on the GPU."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--rows", default="1,16,128,2048")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        sys.exit("no Ampere or later NVIDIA GPU here: semi-structured sparsity has nothing to run on")
    from torch.sparse import to_sparse_semi_structured

    dtype = getattr(torch, args.dtype)
    table = Table(title=f"2:4 semi-structured vs dense F.linear, {args.dtype}, {torch.cuda.get_device_name()}")
    for col in ("shape [N, K]", "rows", "dense ms", "2:4 ms", "speedup"):
        table.add_column(col, justify="left" if col == "shape [N, K]" else "right")
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=dtype)
        w = w.masked_fill(nm_mask(w.abs().float(), 2, 4), 0)
        sparse = to_sparse_semi_structured(w)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, K, device="cuda", dtype=dtype)
            dense_ms, sparse_ms = timed(lambda: F.linear(x, w)), timed(lambda: F.linear(x, sparse))
            table.add_row(f"{name} {N}x{K}", str(m), f"{dense_ms:.4f}", f"{sparse_ms:.4f}",
                          f"{dense_ms / sparse_ms:.2f}x")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
