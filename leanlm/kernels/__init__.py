"""leanlm's C++ CPU kernels (cpu.cpp): the int8 and int4 products of W8A16, W4A16 and (decode) W8A8, the bf16
product of a few rows (batched decode), and paged decode attention.

Integer dot products (AVX-512 VNNI, or AVX2 where the CPU has no AVX-512) on activations rounded to int16 (W8A8 on
AVX-512: on its int8 codes as they are, `vpdpbusd`); on the default model's decode matrices they read weights
2.1-2.7x faster than torch's `_weight_int8pack_mm` and 1.7-2.2x faster than `_weight_int4pack_mm_for_cpu` (Zen 3,
2 threads: `python benchmarks/kernels.py`). They are compiled for this machine (-march=native) on first use, ~10 s,
and cached in leanlm's cache ($LEANLM_CACHE/kernels/<library>). `ops()` is None where that fails (no C++ compiler):
callers then fall back to torch ops.

    ops = kernels.ops()
    ops.isa()  # "avx512", "avx2" or "portable" (plain loops, slow): the instructions this build runs
    y = ops.int8_gemv(x, w, scale)  # x [M, K], w [N, K] int8, scale [N] bf16 -> [M, N] float32
    y = ops.int8_gemv_q8(xq, xs, w, scale)  # x = xq [M, K] int8 * xs [M]; scale [N] float32 (W8A8)
    y = ops.rescale(acc, xs, scale)  # acc [M, N] int32 or bf16 * xs [M] (or None) * scale [N] -> float32
    y = ops.int4_gemv(x, packed, scales, zeros, g)  # packed [N, K/2] (linear.pack_int4), scales/zeros [K/g, N]
    y = ops.codebook_gemv(x, codes, codebooks, scale)  # codebook.cpp: AQLM codes [K/8, C, N] uint8, codebooks
                                                       # [C, 8, 256] bf16, scale [N] bf16 -> [M, N] float32
    w = ops.codebook_dequant(codes, codebooks, scale)  # their weight [N, K] bf16
    w = ops.codebook_weight(codes, books, scale, dtype)  # training's: books [C, 256, 8], scale [N] float32
    gb, gs = ops.codebook_weight_backward(codes, books, scale, gw)  # its gradients from the weight's gw [N, K]
    y = ops.int8_24_gemv(x, values, masks, scale)  # sparse.cpp: 2:4-sparse int8 (lowbit/sparse24.pack_24), values
                                                   # [N, K/2] int8, masks [N, ceil(K/8)] uint8, scale [N] bf16
    w = ops.int8_24_unpack(values, masks)  # their dense int8 codes [N, K]
    y = ops.bf16_gemm(x, w)  # x [M, K], w [N, K], both bf16 -> [M, N] bf16 (batched decode of 16-bit models)
    y = ops.bf16_packed_gemm(x, pack_bf16(w))  # the same product on w packed [N/16, K/2, 16, 2] (pack_bf16 below)
    o = ops.paged_attention(q, k, v, tables, lens, block_size[, k_scale, v_scale])  # decode attention, paged KV
    o = ops.prefill_attention(q, k, v, slots[, k_scale, v_scale])  # a prompt chunk against its C keys, causally
    ops.put_keys(k, slots, x)  # new keys into a pool kept by block (cache.paged), k [blocks, Hkv, D/2, bs, 2]
    y = ops.hadamard_rotate(x, bt, scale)  # QuaRot's online rotation (lowbit/hadamard.py OnlineRotation) of rows x
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

from leanlm.fetch import cache_dir, locked

SOURCE = Path(__file__).with_name("cpu.cpp")
SOURCES = tuple(Path(__file__).with_name(f) for f in ("cpu.cpp", "sparse.cpp", "amx.cpp", "codebook.cpp"))  # one .so
HEADER = Path(__file__).with_name("common.h")  # what the sources share: in the hash, not compiled alone
# W8A16 on AMX: int8_gemv up to this many rows, int8_amx beyond. benchmarks/kernels.py --sections w (a layer's
# gate_up and down_proj from memory, 2 threads): at 8 rows int8_gemv 192 us, int8_amx 251; at 16 / 32 / 64 rows
# int8_amx 260 / 314 / 540 against int8_gemv's 325 / 596 / 1367 and the widened codes' 572 / 856 / 926 (bf16
# weights: 413 / 455 / 563); at 256 rows 1829 against the widened codes' 1801
AMX_ROWS = 8
# On AMX CPUs torch's bf16 GEMM and torch._int_mm run on the tiles too, and the timed switches below gave the same
# count in 6 of 6 timings on a 2-vCPU Sapphire Rapids: fixed there, so that every process takes the same paths
AMX_BF16_ROWS = AMX_INT8_ROWS = 4
# The packed layouts on AMX (weights from memory, 2 threads, microseconds; benchmarks/kernels.py): a SmolLM2-135M
# decoder layer's four bf16 products at 1 / 8 / 32 / 256 rows (--sections b), bf16_packed_amx 284 / 293 / 378 / 1260
# against bf16_packed_gemm's 277 / 416 / 1032 / 7782 and torch's 567 / 588 / 630 / 2121, so a PackedLinear runs it at
# any row count; gate_up_proj and down_proj in W8A8 (--sections q), int8_packed_amx (int8_packed_gemm's bits) past
# AMX_INT8_ROWS, 163 / 593 against 185 / 1564 at 32 / 256 rows (125 against 111 at one); in W8A16 (--sections w),
# w8a16_packed_amx, which widens the codes, past AMX_W8_PACKED_ROWS: 223 / 328 / 425 / 921 against
# w8a16_packed_gemm's 201 / 318 / 593 / 2215 at 16 / 32 / 64 / 256 rows
AMX_W8_PACKED_ROWS = 32
# W4A16 on AMX: int4_gemv up to AMX_ROWS, int4_amx's exact products up to AMX_INT4_EXACT_ROWS (a decode step of many
# sequences), and past it int4_dequant_amx (the weight rounded to bf16 once a call: prefill). gate_up_proj and
# down_proj from memory, g64, 2 threads, microseconds at 16 / 32 / 64 / 256 rows: int4_amx 193 / 274 / 541 / 1920,
# int4_dequant_amx 232 / 254 / 389 / 957
AMX_INT4_EXACT_ROWS = 32
# Row counts at which W4A16's two CPU products are timed against each other (int4_packed_rows): all above
# deterministic mode's tiles of 16 rows, so that mode keeps one path
INT4_TIMED_ROWS = (24, 32, 48, 64, 128, 256)
TIMED_ROWS = (1, 2, 4, 8, 16)  # row counts at which a kernel is timed against torch's product (faster_rows)


# isa -> the flags that select cpu.cpp's loops; -march=native picks the best the CPU has
VARIANTS = {"native": [], "avx2": ["-mno-avx512f"], "portable": ["-DLEANLM_PORTABLE"],
            "noprefetch": ["-DLEANLM_PREFETCH=0"]}  # the native loops without software prefetch (an A/B)
_loaded: dict[str, object] = {}  # variant -> op namespace or None (a plain dict: torch.compile traces ops())


def build(variant: str = "native"):
    """Compile and load cpu.cpp once per process; return its op namespace, or None if it cannot be built here.
    variant: "native" (the best loops for this CPU), or, for tests, "avx2" (the AVX2 loops even on an AVX-512
    CPU; namespace leanlm_avx2_*) and "portable" (the plain loops; leanlm_portable_*); "noprefetch" for
    benchmarks/kernels_prefetch.py."""
    if variant not in _loaded:
        _loaded[variant] = _build(variant)
    return _loaded[variant]


def _build(variant: str):
    from torch.utils.cpp_extension import load  # ~60 ms: only a build needs it

    if shutil.which("ninja") is None:  # torch runs `ninja`; the pip package's binary may be off PATH (a venv)
        try:
            import ninja  # optional here: only to find its binary

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass

    # the source's hash in the op namespace: compiled graphs that call these ops are cached on disk by inductor,
    # keyed by the graph; a graph calling an op whose signature changed crashed. A new source is a new namespace.
    source = source_hash()
    name = f"leanlm_{source}" if variant == "native" else f"leanlm_{variant}_{source}"
    flags = ["-O3", "-march=native", "-fopenmp", f"-DLEANLM_NS={name}", *VARIANTS[variant]]
    # torch reuses a cached build whose sources and flags match, and "-march=native" reads the same on every CPU:
    # a build from an AVX-512 machine would crash (illegal instruction) on an AVX2 one sharing the cache
    library = f"{name}_kernels_{_cpu_tag()}"
    directory = cache_dir() / "kernels" / library
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with locked(directory.with_suffix(".lock")) as held:
            if held:  # torch's own lock file, left by a build that was killed, made every later build wait forever;
                (directory / "lock").unlink(missing_ok=True)  # no build runs here without our lock: it is stale
            if not any(directory.glob("*.so")):
                print("leanlm: compiling the CPU kernels (once, ~10 s)", file=sys.stderr)
            with warnings.catch_warnings():  # cpp_extension's own deprecation notices are not the user's concern
                warnings.simplefilter("ignore", DeprecationWarning)
                load(name=library, sources=[str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                     build_directory=str(directory), is_python_module=False)
    except Exception as e:  # no compiler, no headers: quantized layers fall back to torch ops (slower)
        warnings.warn(f"leanlm: CPU kernels not built ({type(e).__name__}: {str(e)[:200]}); "
                      "quantized layers fall back to slower torch paths")
        return None
    ns = getattr(torch.ops, name)
    _register_fakes(name)
    return ns


def ops():
    """leanlm's kernel ops (torch.ops.leanlm_<source hash>), or None where they cannot be built."""
    return build()


