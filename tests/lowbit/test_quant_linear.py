"""Quantized Linear modules: kernel == dequantize-then-matmul reference, state_dict round trip, bytes per weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leanlm import kernels
from leanlm.errors import LeanLMError
from leanlm.lowbit import linear as linear_module
from leanlm.lowbit.linear import (SCHEMES, FP8Linear, Int8OutlierLinear, W4A16Linear, W8A8Linear, W8A16Linear,
                                  pack_int4, unpack_int4)
from leanlm.lowbit.primitives import int_matmul_reference, sqnr_db
from leanlm.runtime import CPU_BF16_GEMM

MODULES = {
    "w8a16": (W8A16Linear, {}), "w4a16_g32": (W4A16Linear, dict(group_size=32)),
    "w4a16_g128": (W4A16Linear, dict(group_size=128)), "w8a8": (W8A8Linear, {}),
    "w8a8_static": (W8A8Linear, dict(act_scale=4.0 / 127)), "fp8": (FP8Linear, {}),
    "llm_int8": (Int8OutlierLinear, dict(threshold=2.0)),  # ~5% of randn columns hold an |x| >= 2 at M = 1
}
# relative error of the kernel vs the fp32 product with the dequantized weight: bf16 activations/outputs
# (~2^-9 per element), int8 activations (~1/127 of the row's max) for W8A8
REL_TOL = {"w8a8": 3e-2, "w8a8_static": 3e-2, "llm_int8": 3e-2}


def _linear(K, N, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
    return lin


def _rel(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("M", [1, 7, 33])  # W8A16: 1 and 7 its kernel, 33 the prefill GEMM; W4A16: 33 = 4 x 8 rows + 1
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dequantized_reference(name, M, dtype):
    cls, kw = MODULES[name]
    lin = _linear(256, 96, seed=M)
    q = cls.from_float(lin, **kw)
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = q(x)
    assert y.shape == (M, 96) and y.dtype == dtype
    ref = x.float() @ q.dequantized_weight().T + lin.bias.detach()
    assert _rel(y, ref) < REL_TOL.get(name, 1e-2)
    # and the quantized weight is close to the float one
    assert sqnr_db(lin.weight.detach(), q.dequantized_weight()) > (14 if cls is W4A16Linear else 25)


@pytest.mark.parametrize("cls", [W8A16Linear, W4A16Linear])
def test_without_the_leanlm_kernels(monkeypatch, cls):  # no C++ compiler: torch's int8 kernel, dequantized int4
    monkeypatch.setattr(kernels, "ops", lambda: None)
    lin = _linear(256, 96)
    q = cls.from_float(lin)
    x = torch.randn(3, 256).bfloat16()
    assert _rel(q(x), x.float() @ q.dequantized_weight().T + lin.bias.detach()) < 1e-2


@pytest.mark.parametrize("act_scale", [None, 4.0 / 127])
@pytest.mark.parametrize("M, int8_gemm", [(1, True), (5, True), (40, False)])  # 40 rows: prefill without VNNI
def test_w8a8_kernel_equals_int_matmul(monkeypatch, act_scale, M, int8_gemm):  # int32 sums of the same codes
    if kernels.ops() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(linear_module, "CPU_INT8_GEMM", int8_gemm)
    q = W8A8Linear.from_float(_linear(200, 48), act_scale=act_scale)  # K = 200: the kernel's column tail
    x = torch.randn(M, 200).bfloat16()
    x_q, s_x = q.quantize_input(x)
    ref = int_matmul_reference(x_q, s_x, None, q.weight, q.scales, None)  # torch._int_mm
    torch.testing.assert_close(q.int8_product(x), ref, rtol=1e-6, atol=0)


def test_w8a8_takes_the_kernel_up_to_the_rows_it_was_measured_faster_at(monkeypatch):
    """kernels.int8_rows() is measured (a row count it times); past it a CPU with VNNI takes torch._int_mm, with
    the same int32 sums, rescaled in one pass (rescale) to the reference's bits."""
    if kernels.ops() is None:
        pytest.skip("no C++ compiler")
    assert kernels.int8_rows() in (0, *kernels.TIMED_ROWS, 32, 64, 128, 256)
    monkeypatch.setattr(linear_module, "CPU_INT8_GEMM", True)
    monkeypatch.setitem(kernels._loaded, "int8_rows", 2)
    real, calls = kernels.ops(), []
    fake = type("Ops", (), {"int8_gemv_q8": lambda *a: calls.append("kernel") or real.int8_gemv_q8(*a),
                            "rescale": lambda *a: calls.append("_int_mm") or real.rescale(*a),
                            "quantize_rows": real.quantize_rows})
    monkeypatch.setattr(kernels, "ops", lambda: fake)
    q = W8A8Linear.from_float(_linear(200, 48))
    for rows, path in ((2, "kernel"), (3, "_int_mm"), (40, "_int_mm")):
        x = torch.randn(rows, 200).bfloat16()
        ref = int_matmul_reference(*q.quantize_input(x), None, q.weight, q.scales, None)
        calls.clear()
        y = q.int8_product(x)
        torch.testing.assert_close(y, ref, rtol=1e-6, atol=0)
        assert calls == [path] and (path == "kernel" or torch.equal(y, ref))


