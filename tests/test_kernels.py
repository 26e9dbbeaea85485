"""leanlm's C++ int8 and int4 kernels (the native build, the AVX2 loops and the plain loops) against float matmul
with the same weights."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from leanlm import kernels
from leanlm.fetch import cache_dir
from leanlm.lowbit.linear import pack_int4


def _cpu_has(*flags: str) -> bool:
    return set(flags) <= set(kernels.cpu_flags())


def _build(variant: str = "native"):
    """The build's ops; a skip where there is no compiler, a failure where one is here and cpu.cpp does not build."""
    ops = kernels.build(variant)
    if ops is None:
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip("no C++ compiler: the kernels cannot be built here")
        pytest.fail(f"a C++ compiler is here but the {variant} build of cpu.cpp failed (see the warning)")
    return ops


@pytest.fixture(params=["native", "avx2", "portable"])
def ops(request):
    if request.param == "avx2" and not _cpu_has("avx2", "fma"):
        pytest.skip("this CPU has no AVX2 + FMA")
    return _build(request.param)


def test_each_build_runs_the_loops_it_names():
    assert _build("portable").isa() == "portable"
    native = "avx512" if _cpu_has("avx512f", "avx512bw", "avx512_vnni") else "avx2" if _cpu_has("avx2", "fma") else "portable"
    assert _build().isa() == native
    if _cpu_has("avx2", "fma"):
        assert _build("avx2").isa() == "avx2"


def test_a_build_killed_midway_blocks_no_later_process(tmp_path):
    """torch leaves its lock file in the build directory when the process building is killed (an interrupted first
    run); its next build waited on that file forever. leanlm's own lock, which the OS frees, tells it is stale."""
    _build()
    directory = cache_dir() / "kernels" / f"leanlm_{kernels.source_hash()}_kernels_{kernels._cpu_tag()}"
    (directory / "lock").touch()
    code = "from leanlm import kernels; print(kernels.ops().isa())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == _build().isa(), done.stderr[-2000:]
    assert not (directory / "lock").exists()


def _rel(y, ref):
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("N, K", [(37, 200), (130, 576), (3, 16)])  # K % 64 != 0: masked tails
@pytest.mark.parametrize("M", [1, 2, 3, 8, 19])  # 19: three blocks of rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemv_matches_float(ops, N, K, M, dtype):
    g = torch.Generator().manual_seed(N * M)
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scale = (torch.rand(N, generator=g) + 0.5).bfloat16()
    x = torch.randn(M, K, generator=g).to(dtype)
    ref = x.double() @ (w.double() * scale.double()[:, None]).T
    y = ops.int8_gemv(x, w, scale)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert _rel(y, ref.float()) < 2e-4  # x rounded to int16 (2^-16 of its max), far below bf16's own 2^-9


@pytest.mark.parametrize("N, K", [(37, 200), (130, 576), (3, 16)])  # K % 32 != 0, N % 4 != 0: tails
@pytest.mark.parametrize("M", [1, 3, 4, 9])  # 9: three blocks of rows, the last of one
def test_bf16_gemm_matches_float(ops, N, K, M):
    g = torch.Generator().manual_seed(N * M)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(2 * M, K, generator=g).bfloat16()[::2]  # strided rows: the op makes its own contiguous copy
    ref = x.double() @ w.double().T
    y = ops.bf16_gemm(x, w)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    assert _rel(y, ref.float()) < 2 ** -8  # float32 sums, one rounding to bf16
    with pytest.raises(RuntimeError, match="bf16 x and w"):
        ops.bf16_gemm(x.float(), w)



