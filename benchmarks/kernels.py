"""Decode kernels on the zoo's shapes, three tables: matrix-vector products (leanlm's int8 kernel against torch's int8
and int4 kernels and the compiled bf16 reduction the 16-bit decode step uses), paged decode attention (leanlm's
kernel over a bf16, an int8 and an int4 pool against gathering the keys and values for torch's SDPA, each as GB/s
of KV read next to a streaming read of memory), prefill attention (leanlm's kernel against a gather and torch's
SDPA), and the cost of QuaRot's online Hadamard on down_proj's input
(`rotate` with online: true) next to down_proj itself; W8A16 at 8-256 rows (a decode step of many sequences, prefill):
the int8 kernel, AMX tiles, widened codes, packed codes and bf16 weights; W4A16 at 1-256 rows: the int4 kernel, its
tiles widened into the bf16 packed layout and W4A8's int8-activation product on the codes packed for it; W8A8 at
1-1024 rows: the kernels on int8 codes (plain and packed) against torch._int_mm and bf16 weights; and bf16 at 1-256
rows: torch's GEMM, leanlm's bf16_gemm and its product on the packed layout (bf16_packed_gemm), as GFLOP/s and the
bf16 peak's share; and the fused elementwise ops (silu_mul, rms_norm, rope) against the torch ops they replace.

    python benchmarks/kernels.py [--threads 2] [--group-size 64] [--sections pachwiqbe]

Weights and KV pools rotate through ~256 MB or more of copies (30 layers' pools) so that every call reads them from
memory, as decode does.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from leanlm import kernels, runtime
from leanlm.bench.probe import peaks
from leanlm.cache.int4 import Int4KVPool
from leanlm.cache.paged import put
from leanlm.lowbit.hadamard import OnlineRotation
from leanlm.lowbit.linear import pack_int4
from leanlm.models.config import ModelConfig
from leanlm.models.layers import apply_rope

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}  # SmolLM2-135M, [N, K]


def seconds(fn, calls: list[tuple], reps: int = 60) -> float:
    for args in calls[:3]:
        fn(*args)
    start = time.perf_counter()
    for i in range(reps):
        fn(*calls[i % len(calls)])
    return (time.perf_counter() - start) / reps


def products(ops, args) -> None:
    G = args.group_size
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


def many_rows(ops, args) -> None:
    """W8A16 at the row counts of a decode step of many sequences and of prefill: leanlm's int8 dot-product kernel,
    its AMX tiles, a bf16 GEMM on the codes widened per call (W8A16Linear's path without AMX) and the product on
    packed codes (PackedW8A16Linear's, every row count), next to bf16 weights (torch's GEMM and the packed
    product); a layer's gate_up_proj and down_proj, the layers' weights rotating through ~256 MB of copies."""
    if not kernels.amx():
        print("no AMX tiles here: int8_amx is not built")
    table = Table(title=f"W8A16 products at many rows, {args.threads} threads: microseconds a layer (gate_up_proj "
                        "and down_proj, x bf16)")
    for col in ("rows", "leanlm int8 (int8_gemv)", "leanlm AMX (int8_amx)", "widened codes + bf16 GEMM",
                "leanlm packed codes (w8a16_packed_gemm)", "packed codes, AMX (w8a16_packed_amx)",
                "bf16 weights (torch)", "bf16 packed (bf16_packed_gemm)"):
        table.add_column(col, justify="right")
    shapes = [SHAPES["gate_up_proj"], SHAPES["down_proj"]]
    layers = int(256e6 // sum(n * k for n, k in shapes))
    codes = [[torch.randint(-127, 128, shape, dtype=torch.int8) for shape in shapes] for _ in range(layers)]
    wide = [[w.bfloat16() for w in layer] for layer in codes]
    packed = [[kernels.pack_pairs(w) for w in layer] for layer in codes]
    wide_packed = [[kernels.pack_bf16(w) for w in layer] for layer in wide]
    scales = [torch.rand(n, dtype=torch.bfloat16) for n, _ in shapes]

    def per_layer(product):  # xs, one layer's weights -> its two products
        return lambda xs, ws: [product(x, w, s) for x, w, s in zip(xs, ws, scales)]

    products = [per_layer(ops.int8_gemv), per_layer(ops.int8_amx) if kernels.amx() else None,
                per_layer(lambda x, w, s: ops.rescale(torch.nn.functional.linear(x, w.bfloat16()), None, s))]
    for rows in (1, 2, 4, 8, 16, 32, 64, 256):
        xs = [torch.randn(rows, k, dtype=torch.bfloat16) for _, k in shapes]
        times = [seconds(fn, [(xs, layer) for layer in codes], reps=layers) if fn else None for fn in products]
        times.append(seconds(per_layer(lambda x, w, s: ops.w8a16_packed_gemm(x, w, s, torch.bfloat16)),
                             [(xs, layer) for layer in packed], reps=layers))
        times.append(seconds(per_layer(lambda x, w, s: ops.w8a16_packed_amx(x, w, s, torch.bfloat16)),
                             [(xs, layer) for layer in packed], reps=layers) if kernels.amx() else None)
        times.append(seconds(per_layer(lambda x, w, s: torch.nn.functional.linear(x, w)),
                             [(xs, layer) for layer in wide], reps=layers))
        times.append(seconds(per_layer(lambda x, w, s: ops.bf16_packed_gemm(x, w)),
                             [(xs, layer) for layer in wide_packed], reps=layers))
        table.add_row(str(rows), *(f"{t * 1e6:.0f}" if t else "-" for t in times))
    Console(width=150).print(table)


def w8a8_rows(ops, args) -> None:
    """W8A8 from one row (decode) to a prefill step's 1024: leanlm's kernels on the int8 codes (int8_gemv_q8) and on
    the same codes packed (int8_packed_gemm, kernels.pack_int8), and torch._int_mm with its int32 sums rescaled in
    one pass (`rescale`, W8A8's path past kernels.int8_rows()) or by tensor ops (as
    lowbit.primitives.int_matmul_reference does), next to bf16 weights; gate_up_proj and down_proj, weights rotating
    through ~256 MB of copies, activations already quantized (quantize_rows is the same for all)."""
    from leanlm.lowbit.primitives import int8_matmul

    table = Table(title=f"W8A8 products, {args.threads} threads: microseconds a layer (gate_up_proj and down_proj) "
                        "and G multiply-adds a second")
    for col in ("rows", "leanlm (int8_gemv_q8)", "leanlm packed (int8_packed_gemm)", "packed, AMX (int8_packed_amx)",
                "_int_mm + rescale", "_int_mm + tensor ops", "bf16 weights (torch)"):
        table.add_column(col, justify="right")
    shapes = [SHAPES["gate_up_proj"], SHAPES["down_proj"]]
    layers = int(256e6 // sum(n * k for n, k in shapes))
    codes = [[torch.randint(-127, 128, shape, dtype=torch.int8) for shape in shapes] for _ in range(layers)]
    packed = [[kernels.pack_int8(w) for w in layer] for layer in codes]
    wide = [[(torch.randn(*shape) * 0.02).bfloat16() for shape in shapes] for _ in range(layers // 2)]
    scales = [torch.rand(n) for n, _ in shapes]

    def per_layer(product):  # xs, one layer's weights -> its two products
        return lambda xs, ws: [product(x, w, s) for x, w, s in zip(xs, ws, scales)]

    products = [per_layer(lambda x, w, s: ops.int8_gemv_q8(x[0], x[1], w, s)),
                per_layer(lambda x, w, s: ops.int8_packed_gemm(x[0], x[1], w, s, torch.float32)),
                per_layer(lambda x, w, s: ops.int8_packed_amx(x[0], x[1], w, s, torch.float32)) if kernels.amx()
                else None,
                per_layer(lambda x, w, s: ops.rescale(int8_matmul(x[0], w), x[1], s)),
                per_layer(lambda x, w, s: int8_matmul(x[0], w).float() * x[1][:, None] * s),
                per_layer(lambda x, w, s: torch.nn.functional.linear(x[2], w))]
    for rows in (1, 8, 16, 32, 64, 256, 1024):
        xs = []
        for _, k in shapes:
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            xs.append((*ops.quantize_rows(x), x))
        macs = rows * sum(n * k for n, k in shapes)
        times = [seconds(fn, [(xs, layer) for layer in {1: packed, 2: packed, 5: wide}.get(i, codes)],
                         reps=min(layers, 48)) if fn else None for i, fn in enumerate(products)]
        table.add_row(str(rows), *(f"{t * 1e6:.0f} ({macs / t / 1e9:.0f})" if t else "-" for t in times))
    Console(width=150).print(table)


# (name, query heads, kv heads, head size, sequences, tokens each): the default model at 32 concurrent requests,
# and one long request of the 1.5B model (its tokens split across threads)
ATTENTION = [("smollm2-135m, 32 x 384", 9, 3, 64, 32, 384), ("qwen2.5-coder-1.5b, 1 x 4096", 12, 2, 128, 1, 4096)]


def lru_tables(sequences: int, blocks: int, prompt: int) -> torch.Tensor:
    """The block tables the engine left while every block came least recently freed first (before the block
    manager placed each sequence's blocks in a row): each prompt's blocks in order, every later block interleaved
    across the sequences (9 runs of adjacent blocks a sequence in a real `LLM.generate` of 32 x 256 in, 128 out)"""
    tables = torch.empty(sequences, blocks, dtype=torch.int32)
    tables[:, :prompt] = torch.arange(sequences * prompt).view(sequences, prompt)
    tables[:, prompt:] = sequences * prompt + torch.arange(sequences * (blocks - prompt)).view(-1, sequences).T
    return tables


def engine_tables(sequences: int, length: int, prompt: int, block_size: int) -> torch.Tensor:
    """The block tables the engine's scheduler gives `sequences` requests of `prompt` tokens (distinct, no prefix
    hits) and `length - prompt` out, admitted together, once each holds `length` tokens, in a pool of just
    their blocks (and the scratch block)  # int32"""
    from leanlm.engine.config import EngineConfig
    from leanlm.engine.scheduler import Scheduler
    from leanlm.engine.sequence import Sequence
    from leanlm.generation.sampling import SamplingParams

    scheduler = Scheduler(EngineConfig(max_num_seqs=sequences), sequences * length // block_size + 1)
    seqs = [Sequence(str(i), 0, [i] * prompt, SamplingParams(max_tokens=length - prompt), length - prompt, set(),
                     None) for i in range(sequences)]
    for seq in seqs:
        scheduler.add(seq)
    while any(len(seq.token_ids) < length for seq in seqs):
        for seq, n in scheduler.schedule():
            seq.num_computed += n
            if seq.remaining == 0 and len(seq.token_ids) < length:
                seq.token_ids.append(0)  # the sampled token, fed in the next step
    for seq in seqs:
        scheduler.blocks.grow(seq, length)  # the last sampled token's block, taken when it is fed
    return torch.tensor([seq.block_table for seq in seqs], dtype=torch.int32)


def attention(ops, args) -> None:
    from leanlm.cache.int8 import quantize_per_token

    x = torch.ones(64 * 2**20)  # 256 MB
    stream = x.numel() * 4 / seconds(torch.sum, [(x,)], reps=10) / 1e9
    table = Table(title=f"paged decode attention, {args.threads} threads, 30 layers' pools, bf16 queries: "
                        f"microseconds a layer (GB/s of keys and values read; a streaming read: {stream:.1f} GB/s)")
    for col in ("shape", "leanlm, bf16 pool", "leanlm, bf16 pool, keys by block",
                "the same, least recently freed first (before)", "the same, the engine's block order",
                "leanlm, int8 pool", "leanlm, int8 pool, keys by block", "leanlm, int4 pool", "gather + SDPA, bf16"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for name, H, Hkv, D, B, L in ATTENTION:
        bs, layers = 16, 30
        g = torch.Generator().manual_seed(0)
        blocks = B * L // bs
        tables = torch.randperm(blocks, generator=g).view(B, L // bs).int()  # blocks anywhere in the pool
        lru_order, engine_order = lru_tables(B, L // bs, 256 // bs), engine_tables(B, L, 256, bs)
        lens = torch.full((B,), L, dtype=torch.int32)
        q = torch.randn(B, H, D, generator=g).bfloat16()
        pools = [[torch.randn(blocks * bs, Hkv, D, generator=g).bfloat16() for _ in range(2)] for _ in range(layers)]
        int8 = [[*quantize_per_token(k), *quantize_per_token(v)] for k, v in pools]
        by_block, int8_by_block = ([torch.empty(blocks, Hkv, D // 2, bs, 2, dtype=dtype) for _ in pools]
                                   for dtype in (torch.bfloat16, torch.int8))  # cache.paged
        for keys, k in zip(by_block + int8_by_block, [k for k, _ in pools] + [kq for kq, *_ in int8]):
            put(keys, torch.arange(blocks * bs), k)
        int4 = Int4KVPool(ModelConfig("llama", 8, H * D, 8, layers, H, Hkv, D, L), blocks, bs, torch.bfloat16,
                          open_blocks=B)
        every = torch.arange(blocks * bs)
        int4.prepare(every)
        for layer, (k, v) in enumerate(pools):
            int4.write(layer, every, k, v)
        slots = (tables.long()[:, :, None] * bs + torch.arange(bs)).view(B, L)

        def gathered(q, k, v):
            keys, values = (t[slots].transpose(1, 2) for t in (k, v))  # [B, Hkv, L, D]
            return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True)

        runs = [(ops.paged_attention, [(q, k, v, tables, lens, bs) for k, v in pools], 2),
                (ops.paged_attention, [(q, keys, v, tables, lens, bs) for keys, (_, v) in zip(by_block, pools)], 2),
                (ops.paged_attention, [(q, keys, v, lru_order, lens, bs) for keys, (_, v) in zip(by_block, pools)], 2),
                (ops.paged_attention, [(q, keys, v, engine_order, lens, bs) for keys, (_, v) in zip(by_block, pools)],
                 2),
                (ops.paged_attention, [(q, kq, vq, tables, lens, bs, ks, vs) for kq, ks, vq, vs in int8], 1 + 4 / D),
                (ops.paged_attention, [(q, keys, vq, tables, lens, bs, ks, vs) for keys, (_, ks, vq, vs) in
                                       zip(int8_by_block, int8)], 1 + 4 / D),
                (ops.paged_attention_int4, [(q, *int4._tensors(i), tables, lens, bs) for i in range(layers)],
                 Int4KVPool.bytes_per_block(int4_cfg(Hkv, D), bs) / (2 * bs * Hkv * D)),
                (gathered, [(q, k, v) for k, v in pools], 2)]
        cells = []
        for fn, calls, nbytes in runs:
            t = seconds(fn, calls, reps=2 * layers)
            cells.append(f"{t * 1e6:.0f} ({2 * B * L * Hkv * D * nbytes / t / 1e9:.1f})")
        table.add_row(name, *cells)
    Console(width=150).print(table)


# (name, query heads, kv heads, head size, new tokens, context): a whole 256-token prompt, later chunks of longer ones
PREFILL = [("smollm2-135m", 9, 3, 64, 256, 256), ("smollm2-135m", 9, 3, 64, 256, 1024),
           ("smollm2-135m", 9, 3, 64, 1024, 1024), ("qwen2.5-coder-0.5b", 14, 2, 64, 256, 256),
           ("qwen2.5-coder-0.5b", 14, 2, 64, 256, 2048)]


def prefill_attention(ops, args) -> None:
    """A prompt chunk's causal attention over its context in the pool: leanlm's prefill kernel, which reads the
    pool in place, against the engine's other path (gather the context, torch's SDPA with its flash kernel)."""
    table = Table(title=f"prefill attention, {args.threads} threads, bf16, 8 layers' pools in turn: microseconds a "
                        "layer (GFLOP/s of the causal products: 4 T H D per key a query sees)")
    for col in ("model", "new tokens", "context", "gather + SDPA", "leanlm prefill_attention", "ratio",
                "int8 pool: gather, dequantize + SDPA", "leanlm, int8 pool", "ratio"):
        table.add_column(col, justify="left" if col == "model" else "right")
    F = torch.nn.functional
    from leanlm.cache.int8 import dequantize_per_token, quantize_per_token
    for name, H, Hkv, D, T, C in PREFILL:
        bs, g = 16, torch.Generator().manual_seed(0)
        blocks = 2 * C // bs
        slots = (torch.randperm(blocks, generator=g)[: C // bs, None] * bs + torch.arange(bs)).flatten()
        q = torch.randn(T, H, D, generator=g).bfloat16()
        pools = [[torch.randn(blocks * bs, Hkv, D, generator=g).bfloat16() for _ in range(2)] for _ in range(8)]
        mask = None if T == C else torch.arange(C)[None] <= torch.arange(C - T, C)[:, None]

        int8 = [(*quantize_per_token(k), *quantize_per_token(v)) for k, v in pools]  # codes, scales

        def gathered(q, k, v, k_scale=None, v_scale=None):  # as cache.paged_attention.PagedStep without the kernel
            keys, values = k[slots], v[slots]
            if k_scale is not None:  # KVPool.read of an int8 pool
                keys, values = (dequantize_per_token(x, s[slots], torch.bfloat16) for x, s in
                                ((keys, k_scale), (values, v_scale)))
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                                  values.transpose(0, 1)[None], attn_mask=mask,
                                                  is_causal=mask is None, enable_gqa=True)

        flops = 4 * T * H * D * (C - T + (T + 1) / 2)
        bf16 = [(q, k, v) for k, v in pools]
        codes = [(q, kq, vq, ks, vs) for kq, ks, vq, vs in int8]
        times = [seconds(gathered, bf16, reps=24), seconds(lambda *a: ops.prefill_attention(*a[:3], slots), bf16, 24),
                 seconds(gathered, codes, reps=24),
                 seconds(lambda q, k, v, ks, vs: ops.prefill_attention(q, k, v, slots, ks, vs), codes, reps=24)]
        cells = [f"{t * 1e6:.0f} ({flops / t / 1e9:.0f})" for t in times]
        table.add_row(name, str(T), str(C), *cells[:2], f"{times[0] / times[1]:.2f}x", *cells[2:],
                      f"{times[2] / times[3]:.2f}x")
    Console(width=150).print(table)


def int4_cfg(Hkv: int, D: int) -> ModelConfig:
    """One layer of Hkv heads of D: what Int4KVPool.bytes_per_block reads."""
    return ModelConfig("llama", 8, Hkv * D, 8, 1, Hkv, Hkv, D, 8)


def online_hadamard(args) -> None:
    """QuaRot's online rotation of down_proj's input (OnlineRotation: Kronecker factors, by leanlm's kernel and as two
    GEMMs) against down_proj's bf16 product on the same rows, and against the dense rotation it replaces."""
    table = Table(title=f"online Hadamard on down_proj's input, {args.threads} threads, bf16 rows: microseconds "
                        "(share of down_proj's time)")
    for col in ("model", "rows", "down_proj (bf16)", "online rotation (kernel)", "two float32 GEMMs", "dense x @ Q"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, d, n in (("smollm2-135m", 576, 1536), ("qwen2.5-coder-0.5b", 896, 4864)):
        rotation, Q = OnlineRotation(n, seed=2), torch.randn(n, n)
        weights = [torch.randn(d, n).bfloat16() for _ in range(8)]
        for rows in (1, 32, 512):
            xs = [torch.randn(rows, n).bfloat16() for _ in range(8)]
            down = seconds(torch.nn.functional.linear, list(zip(xs, weights)))
            times = [seconds(fn, [(x,) for x in xs])
                     for fn in (rotation, rotation.gemms, lambda x: (x.float() @ Q).bfloat16())]
            table.add_row(name, str(rows), f"{down * 1e6:.0f}", *(f"{t * 1e6:.0f} ({t / down:.0%})" for t in times))
    Console(width=150).print(table)


def elementwise(ops, args) -> None:
    """The fused elementwise ops of the eager path (every prefill and mixed step): silu_mul on gate_up_proj's output,
    rms_norm on the hidden state and rope on the fused q/k/v rows, against the torch ops they replace (layers.py's
    fallbacks), bf16, on the default model's shapes."""
    table = Table(title=f"elementwise ops, {args.threads} threads, leanlm's kernels built for {ops.isa()}, bf16, "
                        "smollm2-135m's shapes: microseconds (torch's ops / leanlm's)")
    for col in ("rows", "silu_mul (torch)", "silu_mul (leanlm)", "rms_norm (torch)", "rms_norm (leanlm)",
                "rope (torch)", "rope (leanlm)"):
        table.add_column(col, justify="right")
    I, hidden, H, Hkv, D = 1536, 576, 9, 3, 64

    def silu_mul(x):
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def rms_norm(x, w, eps):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rope(qkv, cos, sin, rotated):  # as Attention.forward calls it, one sequence of `rows` tokens
        rows = qkv.shape[0]
        return apply_rope(qkv.view(1, rows, -1, D)[:, :, :rotated], cos.view(1, rows, 1, D), sin.view(1, rows, 1, D))

    for rows in (1, 32, 256):
        g = torch.Generator().manual_seed(0)
        gate_up = [(torch.randn(rows, 2 * I, generator=g).bfloat16(),) for _ in range(8)]
        w = torch.randn(hidden, generator=g).bfloat16()
        hs = [(torch.randn(rows, hidden, generator=g).bfloat16(), w, 1e-5) for _ in range(8)]
        cos, sin = torch.randn(rows, D, generator=g).bfloat16(), torch.randn(rows, D, generator=g).bfloat16()
        qkv = [(torch.randn(rows, (H + 2 * Hkv) * D, generator=g).bfloat16(), cos, sin, H + Hkv) for _ in range(8)]
        cells = []
        for ours, theirs, calls in ((ops.silu_mul, silu_mul, gate_up), (ops.rms_norm, rms_norm, hs),
                                    (ops.rope, rope, qkv)):
            t_torch, t_ours = seconds(theirs, calls, reps=400), seconds(ours, calls, reps=400)
            cells += [f"{t_torch * 1e6:.1f}", f"{t_ours * 1e6:.1f} ({t_torch / t_ours:.1f}x)"]
        table.add_row(str(rows), *cells)
    Console(width=150).print(table)


def int4_rows(ops, args) -> None:
    """W4A16 (groups of --group-size) at the row counts of a decode step of many sequences and of prefill: leanlm's
    int4 kernel (int4_gemv) and its tiles widened into the bf16 packed layout per call (int4_packed_gemm), the same
    int4 weights with int8 activations (W4A8: quantize_rows + int4_q8_gemm), next to the same weights in bf16,
    packed (bf16_packed_gemm); a layer's gate_up_proj and down_proj from memory."""
    table = Table(title=f"W4A16 and W4A8 products at many rows, {args.threads} threads: microseconds a layer "
                        "(gate_up_proj and down_proj, x bf16)")
    amx = kernels.amx()
    for col in ("rows", "leanlm int4_gemv", "leanlm int4_packed_gemm",
                *(["AMX (int4_amx)", "AMX, weight to bf16 (int4_dequant_amx)"] if amx else []),
                "W4A8 (int4_q8_gemm, x quantized)", "bf16 weights, packed (bf16_packed_gemm)", "bf16 weights (torch)"):
        table.add_column(col, justify="right")
    shapes, g = [SHAPES["gate_up_proj"], SHAPES["down_proj"]], args.group_size
    layers = int(256e6 // sum(n * k for n, k in shapes))
    codes = [[pack_int4(torch.randint(0, 16, shape, dtype=torch.uint8)) for shape in shapes] for _ in range(layers)]
    q8_codes = [[kernels.pack_int4_q8(torch.randint(0, 16, shape, dtype=torch.uint8)) for shape in shapes]
                for _ in range(layers)]
    groups = [(torch.rand(k // g, n).bfloat16() * 0.01, torch.randn(k // g, n).bfloat16() * 0.01) for n, k in shapes]
    plain = [[torch.randn(shape).bfloat16() for shape in shapes] for _ in range(layers // 4)]  # ~256 MB too
    packed = [[kernels.pack_bf16(w) for w in layer] for layer in plain]

    def per_layer(product):  # xs, one layer's weights -> its two products
        return lambda xs, ws: [product(x, w, *sz) for x, w, sz in zip(xs, ws, groups)]

    products = [(codes, per_layer(lambda x, w, s, z: ops.int4_gemv(x, w, s, z, g))),
                (codes, per_layer(lambda x, w, s, z: ops.int4_packed_gemm(x, w, s, z, g))),
                *([(codes, per_layer(lambda x, w, s, z: ops.int4_amx(x, w, s, z, g))),
                   (codes, per_layer(lambda x, w, s, z: ops.int4_dequant_amx(x, w, s, z, g)))] if amx else []),
                (q8_codes, per_layer(lambda x, w, s, z: ops.int4_q8_gemm(*ops.quantize_rows(x), w, s, z, g,
                                                                         torch.bfloat16))),
                (packed, per_layer(lambda x, w, s, z: ops.bf16_packed_gemm(x, w))),
                (plain, per_layer(lambda x, w, s, z: torch.nn.functional.linear(x, w)))]
    for rows in (1, 8, 16, 32, 64, 128, 256):
        xs = [torch.randn(rows, k).bfloat16() for _, k in shapes]
        times = [seconds(fn, [(xs, layer) for layer in weights], reps=min(layers, 48)) for weights, fn in products]
        table.add_row(str(rows), *(f"{t * 1e6:.0f}" for t in times))
    Console(width=150).print(table)


def bf16_rows(ops, args) -> None:
    """bf16 products of a whole decoder layer (qkv, o, gate_up and down_proj) at 1-256 rows, the layers' weights
    rotating through ~256 MB of copies: torch's GEMM, bf16_gemm (plain [N, K] weights) and bf16_packed_gemm (the
    same weights packed by kernels.pack_bf16), and with AMX bf16_packed_amx on the packed weights."""
    dtype = "bfloat16" if runtime.CPU_BF16_GEMM else "float32"  # the GEMM a bf16 Linear runs here
    peak = peaks("cpu", args.threads).matmul_gflops[dtype]
    table = Table(title=f"bf16 products of a decoder layer from memory, {args.threads} threads, {ops.bf16_isa()} "
                        f"loops: microseconds (GFLOP/s, share of the {peak:.0f} GFLOP/s the probe's large {dtype} "
                        "GEMM reaches)")
    amx = kernels.amx()
    for col in ("rows", "torch (F.linear)" if runtime.CPU_BF16_GEMM else "torch, float32 (no bf16 GEMM here)",
                "leanlm bf16_gemm", "leanlm bf16_packed_gemm", *(["AMX on the packed weight (bf16_packed_amx)"]
                                                                 if amx else [])):
        table.add_column(col, justify="right")
    shapes = [SHAPES[name] for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    layers = int(256e6 // (2 * sum(n * k for n, k in shapes)))
    plain = [[torch.randn(shape, dtype=torch.bfloat16) for shape in shapes] for _ in range(layers)]
    packed = [[kernels.pack_bf16(w) for w in layer] for layer in plain]
    def upcast(x, w):  # what a bf16 Linear runs where torch's bf16 GEMM is slow (models.layers.Linear)
        return torch.nn.functional.linear(x.float(), w.float()).bfloat16()

    products = [torch.nn.functional.linear if runtime.CPU_BF16_GEMM else upcast, ops.bf16_gemm, ops.bf16_packed_gemm,
                *([ops.bf16_packed_amx] if amx else [])]
    for rows in (1, 2, 4, 8, 16, 32, 64, 256):
        xs = [torch.randn(rows, k, dtype=torch.bfloat16) for _, k in shapes]
        flops = 2 * rows * sum(n * k for n, k in shapes)
        cells = []
        for product, weights in zip(products, (plain, plain, packed, packed)):
            t = seconds(lambda xs, ws: [product(x, w) for x, w in zip(xs, ws)], [(xs, ws) for ws in weights],
                        reps=layers)
            cells.append(f"{t * 1e6:.0f} ({flops / t / 1e9:.0f}, {flops / t / 1e9 / peak:.0%})")
        table.add_row(str(rows), *cells)
    Console(width=150).print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=64, help="int4 group (K = 576 takes 32 or 64)")
    ap.add_argument("--sections", default="pachwiqbe", help="p: matrix-vector products, a: paged attention, c: "
                    "prefill attention, h: the online Hadamard, w: W8A16 at many rows, i: W4A16 at many rows, q: W8A8 "
                    "at 1-1024 rows, b: bf16 at 1-256 rows, e: the elementwise ops (default all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = kernels.ops()
    if "p" in args.sections:
        products(ops, args)
    if "a" in args.sections:
        attention(ops, args)
    if "c" in args.sections:
        prefill_attention(ops, args)
    if "h" in args.sections:
        online_hadamard(args)
    if "w" in args.sections:
        many_rows(ops, args)
    if "i" in args.sections:
        int4_rows(ops, args)
    if "q" in args.sections:
        w8a8_rows(ops, args)
    if "b" in args.sections:
        bf16_rows(ops, args)
    if "e" in args.sections:
        elementwise(ops, args)


if __name__ == "__main__":
    main()