def test_w8a16_takes_the_kernel_up_to_the_rows_it_was_measured_faster_at(monkeypatch):
    """kernels.w8a16_rows() is measured (a row count it times), or AMX_ROWS with AMX tiles; past it W8A16 runs
    int8_amx, or without AMX widens its codes for one bf16 GEMM (scaled by rescale), or for one float32 product on a
    CPU without a bf16 GEMM (AVX2 only: no kernel), with the same result up to bf16 rounding."""
    if kernels.ops() is None:
        pytest.skip("no C++ compiler")
    assert kernels.w8a16_rows() == kernels.AMX_ROWS if kernels.amx() else \
        kernels.w8a16_rows() in (0, *kernels.TIMED_ROWS, 32, 64)
    monkeypatch.setitem(kernels._loaded, "w8a16_rows", 2)
    real, calls = kernels.ops(), []
    fake = type("Ops", (), {"int8_gemv": lambda *a: calls.append("gemv") or real.int8_gemv(*a),
                            "int8_amx": lambda *a: calls.append("amx") or real.int8_amx(*a),
                            "rescale": lambda *a: calls.append("widened") or real.rescale(*a)})
    monkeypatch.setattr(kernels, "ops", lambda: fake)
    q = W8A16Linear.from_float(_linear(200, 48, bias=False))
    beyond = ["amx"] if kernels.amx() else ["widened"] if CPU_BF16_GEMM else []
    for rows, kernel in ((2, ["gemv"]), (3, beyond)):
        x = torch.randn(rows, 200).bfloat16()
        calls.clear()
        torch.testing.assert_close(q(x).float(), x.float() @ q.dequantized_weight().T, rtol=2e-2, atol=2e-2)
        assert calls == kernel


def test_w4a16_takes_amx_tiles_past_amx_rows(monkeypatch):
    """With AMX, W4A16 on bf16 x runs int4_gemv up to AMX_ROWS rows, int4_amx up to AMX_INT4_EXACT_ROWS
    (deterministic mode's tiles of 16 rows: always int4_amx) and int4_dequant_amx beyond, each close to the
    dequantized weight's product; float32 x keeps int4_gemv."""
    if not kernels.amx():
        pytest.skip("no AMX tiles here")
    kernels.native_bf16()  # asked (float32 x) of the real ops, before they are replaced below
    real, calls = kernels.ops(), []
    fake = type("Ops", (), {"int4_gemv": lambda *a: calls.append("gemv") or real.int4_gemv(*a),
                            "int4_amx": lambda *a: calls.append("amx") or real.int4_amx(*a),
                            "int4_dequant_amx": lambda *a: calls.append("bf16") or real.int4_dequant_amx(*a)})
    monkeypatch.setattr(kernels, "ops", lambda: fake)
    q = W4A16Linear.from_float(_linear(256, 48, bias=False), group_size=64)
    assert q.row_splits() == (kernels.AMX_ROWS, kernels.AMX_INT4_EXACT_ROWS)
    assert kernels.AMX_ROWS < 16 <= kernels.AMX_INT4_EXACT_ROWS
    bf16, exact = kernels.AMX_ROWS, kernels.AMX_INT4_EXACT_ROWS
    for rows, dtype, kernel in ((bf16, torch.bfloat16, ["gemv"]), (bf16 + 1, torch.bfloat16, ["amx"]),
                                (exact, torch.bfloat16, ["amx"]), (exact + 1, torch.bfloat16, ["bf16"]),
                                (16, torch.float32, ["gemv"])):
        x = torch.randn(rows, 256).to(dtype)
        calls.clear()
        torch.testing.assert_close(q(x).float(), x.float() @ q.dequantized_weight().T, rtol=2e-2, atol=5e-2)
        assert calls == kernel
    strided = torch.randn(exact + 1, 512).bfloat16()[:, ::2]  # rows not K apart: the tiles get a contiguous copy
    torch.testing.assert_close(q(strided), q(strided.contiguous()), rtol=0, atol=0)