@pytest.mark.parametrize("N, K", [(16, 2), (80, 200), (48, 576), (32, 1536)])  # 1, 5, 3 and 2 tiles of 16 columns
@pytest.mark.parametrize("M", [1, 2, 3, 8, 19])  # 19: blocks of 8, 8 and 3 rows; 1-2: AVX2's tiles of 3 at once
def test_bf16_packed_gemm_matches_float(ops, N, K, M):
    g = torch.Generator().manual_seed(N * M + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(2 * M, K, generator=g).bfloat16()[::2]  # strided rows: the op makes its own contiguous copy
    packed = kernels.pack_bf16(w)
    t = 1 % (N // 16)  # the second tile where there is one
    assert packed.shape == (N // 16, K // 2, 16, 2) and torch.equal(packed[t, 0, 5], w[t * 16 + 5, :2])
    y = ops.bf16_packed_gemm(x, packed)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    assert _rel(y, (x.double() @ w.double().T).float()) < 2 ** -8  # float32 sums, one rounding to bf16
    for i in range(M):  # a row alone gets its bits in the batch: its sums in the same order at any number of rows
        assert torch.equal(ops.bf16_packed_gemm(x[i:i + 1], packed), y[i:i + 1])


def test_bf16_packed_gemm_bad_arguments(ops):
    with pytest.raises(ValueError, match="N % 16 == 0"):
        kernels.pack_bf16(torch.zeros(24, 8))
    with pytest.raises(RuntimeError, match=r"packed \[N / 16, K / 2, 16, 2\]"):
        ops.bf16_packed_gemm(torch.zeros(1, 8).bfloat16(), torch.zeros(16, 8).bfloat16())
    with pytest.raises(RuntimeError, match="K = 8"):
        ops.bf16_packed_gemm(torch.zeros(1, 6).bfloat16(), kernels.pack_bf16(torch.zeros(16, 8)))


@pytest.mark.parametrize("N, K", [(16, 4), (80, 200), (48, 576), (32, 1536)])  # 1, 5, 3 and 2 tiles of 16 columns
@pytest.mark.parametrize("M", [1, 2, 3, 8, 18, 19, 37])  # AVX-512: blocks of 8 rows; AVX2: of 32, tiles of 1-6 rows
def test_int8_packed_gemm_gives_int8_gemv_q8s_bits(ops, N, K, M):
    """Exact int32 sums, then float(sum) * xs * scale: the same bits as that formula in torch (and so as W8A8's
    torch._int_mm + rescale, and the AVX-512 int8_gemv_q8), in float32 and rounded to bf16 once."""
    g = torch.Generator().manual_seed(N * M + K)
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)  # -128 too: the sign flip must hold
    scale = torch.rand(N, generator=g) + 0.5
    xq, xs = ops.quantize_rows(torch.randn(M, K, generator=g))
    packed = kernels.pack_int8(w)
    t = 1 % (N // 16)
    assert packed.shape == (N // 16, K // 4, 16, 4) and packed.dtype == torch.uint8
    assert torch.equal(packed[t, 0, 5].view(torch.int8) ^ -128, w[t * 16 + 5, :4])
    assert torch.equal(kernels.unpack_int8(packed), w)
    y = ops.int8_packed_gemm(xq, xs, packed, scale, torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, (xq.long() @ w.long().T).float() * xs[:, None] * scale)
    if ops.isa() == "avx512":
        assert torch.equal(y, ops.int8_gemv_q8(xq, xs, w, scale))
    assert torch.equal(ops.int8_packed_gemm(xq, xs, packed, scale, torch.bfloat16), y.bfloat16())


def _int16_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded to int16 per row as the kernels' Rows::round_row: round(x * (32767 / max|x|)) to even."""
    amax = x.float().abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767) / amax, 0)  # (32767 / amax is 32767 * (1 / amax))
    return torch.round(x.float() * inv).clamp(-32768, 32767).long(), (amax / 32767).reshape(-1)


@pytest.mark.parametrize("N, K", [(16, 4), (80, 200), (48, 576), (32, 1536)])  # K 576 and 1536: 3 and 6 chunks
@pytest.mark.parametrize("M", [1, 2, 3, 8, 19, 37])  # AVX2: tiles of 1-5 rows; 37 crosses a block of 32
def test_w8a16_packed_gemm_sums_the_int16_rows_exactly(ops, N, K, M):
    """AVX-512 and AVX2: x rounded to int16 per row (as int8_gemv), exact int32 sums over each 256 columns, added in
    float32, times x's and the weight's scales: that formula's bits in torch, in float32 and rounded to bf16 once, and
    a row's bits alone as in any batch. The plain loops: float products, close to the float reference."""
    g = torch.Generator().manual_seed(N * M + K)
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    scale = (torch.rand(N, generator=g) + 0.5).bfloat16()
    x = torch.randn(M, K, generator=g).bfloat16()
    packed = kernels.pack_pairs(w)
    t = 1 % (N // 16)
    assert packed.shape == (N // 16, K // 2, 16, 2) and packed.dtype == torch.int8
    assert torch.equal(packed[t, 0, 5], w[t * 16 + 5, :2]) and torch.equal(kernels.unpack_pairs(packed), w)
    y = ops.w8a16_packed_gemm(x, packed, scale, torch.float32)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    if ops.isa() != "portable":
        xq, xs = _int16_rows(x)
        sums = torch.zeros(M, N)
        for c in range(0, K, 256):
            sums = sums + (xq[:, c:c + 256] @ w[:, c:c + 256].long().T).float()
        assert torch.equal(y, sums * xs[:, None] * scale.float())
        assert torch.equal(ops.w8a16_packed_gemm(x[-1:], packed, scale, torch.float32), y[-1:])
    else:
        want = x.float() @ w.float().T * scale.float()
        assert torch.allclose(y, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert torch.equal(ops.w8a16_packed_gemm(x, packed, scale, torch.bfloat16), y.bfloat16())


def test_w8a16_packed_gemm_bad_arguments(ops):
    w, scale = torch.zeros(16, 8, dtype=torch.int8), torch.ones(16).bfloat16()
    x = torch.zeros(2, 8).bfloat16()
    with pytest.raises(ValueError, match="K % 2 == 0"):
        kernels.pack_pairs(torch.zeros(16, 7, dtype=torch.int8))
    with pytest.raises(RuntimeError, match=r"packed \[N / 16, K / 2, 16, 2\]"):
        ops.w8a16_packed_gemm(x, w, scale, torch.float32)
    with pytest.raises(RuntimeError, match="K = 8"):
        ops.w8a16_packed_gemm(x[:, :4], kernels.pack_pairs(w), scale, torch.float32)
    with pytest.raises(RuntimeError, match="bf16 scales"):
        ops.w8a16_packed_gemm(x, kernels.pack_pairs(w), scale.float(), torch.float32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.w8a16_packed_gemm(x, kernels.pack_pairs(w), scale, torch.float16)


@pytest.mark.parametrize("N, K, g", [(16, 32, 32), (80, 192, 64), (48, 576, 64), (32, 1536, 128)])
@pytest.mark.parametrize("M", [1, 3, 8, 19])  # 19: blocks of 4 rows and 3
def test_int4_q8_gemm_sums_each_group_exactly(ops, N, K, g, M):
    """W4A8: x's int8 codes against int4 codes 0..15 on W4A16's grid, (q - 8) s + z per group: the float64 formula
    within float32's rounding of the groups' sums; bf16 is float32 rounded once; a row alone gets a batch's bits."""
    gen = torch.Generator().manual_seed(N * M + K)
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen)
    s = (torch.rand(K // g, N, generator=gen) * 0.01).bfloat16()
    z = (torch.randn(K // g, N, generator=gen) * 0.01).bfloat16()
    xq, xs = ops.quantize_rows(torch.randn(M, K, generator=gen))
    packed = kernels.pack_int4_q8(q)
    t = 1 % (N // 16)
    assert packed.shape == (N // 16, K // 8, 16, 4) and torch.equal(kernels.unpack_int4_q8(packed), q)
    assert packed[t, 0, 5, 2] == q[t * 16 + 5, 2] | q[t * 16 + 5, 6] << 4
    w = (q.double() - 8) * s.double().t().repeat_interleave(g, 1) + z.double().t().repeat_interleave(g, 1)
    want = (xq.double() @ w.T) * xs.double()[:, None]
    y = ops.int4_q8_gemm(xq, xs, packed, s, z, g, torch.float32)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(ops.int4_q8_gemm(xq, xs, packed, s, z, g, torch.bfloat16), y.bfloat16())
    assert torch.equal(ops.int4_q8_gemm(xq[-1:], xs[-1:], packed, s, z, g, torch.float32), y[-1:])


def test_int4_q8_gemm_bad_arguments(ops):
    q, s, z = torch.zeros(16, 64, dtype=torch.uint8), torch.ones(2, 16).bfloat16(), torch.zeros(2, 16).bfloat16()
    xq, xs = torch.zeros(2, 64, dtype=torch.int8), torch.ones(2)
    with pytest.raises(ValueError, match="K % 8 == 0"):
        kernels.pack_int4_q8(torch.zeros(16, 12, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"packed \[N / 16, K / 8, 16, 4\]"):
        ops.int4_q8_gemm(xq, xs, q, s, z, 32, torch.float32)
    packed = kernels.pack_int4_q8(q)
    with pytest.raises(RuntimeError, match="a multiple of 8"):
        ops.int4_q8_gemm(xq, xs, packed, s, z, 12, torch.float32)
    with pytest.raises(RuntimeError, match=r"scales and zeros \[K / g, N\]"):
        ops.int4_q8_gemm(xq, xs, packed, s, z, 64, torch.float32)
    with pytest.raises(RuntimeError, match="K = 64"):
        ops.int4_q8_gemm(xq[:, :32].contiguous(), xs, packed, s, z, 32, torch.float32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.int4_q8_gemm(xq, xs, packed, s, z, 32, torch.float16)


def test_int8_packed_gemm_bad_arguments(ops):
    w, scale = torch.zeros(16, 8, dtype=torch.int8), torch.ones(16)
    xq, xs = torch.zeros(2, 8, dtype=torch.int8), torch.ones(2)
    with pytest.raises(ValueError, match="K % 4 == 0"):
        kernels.pack_int8(torch.zeros(16, 6, dtype=torch.int8))
    with pytest.raises(RuntimeError, match=r"packed \[N / 16, K / 4, 16, 4\]"):
        ops.int8_packed_gemm(xq, xs, w, scale, torch.float32)
    with pytest.raises(RuntimeError, match="K = 8"):
        ops.int8_packed_gemm(xq[:, :4].contiguous(), xs, kernels.pack_int8(w), scale, torch.float32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.int8_packed_gemm(xq, xs, kernels.pack_int8(w), scale, torch.float16)
    with pytest.raises(RuntimeError, match="exact up to K = 32768"):
        ops.int8_packed_gemm(xq, xs, torch.zeros(1, 8193, 16, 4, dtype=torch.uint8), scale, torch.float32)


def test_a_bf16_linear_runs_the_kernel_for_a_few_rows_and_keeps_autograd(monkeypatch):
    calls = []
    real = kernels.ops().bf16_gemm if kernels.ops() is not None else None
    if real is None or kernels.ops().bf16_isa() == "portable":
        pytest.skip("no vector bf16 loop in this build")
    from leanlm.models.layers import Linear

    layer = Linear(64, 24, bias=True).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert kernels.bf16_rows() in (0, *kernels.TIMED_ROWS, 32, 64, 128, 256)  # measured once; later calls read it
    monkeypatch.setitem(kernels._loaded, "bf16_rows", 4)  # as if the kernel were measured faster up to 4 rows
    monkeypatch.setattr(kernels, "ops", lambda: type("Ops", (), {"bf16_gemm": lambda *a: calls.append(1) or real(*a)}))
    with torch.no_grad():
        y = layer(x)
        assert calls and _rel(y, ref) < 2 ** -7
        calls.clear()
        layer(torch.randn(5, 64).bfloat16())  # more rows than measured faster: torch's GEMM
        assert not calls
    layer(x).sum().backward()  # weights that want gradients take torch's product, which has a backward
    assert not calls and layer.weight.grad is not None


def test_bf16_rows_are_timed_against_the_product_a_linear_falls_back_to(monkeypatch):
    """Without a bf16 GEMM (AVX2 only) a Linear past bf16_rows upcasts to float32: the kernel is timed against that
    product, up to 256 rows, not against torch's bf16 GEMM (~0.3 GFLOP/s there), which capped it at 16 rows where it
    beat the float32 product up to 64; with a bf16 GEMM, against that GEMM at TIMED_ROWS as before."""
    import leanlm.runtime as runtime

    seen = {}

    def faster_rows(ours, theirs, w, make_x, rows=kernels.TIMED_ROWS):
        seen.update(rows=rows, out=theirs(make_x(2), w))
        return 7

    monkeypatch.setattr(kernels, "faster_rows", faster_rows)
    monkeypatch.setattr(runtime, "matmul_dtype", lambda dtype, device: torch.float32)
    assert kernels._time_bf16_rows(SimpleNamespace(bf16_gemm=None)) == 7
    assert seen["rows"][-1] == 256 and seen["out"].dtype == torch.float32
    monkeypatch.setattr(runtime, "matmul_dtype", lambda dtype, device: dtype)
    kernels._time_bf16_rows(SimpleNamespace(bf16_gemm=None))
    assert seen["rows"] == kernels.TIMED_ROWS and seen["out"].dtype == torch.bfloat16


@pytest.mark.parametrize("N, K, M", [(37, 200, 1), (37, 200, 3), (37, 200, 19), (130, 576, 1), (130, 576, 3),
                                     (130, 576, 19), (130, 576, 37), (5, 33000, 2)])  # the last past vpdpbusd's K
def test_int8_gemv_q8_matches_int_matmul(ops, N, K, M):  # W8A8: the int32 sums exact, not rounded
    g = torch.Generator().manual_seed(N + M)
    xq = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    xs, scale = torch.rand(M, generator=g) + 0.5, torch.rand(N, generator=g) + 0.5
    acc = (xq.long() @ w.long().T).double()
    ref = (acc * xs.double()[:, None] * scale.double()).float()
    y = ops.int8_gemv_q8(xq, xs, w, scale)
    assert y.shape == (M, N) and y.dtype == torch.float32
    if ops.isa() == "portable":  # float sums
        assert _rel(y, ref) < 1e-6
    else:
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="float32 scales of x"):
        ops.int8_gemv_q8(xq, xs.bfloat16(), w, scale)


def test_rescale_is_the_epilogue_it_replaces_bit_for_bit(ops):
    """W8A8's int32 sums times both scales; W8A16's bf16 GEMM output times its bf16 scales."""
    g = torch.Generator().manual_seed(5)
    acc = torch.randint(-2**30, 2**30, (19, 37), dtype=torch.int32, generator=g)
    xs, scale = torch.rand(19, generator=g), torch.rand(37, generator=g)
    assert torch.equal(ops.rescale(acc, xs, scale), acc.float() * xs[:, None] * scale)
    y, scale16 = torch.randn(19, 37, generator=g).bfloat16(), scale.bfloat16()
    assert torch.equal(ops.rescale(y, None, scale16), y.float() * scale16.float())
    with pytest.raises(RuntimeError, match="float32 scales of x"):
        ops.rescale(acc, xs.double(), scale)
    with pytest.raises(RuntimeError, match="int32 or bf16"):
        ops.rescale(acc.float(), xs, scale)


@pytest.mark.parametrize("N, K, g", [(48, 256, 32), (16, 576, 64), (64, 512, 128)])
@pytest.mark.parametrize("M", [1, 3, 19])
def test_int4_gemv_matches_float(ops, N, K, g, M):
    gen = torch.Generator().manual_seed(N * M + g)
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(K // g, N, generator=gen) + 0.5).bfloat16()
    zeros = torch.randn(K // g, N, generator=gen).bfloat16()
    w = (q.double() - 8) * scales.double().t().repeat_interleave(g, 1) + zeros.double().t().repeat_interleave(g, 1)
    x = torch.randn(M, K, generator=gen).bfloat16()
    y = ops.int4_gemv(x, pack_int4(q), scales, zeros, g)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert _rel(y, (x.double() @ w.T).float()) < 2e-4


@pytest.mark.parametrize("N, K, g", [(48, 256, 64), (32, 128, 32), (16, 384, 128)])  # 3 tiles: one block; 2; 1
@pytest.mark.parametrize("M", [1, 9, 20])
def test_int4_packed_gemm_widens_to_the_dequantized_weight(ops, N, K, g, M):
    """Its widened tiles are the dequantized weight rounded to bf16 (one-hot rows of x read them out exactly), and
    the product is that weight's in float32 sums, rounded to bf16 once."""
    gen = torch.Generator().manual_seed(N * M + g)
    q = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(K // g, N, generator=gen) + 0.5).bfloat16()
    zeros = torch.randn(K // g, N, generator=gen).bfloat16()
    w = ((q.float() - 8) * scales.float().t().repeat_interleave(g, 1) + zeros.float().t().repeat_interleave(g, 1))
    w = w.bfloat16()  # W4A16Linear.dequantized_weight, rounded to bf16 once
    onehot = torch.eye(K)[torch.randperm(K, generator=gen)[:M]].bfloat16()
    read = ops.int4_packed_gemm(onehot, pack_int4(q), scales, zeros, g)
    assert torch.equal(read, onehot.float().mm(w.float().T).bfloat16())
    x = torch.randn(M, K, generator=gen).bfloat16()
    y = ops.int4_packed_gemm(x, pack_int4(q), scales, zeros, g)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    assert _rel(y, (x.double() @ w.double().T).float()) < 2 ** -8


def _within_a_bf16_step(y: torch.Tensor, ref: torch.Tensor) -> None:
    """y is ref computed in another order: the same bf16 values but for a rare last-bit difference."""
    assert y.dtype == ref.dtype == torch.bfloat16 and y.shape == ref.shape
    assert ((y.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-30).all()
    assert (y == ref).float().mean() > 0.97


@pytest.mark.parametrize("M, D", [(1, 576), (37, 64)])
def test_rms_norm_is_the_layers_expression(ops, M, D):
    g = torch.Generator().manual_seed(M + D)
    x, w = (torch.randn(M, D, generator=g) * 3).bfloat16(), torch.randn(D, generator=g).bfloat16()
    x32 = x.float()
    ref = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()  # layers.RMSNorm's torch code
    _within_a_bf16_step(ops.rms_norm(x, w, 1e-5), ref)
    with pytest.raises(RuntimeError, match="D % 16 == 0"):
        ops.rms_norm(x[:, :8], w[:8], 1e-5)


@pytest.mark.parametrize("M, I", [(1, 1536), (19, 32)])
def test_silu_mul_is_the_mlps_expression(ops, M, I):
    g = torch.Generator().manual_seed(M + I)
    gate_up = (torch.randn(M, 2 * I, generator=g) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # e^x's range ends and zeros
    gate, up = gate_up.chunk(2, dim=-1)
    _within_a_bf16_step(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    with pytest.raises(RuntimeError, match="I % 16 == 0"):
        ops.silu_mul(gate_up[:, :24])


@pytest.mark.parametrize("D", [64, 128])
def test_rope_is_apply_rope(ops, D):
    from leanlm.models.layers import apply_rope

    g = torch.Generator().manual_seed(D)
    R, heads, rest = 7, 5, 2
    qkv = torch.randn(R, (heads + rest) * D, generator=g).bfloat16()
    angles = torch.rand(R, D // 2, generator=g) * 100
    cos, sin = (f(torch.cat([angles, angles], -1)).bfloat16() for f in (torch.cos, torch.sin))
    ref = apply_rope(qkv.view(1, R, heads + rest, D)[:, :, :heads], cos[None, :, None], sin[None, :, None])[0]
    _within_a_bf16_step(ops.rope(qkv, cos, sin, heads), ref)
    with pytest.raises(RuntimeError, match="D % 32 == 0"):
        ops.rope(qkv, cos[:, :16], sin[:, :16], heads)


def test_bad_arguments_raise(ops):
    w = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        ops.int8_gemv(torch.zeros(64), w, torch.ones(4).bfloat16())
    with pytest.raises(RuntimeError, match="K = 32"):
        ops.int8_gemv(torch.zeros(1, 32), w, torch.ones(4).bfloat16())
    with pytest.raises(RuntimeError, match="int8 weight"):
        ops.int8_gemv(torch.zeros(1, 64), w.float(), torch.ones(4).bfloat16())
    w4, s4 = torch.zeros(16, 32, dtype=torch.uint8), torch.ones(2, 16).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of the group 48"):
        ops.int4_gemv(torch.zeros(1, 64), w4, s4, s4, 48)
    with pytest.raises(RuntimeError, match=r"scales and zeros \[K / g, N\]"):
        ops.int4_gemv(torch.zeros(1, 64), w4, s4[:1], s4, 32)


def test_kernels_run_inside_a_compiled_graph():
    ops = _build()
    w, scale = torch.randint(-127, 128, (48, 64), dtype=torch.int8), torch.rand(48).bfloat16()
    fn = torch.compile(lambda x: ops.int8_gemv(x.bfloat16(), w, scale).relu(), fullgraph=True, dynamic=False)
    x = torch.randn(1, 64)
    assert torch.equal(fn(x), ops.int8_gemv(x.bfloat16(), w, scale).relu())


@pytest.mark.parametrize("dtype,int8", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True),
                                        (torch.bfloat16, True)])
@pytest.mark.parametrize("D, lens, threads", [(64, [1, 4, 5, 17, 33], 2), (128, [300], 2), (80, [150, 7], 4),
                                              (32, [40, 2, 60], 2)],
                         ids=["five-sequences", "one-long", "odd-vectors-empty-part", "split-by-head"])
def test_paged_attention_equals_attention_over_gathered_keys(ops, dtype, int8, D, lens, threads):
    """Each sequence's query against the keys and values its block table names, by the definition (an int8 pool:
    codes times their scale per slot and kv head). Few sequences are split across threads by tokens (one-long), or
    by kv head and tokens when too short (merged by log-sum-exp; with 4 threads the 7-token sequence's second part
    is empty); head sizes of 4, 8, 5 and 2 vectors of 16."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_paged_attention(ops, dtype, int8, D, lens)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D, lens", [(64, [1, 4, 5, 17, 33]), (128, [150]), (80, [40, 2, 90])])
def test_int4_paged_attention_equals_attention_over_what_the_pool_reads(ops, dtype, D, lens):
    """The int4 pool's kernel against attention over the keys and values its `read` gives: codes times per-channel
    (keys) and per-token (values) float16 scales plus minimums, open blocks' keys from the side pool, first tokens
    exact. Every sequence's last block is open (lengths not multiples of 4); sequence 0's first token is a sink."""
    from leanlm.cache.int4 import Int4KVPool
    from leanlm.models.config import ModelConfig

    g = torch.Generator().manual_seed(D)
    B, H, Hkv, bs = len(lens), 6, 2, 4
    cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=H * D, intermediate_size=8, num_layers=1,
                      num_heads=H, num_kv_heads=Hkv, head_dim=D, max_position=512)
    width = max(lens) // bs + 1
    pool = Int4KVPool(cfg, B * width + 3, bs, dtype)
    tables = torch.randperm(pool.num_blocks, generator=g)[: B * width].view(B, width).int()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    for b, n in enumerate(lens):  # each sequence's tokens written in one step, as a prompt
        slots = (tables[b].long()[:, None] * bs + torch.arange(bs)).flatten()[:n]
        k, v = (torch.randn(n, Hkv, D, generator=g).to(dtype) * 3 for _ in range(2))
        pool.prepare(slots, [int(slots[0])] if b == 0 else [])
        pool.write(0, slots, k, v)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    out = ops.paged_attention_int4(q, pool.k[0], pool.v[0], pool.k_scale[0], pool.k_min[0], pool.v_scale[0],
                                   pool.v_min[0], pool.side[0], pool.entry_of, pool.sink_k[0], pool.sink_v[0],
                                   pool.sink_of, tables, lens_t, bs)
    assert len(pool.open) == sum(n % bs > 0 for n in lens) and len(pool.sinks) == 1
    for b in range(B):
        slots = (tables[b].long()[:, None] * bs + torch.arange(bs)).flatten()[: lens[b]]
        k, v = pool.read(0, slots)
        kb, vb = k.float().repeat_interleave(H // Hkv, 1), v.float().repeat_interleave(H // Hkv, 1)
        probs = torch.einsum("hd,shd->hs", q[b].float(), kb).div(D**0.5).softmax(-1)
        expected = torch.einsum("hs,shd->hd", probs, vb)
        scale = expected.abs().max()  # bfloat16: the pool's read rounds each value, the kernel only its output
        assert (out[b].float() - expected).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2) * scale


@pytest.mark.parametrize("T, C, H, Hkv, D", [(40, 40, 6, 2, 64), (37, 100, 9, 3, 64), (1, 17, 4, 4, 128),
                                             (19, 19, 2, 1, 32)],
                         ids=["whole-prompt", "later-chunk", "one-token", "small-head"])
@pytest.mark.parametrize("int8", [False, True])
def test_prefill_attention_equals_causal_attention_over_gathered_keys(ops, T, C, H, Hkv, D, int8):
    """A prompt chunk's T queries (positions C - T .. C - 1) against the C keys and values at scattered pool slots,
    by the definition: scores in float, each query seeing the keys up to its own position. T not a multiple of the
    kernel's 16 positions, C not one of its 16-key tiles; GQA groups of 3, 1 and 2; four threads split the items.
    An int8 pool: its codes times their scales."""
    from leanlm.cache.int8 import quantize_per_token

    g = torch.Generator().manual_seed(T * C)
    k, v = (torch.randn(C + 50, Hkv, D, generator=g).bfloat16() * 2 for _ in range(2))
    pool = k, v
    if int8:
        (kq, ks), (vq, vs) = quantize_per_token(k), quantize_per_token(v)
        pool = kq, vq, ks, vs
        k, v = kq.float() * ks, vq.float() * vs  # the reference reads what the pool holds
    slots = torch.randperm(C + 50, generator=g)[:C]
    q = torch.randn(T, H, D, generator=g).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:  # a strided q
        out = ops.prefill_attention(q.transpose(0, 1).contiguous().transpose(0, 1), *pool[:2], slots, *pool[2:])
    finally:
        torch.set_num_threads(before)
    kb, vb = (x[slots].float().repeat_interleave(H // Hkv, 1) for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.float(), kb) / D**0.5
    seen = torch.arange(C)[None] <= torch.arange(C - T, C)[:, None]  # [T, C]
    expected = torch.einsum("hts,shd->thd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vb)
    assert out.shape == (T, H, D) and out.dtype == torch.bfloat16
    # the weights are rounded to bf16 before the value product (as torch's flash kernel rounds them), the output once
    assert (out.float() - expected).abs().max() < 2e-2 * expected.abs().max()
    with pytest.raises(RuntimeError, match="slot"):
        ops.prefill_attention(q, *pool[:2], slots + 1000, *pool[2:])


@pytest.mark.parametrize("H, Hkv, D, bs, lens, threads", [(9, 3, 64, 16, [1, 16, 17, 40, 300], 2),
                                                           (12, 2, 128, 32, [500], 4), (6, 1, 80, 16, [33, 7], 4)],
                         ids=["groups-of-3", "groups-of-6-split-by-tokens", "odd-vectors"])
@pytest.mark.parametrize("entries, qtype", [(torch.bfloat16, torch.bfloat16), (torch.int8, torch.bfloat16),
                                            (torch.int8, torch.float32)], ids=["bf16", "int8", "int8-float-queries"])
def test_attention_reads_keys_by_block(ops, H, Hkv, D, bs, lens, threads, entries, qtype):
    """A pool's keys by block [blocks, Hkv, D / 2, bs, 2] (cache.paged.put): decode attention and prefill
    attention against the definition over the same keys, with blocks scattered, runs of 16 tokens cut by the
    sequence's end, a sequence split by tokens across threads and query groups of more than 4 heads. An int8 pool:
    codes by block with a scale per slot and kv head (the decode kernel rounds the queries to int16)."""
    from leanlm.cache.int8 import quantize_per_token
    from leanlm.cache.paged import put

    g = torch.Generator().manual_seed(D + bs)
    B, width = len(lens), max(lens) // bs + 1
    blocks = B * width + 3
    k, v = (torch.randn(blocks * bs, Hkv, D, generator=g).bfloat16() * 2 for _ in range(2))
    scales = ()
    if entries == torch.int8:
        (k, ks), (v, vs) = quantize_per_token(k), quantize_per_token(v)
        scales = ks, vs
    keys = torch.full((blocks, Hkv, D // 2, bs, 2), 0 if entries == torch.int8 else float("nan"), dtype=entries)
    put(keys, torch.arange(blocks * bs), k)  # unwritten bf16: NaN
    tables = torch.randperm(blocks, generator=g)[: B * width].view(B, width).int()
    q = torch.randn(B, H, D, generator=g).to(qtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.paged_attention(q, keys, v, tables, torch.tensor(lens, dtype=torch.int32), bs, *scales)
        slots = [(tables[b].long()[:, None] * bs + torch.arange(bs)).flatten()[:n] for b, n in enumerate(lens)]
        prefill = ops.prefill_attention(q[0][None].expand(lens[0], H, D).bfloat16().contiguous(), keys, v, slots[0],
                                        *scales)
    finally:
        torch.set_num_threads(before)
    if scales:  # what the pool holds
        k, v = k.float() * scales[0], v.float() * scales[1]
    tolerance = 1e-3 if qtype == torch.float32 else 1e-2  # the output rounded to bf16 or not
    for b in range(B):
        kb, vb = (x[slots[b]].float().repeat_interleave(H // Hkv, 1) for x in (k, v))
        probs = torch.einsum("hd,shd->hs", q[b].float(), kb).div(D**0.5).softmax(-1)
        expected = torch.einsum("hs,shd->hd", probs, vb)
        assert out.dtype == qtype and (out[b].float() - expected).abs().max() < tolerance * expected.abs().max()
        if b == 0:  # the chunk's last query (position lens[0] - 1) sees every key, as the decode query
            assert (prefill[-1].float() - out[0].float()).abs().max() < 2e-2 * expected.abs().max()
    with pytest.raises(RuntimeError, match="keys by block"):
        ops.paged_attention(q, keys[:, :, :, : bs // 2].contiguous(), v, tables, torch.tensor(lens, dtype=torch.int32),
                            bs, *scales)


@pytest.mark.parametrize("n", [1536, 4864, 48, 64])  # 12 x 128, 152 x 32, 12 x 4 (no 16-float vectors), 1 x 64
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hadamard_rotate_is_the_dense_rotation(ops, n, dtype):
    """QuaRot's online rotation by the kernel (B^T on the left, a fast Walsh-Hadamard transform on the right, the
    random signs) against the row times the dense orthogonal matrix rotation(n)."""
    from leanlm.lowbit.hadamard import _online_factors, rotation

    bt, _, scale = _online_factors(n, 3, torch.device("cpu"))
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(n)).to(dtype)
    y = ops.hadamard_rotate(x, bt, scale)
    expected = x.double() @ rotation(n, seed=3)
    assert y.dtype == dtype and y.shape == x.shape
    assert (y.double() - expected).abs().max() < (1e-5 if dtype == torch.float32 else 1e-2) * expected.abs().max()


def test_quantize_int4_is_the_int4_kv_caches_python_grid_bit_for_bit(ops):
    from leanlm.cache.int4 import fit, pack

    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=g) * torch.rand(300, 1, generator=g) * 5
    x[7] = 0  # a constant group: the smallest scale
    codes, scale, low = ops.quantize_int4(x)
    c, s, lo = fit(x.view(300, 4, 16), -1)
    assert torch.equal(codes, pack(c.flatten(-2))) and torch.equal(scale, s[..., 0]) and torch.equal(low, lo[..., 0])


def _check_paged_attention(ops, dtype, int8, D, lens):
    from leanlm.cache.int8 import quantize_per_token

    g = torch.Generator().manual_seed(D)
    B, H, Hkv, bs = len(lens), 6, 2, 4
    width = max(lens) // bs + 1
    blocks = B * width + 3
    q = torch.randn(B, H, D, generator=g).to(dtype)
    k, v = (torch.randn(blocks * bs, Hkv, D, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor(lens, dtype=torch.int32)
    tables = torch.randperm(blocks, generator=g)[: B * width].view(B, width).int()
    pool = k, v
    if int8:
        (kq, ks), (vq, vs) = quantize_per_token(k), quantize_per_token(v)
        pool = kq, vq, ks, vs
        k, v = kq.float() * ks, vq.float() * vs  # the reference reads what the pool holds
    out = ops.paged_attention(q, *pool[:2], tables, lens, bs, *pool[2:])
    for b in range(B):
        slots = (tables[b].long()[:, None] * bs + torch.arange(bs)).flatten()[: lens[b]]
        kb, vb = k[slots].float().repeat_interleave(H // Hkv, 1), v[slots].float().repeat_interleave(H // Hkv, 1)
        probs = torch.einsum("hd,shd->hs", q[b].float(), kb).div(D**0.5).softmax(-1)
        expected = torch.einsum("hs,shd->hd", probs, vb)
        assert (out[b].float() - expected).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(RuntimeError, match="length"):
        ops.paged_attention(q, *pool[:2], tables, lens + bs * width, bs, *pool[2:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("M, K", [(1, 576), (16, 1536), (5, 37)])
def test_quantize_rows_is_bit_identical_to_the_per_token_grid(ops, dtype, M, K):
    """W8A8's one-pass activation codes equal lowbit.primitives' compute_qparams + quantize, bit for bit (a zero row
    takes the 1e-12 floor; a row of one large value and ties at .5 round as torch does)."""
    from leanlm.lowbit.primitives import QuantSpec, compute_qparams, quantize

    g = torch.Generator().manual_seed(M * K)
    x = (torch.randn(M, K, generator=g) * (torch.rand(M, 1, generator=g) * 10)).to(dtype)
    x[0] = 0
    if M > 1:
        x[1, :3] = torch.tensor([127.0, 0.5, -1.5])  # scale 1: codes 127, 0 and -2 (ties to even)
        x[1, 3:] = 0
    spec = QuantSpec(8, symmetric=True, granularity="token")
    scale, zero = compute_qparams(x, spec)
    codes, scales = ops.quantize_rows(x)
    assert torch.equal(codes, quantize(x, scale, zero, spec)) and torch.equal(scales, scale.reshape(-1))
