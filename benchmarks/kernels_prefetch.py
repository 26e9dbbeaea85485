"""A/B of the kernels' weight prefetch: the kernels built twice (as is, and the `noprefetch` variant:
-DLEANLM_PREFETCH=0) and the int8 and int4 products run on the default model's 30 layers of matrices (out of cache),
interleaved rounds, 1 and 2 threads, 1 and 4 rows of x. Prints GB/s of weights read and the ratio (with / without).

    python benchmarks/kernels_prefetch.py
"""

import statistics
import time

import torch

from leanlm import kernels
from leanlm.lowbit.linear import pack_int4

ns = {"on": kernels.build(), "off": kernels.build("noprefetch")}
torch.manual_seed(0)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # the default model's 30 layers: ~100 MB int8
w8 = [torch.randint(-127, 128, s, dtype=torch.int8) for s in shapes]
sc = [torch.rand(s[0]).bfloat16() for s in shapes]
q4 = [pack_int4(torch.randint(0, 16, s, dtype=torch.uint8)) for s in shapes]
g = 64
s4 = [torch.rand(s[1] // g, s[0]).bfloat16() for s in shapes]
z4 = [torch.rand(s[1] // g, s[0]).bfloat16() for s in shapes]
for threads in (1, 2):
    torch.set_num_threads(threads)
    for M in (1, 4):
        xs = [torch.randn(M, s[1]).bfloat16() for s in shapes]
        res = {("int8", t): [] for t in ns} | {("int4", t): [] for t in ns}
        for rnd in range(7):
            for t, o in ns.items():
                t0 = time.perf_counter()
                for x, w, s in zip(xs, w8, sc): o.int8_gemv(x, w, s)
                res[("int8", t)].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for x, w, s, z in zip(xs, q4, s4, z4): o.int4_gemv(x, w, s, z, g)
                res[("int4", t)].append(time.perf_counter() - t0)
        b8 = sum(w.numel() for w in w8); b4 = sum(w.numel() for w in q4)
        for kind, b in (("int8", b8), ("int4", b4)):
            on, off = statistics.median(res[(kind, "on")][2:]), statistics.median(res[(kind, "off")][2:])
            print(f"threads {threads} M {M} {kind}: prefetch {b/on/1e9:5.1f} GB/s, none {b/off/1e9:5.1f} GB/s, ratio {off/on:.2f}x", flush=True)