@pytest.mark.parametrize("M,K,N,g", [(9, 576, 1536, 64), (16, 128, 16, 32), (37, 256, 48, 128), (70, 1536, 576, 128)])
def test_int4_amx_is_the_float32_sum_of_exact_products(M, K, N, g):
    """int4_amx: the codes' exact bf16 products with x summed in float32 per group, then scaled and shifted by the
    group's scale and zero; rows not a multiple of 16 and more than four row blocks included. A row alone: the same."""
    if not kernels.amx():
        pytest.skip("no AMX tiles here")
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).bfloat16()
    codes = torch.randint(0, 16, (N, K), generator=gen)
    scales, zeros = (torch.rand(K // g, N, generator=gen) / 10).bfloat16(), (torch.randn(K // g, N, generator=gen) / 10
                                                                             ).bfloat16()
    weight = (codes - 8) * scales.double().T.repeat_interleave(g, 1) + zeros.double().T.repeat_interleave(g, 1)
    expected = x.double() @ weight.T
    got = kernels.ops().int4_amx(x, pack_int4(codes), scales, zeros, g)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert ((got.double() - expected).abs() <= 1e-5 * expected.abs().amax()).all()
    assert torch.equal(kernels.ops().int4_amx(x[:5].contiguous(), pack_int4(codes), scales, zeros, g), got[:5])


@pytest.mark.parametrize("M,K,N,g", [(1, 128, 64, 32), (17, 256, 48, 64), (70, 1536, 576, 128)])
def test_int4_dequant_amx_is_the_product_with_the_weight_rounded_to_bf16(M, K, N, g):
    """int4_dequant_amx: (q - 8) s + z rounded to bf16 once, then float32 sums of exact products with x's rows."""
    if not kernels.amx():
        pytest.skip("no AMX tiles here")
    gen = torch.Generator().manual_seed(M)
    x, codes = torch.randn(M, K, generator=gen).bfloat16(), torch.randint(0, 16, (N, K), generator=gen)
    scales, zeros = (torch.rand(K // g, N, generator=gen) / 10).bfloat16(), (torch.randn(K // g, N, generator=gen) / 10
                                                                             ).bfloat16()
    weight = (codes - 8) * scales.float().T.repeat_interleave(g, 1) + zeros.float().T.repeat_interleave(g, 1)
    expected = x.double() @ weight.bfloat16().double().T
    got = kernels.ops().int4_dequant_amx(x, pack_int4(codes), scales, zeros, g)
    assert got.dtype == torch.float32 and ((got.double() - expected).abs() <= 1e-5 * expected.abs().amax()).all()


def test_w4a16_widens_its_tiles_from_the_rows_it_was_measured_faster_at(monkeypatch):
    """kernels.int4_packed_rows() is measured (one of INT4_TIMED_ROWS, or past them: never), always above
    deterministic mode's tiles of 16 rows; from it W4A16 on bf16 x runs int4_packed_gemm (AVX512-BF16 without AMX),
    below it int4_gemv, both close to the dequantized weight's product."""
    if kernels.ops() is None or not kernels.native_bf16() or kernels.amx():
        pytest.skip("the widened tiles run only with AVX512-BF16, and not where AMX tiles run")
    assert kernels.int4_packed_rows() in (*kernels.INT4_TIMED_ROWS, kernels.INT4_TIMED_ROWS[-1] + 1)
    assert min(kernels.INT4_TIMED_ROWS) > 16
    monkeypatch.setitem(kernels._loaded, "int4_packed_rows", 3)
    real, calls = kernels.ops(), []
    fake = type("Ops", (), {"int4_gemv": lambda *a: calls.append("gemv") or real.int4_gemv(*a),
                            "int4_packed_gemm": lambda *a: calls.append("widened") or real.int4_packed_gemm(*a)})
    monkeypatch.setattr(kernels, "ops", lambda: fake)
    q = W4A16Linear.from_float(_linear(256, 48, bias=False), group_size=64)
    for rows, kernel in ((2, ["gemv"]), (3, ["widened"])):
        x = torch.randn(rows, 256).bfloat16()
        calls.clear()
        torch.testing.assert_close(q(x).float(), x.float() @ q.dequantized_weight().T, rtol=2e-2, atol=5e-2)
        assert calls == kernel


@pytest.mark.parametrize("M,K,N", [(9, 576, 1536), (37, 200, 45), (64, 64, 16), (150, 1536, 576)])
def test_int8_amx_is_the_float32_sum_of_bf16_products(M, K, N):
    """AMX tiles: the exact products of bf16 activations and int8 codes, summed in float32, then scaled; tails of
    K (32) and N (16) and panels past 64 rows included."""
    if not kernels.amx():
        pytest.skip("no AMX tiles here")
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).bfloat16()
    codes = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scales = torch.rand(N, generator=g).bfloat16()
    expected = (x.double() @ codes.double().T) * scales.double()
    got = kernels.ops().int8_amx(x, codes, scales)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert ((got.double() - expected).abs() <= 1e-5 * expected.abs().amax() + 1e-6).all()
    assert torch.equal(kernels.ops().int8_amx(x[:5].contiguous(), codes, scales), got[:5])  # a row alone: the same


@pytest.mark.parametrize("name", sorted(MODULES))
def test_leading_dims_and_no_bias(name):
    cls, kw = MODULES[name]
    lin = _linear(128, 64, bias=False)
    q = cls.from_float(lin, **kw)
    x = torch.randn(2, 3, 128).bfloat16()
    y = q(x)
    assert y.shape == (2, 3, 64) and q.bias is None
    ref = x.float().reshape(6, 128) @ q.dequantized_weight().T
    assert _rel(y.reshape(6, 64), ref) < REL_TOL.get(name, 1e-2)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_state_dict_round_trip(name, tmp_path):
    cls, kw = MODULES[name]
    q = cls.from_float(_linear(128, 64), **kw)
    torch.save(q.state_dict(), tmp_path / "q.pt")
    fresh = cls(128, 64, bias=torch.zeros(64), **kw)
    fresh.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True))
    x = torch.randn(5, 128).bfloat16()
    assert torch.equal(fresh(x), q(x))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_record_rebuilds_the_module(name):
    cls, kw = MODULES[name]
    q = cls.from_float(_linear(128, 64), **kw)
    rec = q.record()
    assert SCHEMES[rec["scheme"]] is cls
    fresh = cls(128, 64, bias=torch.zeros(64), **{k: v for k, v in rec.items() if k != "scheme"})
    fresh.load_state_dict(q.state_dict())
    x = torch.randn(5, 128).bfloat16()
    assert torch.equal(fresh(x), q(x))