def packed_bf16() -> bool:
    """Whether this CPU's build runs bf16_packed_gemm's tiles in vector registers: `vdpbf16ps` with AVX512-BF16,
    FMAs on each pair's halves with AVX2; elsewhere they are plain loops. Where they run, pack_linears packs bf16
    Linears and a bf16 pool keeps its keys by block."""
    if "packed_bf16" not in _loaded:  # a plain dict, as bf16_rows: read while torch.compile traces
        ns = ops()
        _loaded["packed_bf16"] = ns is not None and (ns.bf16_isa() == "avx512bf16" or ns.isa() == "avx2")
    return _loaded["packed_bf16"]


def native_bf16() -> bool:
    """Whether this CPU's build has a bf16 dot product (`vdpbf16ps`, AVX512-BF16): the widened int4 tiles and the
    prompt attention kernel pay only there. A plain bool read while torch.compile traces (the op would break it)."""
    if "native_bf16" not in _loaded:
        ns = ops()
        _loaded["native_bf16"] = ns is not None and ns.bf16_isa() == "avx512bf16"
    return _loaded["native_bf16"]


def pack_pairs(w: torch.Tensor) -> torch.Tensor:
    """bf16_packed_gemm's and w8a16_packed_gemm's layout: a pair of weights k, k + 1 of 16 columns side by side, one
    load (64 bytes of bf16, 32 of int8 codes).  w [N, K] (N % 16 == K % 2 == 0) -> [N/16, K/2, 16, 2], w's dtype"""
    N, K = w.shape
    if N % 16 or K % 2:
        raise ValueError(f"packing pairs needs N % 16 == 0 and K % 2 == 0, got a weight [{N}, {K}]")
    return w.reshape(N // 16, 16, K // 2, 2).transpose(1, 2).contiguous()


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    """pack_pairs's inverse: the weight [N, K]"""
    T, K2 = packed.shape[:2]
    return packed.transpose(1, 2).reshape(T * 16, K2 * 2)


def write_over(w: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """packed, written over w's own memory where it fits (as many elements of the same size, contiguous), so that
    a model whose weights share one buffer on huge pages (runtime.empty_on_huge_pages) keeps them there and holds no
    second copy; else packed as it is."""
    if w.is_contiguous() and w.numel() == packed.numel() and w.element_size() == packed.element_size():
        return w.view(packed.dtype).view(-1).copy_(packed.view(-1)).view(packed.shape)
    return packed


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """bf16_packed_gemm's layout (pack_pairs) in bf16.  w [N, K] -> [N/16, K/2, 16, 2] bf16"""
    return pack_pairs(w.to(torch.bfloat16))


def pack_int8(w: torch.Tensor) -> torch.Tensor:
    """int8_packed_gemm's layout: weights k..k + 3 of 16 columns side by side, 64 bytes, one load; each code + 128
    (unsigned, as `vpdpbusd` multiplies).  w [N, K] int8 (N % 16 == K % 4 == 0) -> [N/16, K/4, 16, 4] uint8"""
    N, K = w.shape
    if N % 16 or K % 4 or w.dtype != torch.int8:
        raise ValueError(f"pack_int8 needs int8 codes [N, K] with N % 16 == 0 and K % 4 == 0, got {w.dtype} [{N}, {K}]")
    return (w.view(torch.uint8) ^ 128).reshape(N // 16, 16, K // 4, 4).transpose(1, 2).contiguous()


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """pack_int8's inverse: the int8 codes [N, K]"""
    T, K4 = packed.shape[:2]
    return (packed ^ 128).transpose(1, 2).reshape(T * 16, K4 * 4).view(torch.int8)


def pack_int4_q8(codes: torch.Tensor) -> torch.Tensor:
    """int4_q8_gemm's layout: per 16 rows and 8 columns k..k + 7, 64 bytes where byte (i, c) holds row i's code
    k + c in its low nibble and k + 4 + c in its high one, so a mask and a shift give two `vpdpbusd` operands.
    codes [N, K] in 0..15 (N % 16 == K % 8 == 0) -> [N/16, K/8, 16, 4] uint8"""
    N, K = codes.shape
    if N % 16 or K % 8:
        raise ValueError(f"pack_int4_q8 needs N % 16 == 0 and K % 8 == 0, got codes [{N}, {K}]")
    c = codes.to(torch.uint8).reshape(N // 16, 16, K // 8, 2, 4)
    return (c[:, :, :, 0] | c[:, :, :, 1] << 4).transpose(1, 2).contiguous()


def unpack_int4_q8(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4_q8's inverse: the codes [N, K] uint8"""
    T, K8 = packed.shape[:2]
    both = torch.stack([packed & 15, packed >> 4], 3)  # [T, K/8, 16, 2, 4]
    return both.permute(0, 2, 1, 3, 4).reshape(T * 16, K8 * 8)


def bf16_product(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether bf16_gemm should compute x @ w.T: both bf16 on a CPU whose build has vector loops for it, and x has
    no more rows than bf16_gemm was measured to be faster at (`bf16_rows`)."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or not x.is_cpu:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False  # the op has no backward
    return x.numel() <= bf16_rows() * x.shape[-1]


def bf16_rows() -> int:
    """Rows of x up to which bf16_gemm is faster than torch's bf16 GEMM on this CPU, or than the float32 product a
    Linear falls back to where the CPU has none (0: never), timed once per machine (~20 ms, ~2 s without a bf16
    GEMM: _time_bf16_rows; _measured_once) on an 8 MB weight, beyond the L2 cache as a model's are. The two differ by
    CPU: on Zen 4 torch's GEMM read weights at 2-14 GB/s at 2-8 rows against the kernel's 17 at one row, so the
    kernel won up to 16 rows; with AMX (Sapphire Rapids) torch's GEMM streams at ~25 GB/s at any of those row counts
    while the kernel's `vdpbf16ps` loop turns compute-bound, 2-4x slower from 8 rows on. With AMX: AMX_BF16_ROWS,
    not timed."""
    if "bf16_rows" not in _loaded:  # a plain dict, as _loaded: read while torch.compile traces
        ns = ops()
        _loaded["bf16_rows"] = 0 if ns is None or ns.bf16_isa() == "portable" else \
            AMX_BF16_ROWS if amx() else _measured_once("bf16_rows", lambda: _time_bf16_rows(ns))
    return _loaded["bf16_rows"]


def _measured_once(name: str, measure) -> int:
    """A switch timed once per machine and kernel build, kept in leanlm's cache for every later process: timed in
    each process, two processes could take different numeric paths and give different logits (a test that compared
    two processes' quantized codes failed under load). A lock makes concurrent first processes time it once. The
    file is $LEANLM_CACHE/kernels/switches-<source hash>-<cpu tag>.json: delete it to time again (a first timing
    taken beside other work is kept as it came)."""
    path = cache_dir() / "kernels" / f"switches-{source_hash()}-{_cpu_tag()}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path.with_suffix(".lock")) as held:
            if not held:  # no fcntl (not POSIX): time in each process, as before
                return measure()
            known = json.loads(path.read_text()) if path.exists() else {}
            if name not in known:
                known[name] = measure()
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(known))
                tmp.replace(path)
            return int(known[name])
    except (OSError, ValueError):
        return measure()


def _time_bf16_rows(ns) -> int:
    """Against what a Linear does past the kernel's rows: torch's bf16 GEMM, or where the CPU has none (AVX2 only,
    runtime.matmul_dtype) the product upcast to float32, which the kernel beat up to 64 rows on Zen 3 (a 32-row
    layer 1.4x), so there it is timed up to 256 rows."""
    from leanlm.runtime import matmul_dtype

    cpu = torch.device("cpu")  # on the CPU even inside a meta-device context
    w, cdt = torch.randn(4096, 1024, device=cpu).to(torch.bfloat16), matmul_dtype(torch.bfloat16, cpu)
    rows = TIMED_ROWS if cdt == torch.bfloat16 else TIMED_ROWS + (32, 64, 128, 256)
    return faster_rows(ns.bf16_gemm, lambda x, w: torch.nn.functional.linear(x.to(cdt), w.to(cdt)), w,
                       lambda m: torch.randn(m, 1024, device=cpu).to(torch.bfloat16), rows)


def int8_rows() -> int:
    """Rows of int8 activation codes up to which W8A8 runs int8_gemv_q8 rather than torch._int_mm (0: never),
    timed once per machine (_measured_once) on an 8 MB weight, up to 256 rows. On Zen 4 the kernel's `vpdpbusd`
    blocks match torch._int_mm at 32-64 rows and lead below (at 8 rows 1.6-2.7x); with AMX (Sapphire Rapids)
    torch._int_mm is ahead from ~8 rows and 2x at 16 (with AMX: AMX_INT8_ROWS, not timed). Only meaningful where
    torch._int_mm has a fast path (runtime.CPU_INT8_GEMM)."""
    if "int8_rows" not in _loaded:  # a plain dict, as _loaded: read while torch.compile traces
        ns = ops()
        _loaded["int8_rows"] = (AMX_INT8_ROWS if amx() else _measured_once("int8_rows", lambda: _time_int8_rows(ns))
                                ) if ns is not None else 0
    return _loaded["int8_rows"]


def w8a16_rows() -> int:
    """Rows of bf16 activations up to which W8A16 runs int8_gemv rather than one bf16 GEMM on its codes widened to
    bf16 (0: never), timed once per machine (~0.2 s, _measured_once) over eight 3072 x 576 weights in turn, as a
    model's layers come: timed on one weight, widening looked faster at 32 rows (its fresh bf16 copy stayed in
    cache), while in the engine the kernel at 32 rows served 1.17x more tokens/s (AMX box). The fixed 16 it
    replaces came from Zen 4. With AMX: AMX_ROWS, not timed, and int8_amx rather than the widened codes beyond it."""
    if "w8a16_rows" not in _loaded:  # a plain dict, as _loaded: read while torch.compile traces
        ns = ops()
        _loaded["w8a16_rows"] = (AMX_ROWS if amx() else _measured_once("w8a16_rows", lambda: _time_w8a16_rows(ns))
                                 ) if ns is not None else 0
    return _loaded["w8a16_rows"]


def int4_packed_rows() -> int:
    """Rows of bf16 x from which W4A16 widens its int4 tiles into bf16_packed_gemm's blocks (int4_packed_gemm) rather
    than reading the codes in int4_gemv, on a CPU with AVX512-BF16 (native_bf16; elsewhere the widening is scalar and
    this is not asked): the first of INT4_TIMED_ROWS at which the widened tiles were faster, timed once per machine
    (_measured_once) over eight 3072 x 576 weights in turn. The two cross where a step turns compute-bound, which moves
    with the CPU: benchmarks/kernels.py --sections i (2 threads, a layer's gate_up_proj and down_proj from memory),
    Zen 4 int4_gemv 526 / 1021 us at 32 / 64 rows, widened 583 / 954; Zen 5 334 / 658 against 291 / 462."""
    if "int4_packed_rows" not in _loaded:  # a plain dict, as _loaded: read while torch.compile traces
        _loaded["int4_packed_rows"] = _measured_once("int4_packed_rows", lambda: _time_int4_packed_rows(ops()))
    return _loaded["int4_packed_rows"]


def _time_int4_packed_rows(ns) -> int:
    cpu = torch.device("cpu")  # any bytes are codes in int4_gemv's layout: two a byte
    weights = [torch.randint(0, 256, (3072, 576 // 2), dtype=torch.uint8, device=cpu) for _ in range(8)]
    scales = (torch.rand(576 // 64, 3072, device=cpu) / 100).bfloat16()
    zeros = torch.zeros(576 // 64, 3072, device=cpu).bfloat16()

    def product(op):
        return lambda x, weights: [op(x, w, scales, zeros, 64) for w in weights]

    codes = faster_rows(product(ns.int4_gemv), product(ns.int4_packed_gemm), weights,
                        lambda m: torch.randn(m, 576, device=cpu).to(torch.bfloat16), INT4_TIMED_ROWS)
    later = [m for m in INT4_TIMED_ROWS if m > codes]
    return later[0] if later else INT4_TIMED_ROWS[-1] + 1


def amx() -> bool:
    """Whether int8_amx runs here: a build with AMX loops, on a CPU whose kernel grants this process the tiles.
    Past AMX_ROWS rows W8A16 then runs it (no timing: the choice is the same in every process)."""
    if "amx" not in _loaded:
        ns = ops()
        _loaded["amx"] = ns is not None and ns.amx()
    return _loaded["amx"]


def _time_w8a16_rows(ns) -> int:
    weights = [torch.randint(-127, 128, (3072, 576), dtype=torch.int8, device="cpu") for _ in range(8)]
    scale = torch.rand(3072, device="cpu").to(torch.bfloat16)

    def ours(x, weights):
        return [ns.int8_gemv(x, w, scale) for w in weights]

    def widened(x, weights):  # as lowbit.linear.W8A16Linear's prefill (_many_rows_w8)
        return [ns.rescale(torch.nn.functional.linear(x, w.to(torch.bfloat16)), None, scale) for w in weights]

    return faster_rows(ours, widened, weights, lambda m: torch.randn(m, 576, device="cpu").to(torch.bfloat16),
                       (*TIMED_ROWS, 32, 64))


def _time_int8_rows(ns) -> int:
    w = torch.randint(-127, 128, (8192, 1024), dtype=torch.int8, device="cpu")
    scale = torch.rand(8192, device="cpu")

    def codes(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randint(-127, 128, (m, 1024), dtype=torch.int8, device="cpu"), torch.rand(m, device="cpu")

    def ours(x, w):
        return ns.int8_gemv_q8(x[0], x[1], w, scale)

    def theirs(x, w):  # as W8A8Linear runs it past int8_rows: rows padded to the 17 _int_mm takes (int8_matmul)
        acc = torch._int_mm(torch.nn.functional.pad(x[0], (0, 0, 0, max(0, 17 - x[0].shape[0]))), w.t())
        return ns.rescale(acc[: x[0].shape[0]], x[1], scale)

    return faster_rows(ours, theirs, w, codes, (*TIMED_ROWS, 32, 64, 128, 256))


def faster_rows(ours, theirs, w: torch.Tensor, make_x, rows=TIMED_ROWS) -> int:
    """The largest of `rows` up to which ours(x, w) took no longer than theirs(x, w) at every count before it (0:
    none), x = make_x(count); each the best of 3 timings of 3 calls after one untimed."""
    faster = 0
    with torch.inference_mode():
        for m in rows:
            x = make_x(m)
            if min(_seconds(ours, x, w) for _ in range(3)) > min(_seconds(theirs, x, w) for _ in range(3)):
                break
            faster = m
    return faster


def _seconds(f, x: torch.Tensor, w: torch.Tensor, reps: int = 3) -> float:
    f(x, w)
    start = time.perf_counter()
    for _ in range(reps):
        f(x, w)
    return (time.perf_counter() - start) / reps


def source_hash() -> str:
    """A short hash of the kernels' C++ sources: a new source is a new build (and a new op namespace)."""
    return hashlib.sha1(b"".join(s.read_bytes() for s in (*SOURCES, HEADER))).hexdigest()[:8]


def cpu_flags() -> list[str]:
    """This CPU's feature flags from /proc/cpuinfo ("avx2", "avx512f", ...; ARM's "Features"), [] where it has none."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return []
    return line.partition(":")[2].split()


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags (the machine name where /proc/cpuinfo has none)."""
    return hashlib.sha1((" ".join(cpu_flags()) or platform.machine()).encode()).hexdigest()[:8]


def _register_fakes(name: str) -> None:
    """Output shapes for torch.compile's tracing (the kernel itself runs at execution)."""

    def product(x, w, *_):  # x [M, K], w [N, ...] -> [M, N] float32
        return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)

    for op in ("int8_gemv", "int4_gemv", "int8_amx", "int4_amx", "int4_dequant_amx"):
        torch.library.register_fake(f"{name}::{op}", product)
    torch.library.register_fake(f"{name}::int8_gemv_q8", lambda xq, xs, w, scale: product(xq, w))
    torch.library.register_fake(f"{name}::rescale", lambda acc, xs, scale: acc.new_empty(acc.shape,
                                                                                          dtype=torch.float32))
    torch.library.register_fake(f"{name}::quantize_rows", lambda x: (x.new_empty(x.shape, dtype=torch.int8),
                                                                     x.new_empty(x.shape[0], dtype=torch.float32)))
    torch.library.register_fake(f"{name}::int8_24_gemv", lambda x, values, masks, scale: product(x, values))
    torch.library.register_fake(f"{name}::int8_24_unpack", lambda v, m: v.new_empty(v.shape[0], 2 * v.shape[1]))
    torch.library.register_fake(f"{name}::bf16_gemm", lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
    for op in ("bf16_packed_gemm", "bf16_packed_amx"):
        torch.library.register_fake(f"{name}::{op}", lambda x, w: x.new_empty(x.shape[0], 16 * w.shape[0]))
    torch.library.register_fake(f"{name}::int4_packed_gemm", lambda x, w, *_: x.new_empty(x.shape[0], w.shape[0]))
    for op in ("int8_packed_gemm", "int8_packed_amx"):
        torch.library.register_fake(f"{name}::{op}", lambda xq, xs, w, scale, dtype: xq.new_empty(
            xq.shape[0], 16 * w.shape[0], dtype=dtype))
    for op in ("w8a16_packed_gemm", "w8a16_packed_amx"):
        torch.library.register_fake(f"{name}::{op}", lambda x, w, scale, dtype: x.new_empty(
            x.shape[0], 16 * w.shape[0], dtype=dtype))
    torch.library.register_fake(f"{name}::int4_q8_gemm", lambda xq, xs, w, scales, zeros, g, dtype: xq.new_empty(
        xq.shape[0], 16 * w.shape[0], dtype=dtype))
    torch.library.register_fake(f"{name}::codebook_gemv", lambda x, codes, *_: x.new_empty(
        x.shape[0], codes.shape[2], dtype=torch.float32))
    torch.library.register_fake(f"{name}::codebook_dequant", lambda codes, books, _: books.new_empty(
        codes.shape[2], 8 * codes.shape[0]))
    torch.library.register_fake(f"{name}::codebook_weight", lambda codes, books, _, dtype: books.new_empty(
        codes.shape[2], 8 * codes.shape[0], dtype=dtype))
    torch.library.register_fake(f"{name}::codebook_weight_backward", lambda codes, books, scale, _: (
        torch.empty_like(books), torch.empty_like(scale)))
    torch.library.register_fake(f"{name}::paged_attention", lambda q, *_: torch.empty_like(q))
    torch.library.register_fake(f"{name}::prefill_attention", lambda q, *_: torch.empty_like(q))
    torch.library.register_fake(f"{name}::hadamard_rotate", lambda x, *_: torch.empty_like(x))
    torch.library.register_fake(f"{name}::put_keys", lambda store, slots, x: None)
