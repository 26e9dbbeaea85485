"""Two revisions of leanlm's CPU kernels against each other in one process: each revision's sources (git) built
into an op namespace of its own, then the products on the default model's shapes run in interleaved rounds, from
memory, at each row count: bf16 on packed weights (bf16_packed_gemm: its 120 projections, ~212 MB), W8A16 and W8A8
on packed int8 codes (w8a16_packed_gemm, int8_packed_gemm: the same 120), W4A16 (int4_gemv, group 64: its 30
layers' gate_up_proj and down_proj) and AQLM (codebook_gemv, 2 codebooks: the 120); the outputs must be the same
bits. On a shared VM whose speed moves by 1.5x between runs, the ratio within one run is the number to trust.

    python benchmarks/kernels_ab.py eb751a4 HEAD [--rows 1,2,4,8,16,32,64,256] [--rounds 15] [--threads 2]
        [--products bf16,w8a16,w8a8,int4]
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

from leanlm.kernels import SOURCES, HEADER, _cpu_tag, cache_dir, pack_int8, pack_pairs
from leanlm.lowbit.linear import pack_int4

REPO = Path(__file__).resolve().parent.parent
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # SmolLM2-135M's 30 layers, [N, K]


def build(rev: str):
    """The kernels as revision `rev` wrote them, built once per commit and CPU into torch.ops.leanlm_ab_<commit>."""
    from torch.utils.cpp_extension import load

    sha = subprocess.check_output(["git", "rev-parse", "--short=8", rev], text=True, cwd=REPO).strip()
    name = f"leanlm_ab_{sha}"
    with tempfile.TemporaryDirectory() as src:
        sources = []
        for f in (*SOURCES, HEADER):
            try:
                text = subprocess.check_output(["git", "show", f"{sha}:leanlm/kernels/{f.name}"], text=True,
                                               stderr=subprocess.DEVNULL, cwd=REPO)
            except subprocess.CalledProcessError:
                continue  # a source that revision did not have yet
            (Path(src) / f.name).write_text(text)
            sources += [str(Path(src) / f.name)] if f.suffix == ".cpp" else []
        directory = cache_dir() / "kernels_ab" / f"{sha}_{_cpu_tag()}"  # -march=native: one build per CPU, as kernels
        directory.mkdir(parents=True, exist_ok=True)
        load(name=name, sources=sources, extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DLEANLM_NS={name}"],
             extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False)
    return sha, getattr(torch.ops, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="the baseline revision (a commit, tag or branch)")
    ap.add_argument("b", help="the revision measured against it")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256", help="row counts of x, comma-separated")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds at each row count (median taken)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--products", default="bf16,int4", help="of bf16, w8a16, w8a8, int4 (int4_gemv), int4w "
                    "(int4_packed_gemm), aqlm (codebook_gemv, 2 codebooks), comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    (sa, a), (sb, b) = build(args.a), build(args.b)
    torch.manual_seed(0)
    bf16 = [(torch.randn(N // 16, K // 2, 16, 2).bfloat16(), K) for N, K in SHAPES]
    int4 = [(pack_int4(torch.randint(0, 16, (N, K), dtype=torch.uint8)), (torch.rand(K // 64, N) / 100).bfloat16(),
             (torch.randn(K // 64, N) / 100).bfloat16(), K) for N, K in SHAPES if N == 3072 or K == 1536]
    codes = [torch.randint(-127, 128, (N, K), dtype=torch.int8) for N, K in SHAPES[:4]] * 30
    scales = [(torch.rand(c.shape[0]) / 100).bfloat16() for c in codes[:4]] * 30
    w8 = [(pack_pairs(c), s, c.shape[1]) for c, s in zip(codes, scales)]
    q8 = [(pack_int8(c), s.float(), c.shape[1]) for c, s in zip(codes, scales)]
    aqlm = [(torch.randint(0, 256, (K // 8, 2, N), dtype=torch.uint8), torch.randn(2, 8, 256).bfloat16(),
             (torch.rand(N) / 100).bfloat16(), K) for N, K in SHAPES]
    products = {"bf16": ("bf16_packed_gemm", bf16, lambda o, x, w: o.bf16_packed_gemm(x[w[1]], w[0])),
                "w8a16": ("w8a16_packed_gemm", w8,
                          lambda o, x, w: o.w8a16_packed_gemm(x[w[2]], w[0], w[1], torch.bfloat16)),
                "w8a8": ("int8_packed_gemm", q8,
                         lambda o, x, w: o.int8_packed_gemm(*x[-w[2]], w[0], w[1], torch.bfloat16)),
                "int4": ("int4_gemv", int4, lambda o, x, w: o.int4_gemv(x[w[3]], w[0], w[1], w[2], 64)),
                "int4w": ("int4_packed_gemm", int4,
                          lambda o, x, w: o.int4_packed_gemm(x[w[3]], w[0], w[1], w[2], 64)),
                "aqlm": ("codebook_gemv", aqlm, lambda o, x, w: o.codebook_gemv(x[w[3]], *w[:3]))}
    products = {products[p][0]: products[p][1:] for p in args.products.split(",")}
    table = Table(title=f"{args.b} ({sb}) against {args.a} ({sa}), {args.threads} threads, interleaved: ms for the "
                        "model's products (GFLOP/s)")
    for col in ("rows", *(f"{p}, {r}" for p in products for r in (sa, sb, "ratio"))):
        table.add_column(col, justify="right")
    for M in [int(m) for m in args.rows.split(",")]:
        x = {K: torch.randn(M, K).bfloat16() for K in (576, 1536)}
        x |= {-K: (torch.randint(-127, 128, (M, K), dtype=torch.int8), torch.rand(M) / 100) for K in (576, 1536)}
        cells = [str(M)]
        for weights, run in products.values():
            for w in weights[:4]:
                assert torch.equal(run(a, x, w), run(b, x, w)), f"{sa} and {sb} differ at {M} rows"
            times = {sa: [], sb: []}
            for _ in range(args.rounds):
                for sha, o in ((sa, a), (sb, b)):
                    start = time.perf_counter()
                    for w in weights:
                        run(o, x, w)
                    times[sha].append(time.perf_counter() - start)
            flops = 2 * M * sum(w[0].numel() * {2: 2, 3: 4}.get(w[0].dim(), 1) if w[0].dtype == torch.uint8
                                else w[0].numel() for w in weights)  # int4 2 weights a byte, 2 codebooks 4
            ta, tb = statistics.median(times[sa]), statistics.median(times[sb])
            cells += [f"{1e3 * ta:.1f} ({flops / ta / 1e9:.0f})", f"{1e3 * tb:.1f} ({flops / tb / 1e9:.0f})",
                      f"{ta / tb:.2f}x"]
        table.add_row(*cells)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