@pytest.mark.parametrize("name,bytes_per_weight", [("w8a16", 1.0), ("w8a8", 1.0), ("fp8", 1.0), ("llm_int8", 1.0),
                                                   ("w4a16_g32", 0.5), ("w4a16_g128", 0.5)])
def test_resident_bytes_match_bits(name, bytes_per_weight):
    cls, kw = MODULES[name]
    N, K = 256, 512
    q = cls.from_float(_linear(K, N, bias=False), **kw)
    total = sum(b.numel() * b.element_size() for b in q.buffers())
    g = kw.get("group_size")
    scales = N * (K // g) * 2 * 2 if g else N * q.scales.element_size()  # int4: bf16 (scale, zero) per group
    assert total == N * K * bytes_per_weight + scales
    assert total <= 1.1 * (N * K * bytes_per_weight + N * (K // (g or K)) * 4)


@pytest.mark.parametrize("N", [16, 48, 192])
def test_int4_packing(N):
    q = torch.randint(0, 16, (N, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (N, 32) and torch.equal(unpack_int4(packed), q)
    # the layout cpu.cpp reads: row 16 t + i, columns 4 j + r -> tile t, 32 bytes per j, byte 2 i + r % 2
    t, i, j = N // 16 - 1, 5, 3
    byte = packed.reshape(-1)[t * 16 * 32 + j * 32 + 2 * i : t * 16 * 32 + j * 32 + 2 * i + 2]
    row = q[16 * t + i, 4 * j : 4 * j + 4]
    assert byte.tolist() == [row[0] | row[2] << 4, row[1] | row[3] << 4]


def test_w4a16_bad_shapes_raise():
    with pytest.raises(LeanLMError, match="group_size=16"):
        W4A16Linear.from_float(_linear(128, 64), group_size=16)
    with pytest.raises(LeanLMError, match="does not divide in_features=96"):
        W4A16Linear.from_float(_linear(96, 64), group_size=64)
    with pytest.raises(LeanLMError, match="out_features divisible by 16"):
        W4A16Linear.from_float(_linear(128, 40), group_size=32)
    with pytest.raises(LeanLMError, match="needs an nn.Linear"):
        W8A16Linear.from_float(nn.Conv1d(4, 4, 1))
    with pytest.raises(LeanLMError, match="act_scale"):
        W8A8Linear.from_float(_linear(128, 64), act_scale=0.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("rows", [1, 33, 100])  # W4A16: tinygemm up to TINYGEMM_MAX_ROWS, dequantized beyond
def test_cuda_matches_reference(name, rows):
    cls, kw = MODULES[name]
    lin = _linear(256, 128)
    q = cls.from_float(lin, **kw).cuda()
    x = torch.randn(rows, 256, device="cuda").bfloat16()
    ref = x.float() @ q.dequantized_weight().cuda().T + lin.bias.detach().cuda()
    tol = 5e-2 if cls is FP8Linear else REL_TOL.get(name, 1e-2)  # _scaled_mm quantizes activations to fp8 too
    assert _rel(q(x), ref) < tol


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("packed", [False, True])
def test_one_graph_per_row_range(name, packed):
    """A compiled decode step serves a range of batch sizes with one graph, the ranges split where a layer's
    row_splits() says its path changes (engine.compiled.row_ranges): inside a range the layer must not branch on
    its row count, or Dynamo's guards narrow the range (ConstraintViolationError; W4A16 on AVX2 once compared its
    rows with the widened path's threshold although that path runs only on AVX512-BF16)."""
    from leanlm.engine.compiled import row_ranges
    from leanlm.models.layers import pack_linears

    cls, kw = MODULES[name]
    if not getattr(cls, "compilable", True):  # LLM.int8(): the engine runs its steps eager (tests/serve/test_protocol.py)
        pytest.skip(f"{cls.__name__} chooses its work from the data: no fixed graph")
    model = nn.Sequential(cls.from_float(_linear(256, 96), **kw))
    if packed and not pack_linears(model):
        pytest.skip("no packed form of this layer on this CPU")
    for lo, hi in row_ranges(model)[1:]:
        torch._dynamo.reset()
        x = torch.randn(lo, 256, dtype=torch.bfloat16)
        torch._dynamo.mark_dynamic(x, 0, min=lo, max=hi)
        with torch.inference_mode():
            assert torch.compile(model, fullgraph=True, backend="eager")(x).shape == (lo, 96)
