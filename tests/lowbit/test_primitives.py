"""Quantization grid math: SQNR per bit width, granularity and zero-point wins, exact integer matmul."""

from __future__ import annotations

import pytest
import torch

from leanlm.errors import LeanLMError
from leanlm.lowbit.primitives import (QuantSpec, compute_qparams, dequantize, fake_quantize, int8_matmul,
                                      int_matmul_reference, quantize, sqnr_db)


@pytest.fixture
def gaussian():
    return torch.randn(256, 512, generator=torch.Generator().manual_seed(0))


# Thresholds: measured values (seed 0) minus >= 1 dB margin; each extra bit adds ~6 dB.
# Measured: symmetric per-channel 3..8 bits 9.5 .. 42.1 dB, asymmetric group-128 2..8 bits 6.0 .. 44.6 dB.
@pytest.mark.parametrize("bits", range(3, 9))
def test_sqnr_symmetric_channel(gaussian, bits):
    assert sqnr_db(gaussian, fake_quantize(gaussian, QuantSpec(bits, True, "channel"))) > 6 * bits - 10


@pytest.mark.parametrize("bits", range(2, 9))
def test_sqnr_asymmetric_group(gaussian, bits):
    assert sqnr_db(gaussian, fake_quantize(gaussian, QuantSpec(bits, False, "group", 128))) > 6 * bits - 7


def test_named_thresholds(gaussian):
    assert sqnr_db(gaussian, fake_quantize(gaussian, QuantSpec(8, True, "channel"))) > 35
    assert sqnr_db(gaussian, fake_quantize(gaussian, QuantSpec(4, False, "group", 128))) > 15


def test_asymmetric_beats_symmetric_on_shifted_data(gaussian):
    x = gaussian.abs() + 0.5  # all positive: a symmetric grid wastes its negative half
    assert sqnr_db(x, fake_quantize(x, QuantSpec(4, False, "channel"))) > \
        sqnr_db(x, fake_quantize(x, QuantSpec(4, True, "channel"))) + 4


def _sqnr4(x, *specs):
    return [sqnr_db(x, fake_quantize(x, s)) for s in specs]


def test_finer_granularity_wins_with_outliers(gaussian):
    tensor, channel, group = QuantSpec(4, True, "tensor"), QuantSpec(4, True, "channel"), QuantSpec(4, True, "group", 64)
    row_scales = torch.exp(1.5 * torch.randn(256, 1, generator=torch.Generator().manual_seed(1)))
    t, c = _sqnr4(gaussian * row_scales, tensor, channel)  # rows of very different size: per-tensor loses small rows
    assert c > t + 6  # measured 6.1 vs 17.4 dB
    blocks = gaussian.clone()
    blocks[:, 64:128] *= 10  # an outlier block along K: a per-row scale loses the rest of the row
    c, g = _sqnr4(blocks, channel, group)
    assert g > c + 4  # measured 12.1 vs 19.5 dB


def test_shapes_dtypes_and_roundtrip(gaussian):
    for spec, shape in [(QuantSpec(8, True, "tensor"), ()), (QuantSpec(8, True, "channel"), (256, 1)),
                        (QuantSpec(4, False, "group", 32), (256, 16))]:
        scale, zero = compute_qparams(gaussian, spec)
        assert scale.shape == zero.shape == shape and scale.dtype == torch.float32 and zero.dtype == torch.int32
        q = quantize(gaussian, scale, zero, spec)
        assert q.dtype == (torch.int8 if spec.symmetric else torch.uint8)
        assert q.int().min() >= spec.qmin and q.int().max() <= spec.qmax
        # quantizing an already dequantized tensor is exact
        assert torch.equal(quantize(dequantize(q, scale, zero, spec), scale, zero, spec), q)
    x = torch.randn(2, 3, 64)
    scale, _ = compute_qparams(x, QuantSpec(8, True, "token"))
    assert scale.shape == (2, 3, 1)
    assert fake_quantize(x.bfloat16(), QuantSpec(8, True, "token")).dtype == torch.bfloat16


def test_zero_is_exact_and_clip_shrinks_scale(gaussian):
    spec = QuantSpec(3, False, "group", 128)
    assert (fake_quantize(torch.zeros(4, 128), spec) == 0).all()
    x = gaussian.clone()
    x[:, 5] = 0
    assert (fake_quantize(x, spec)[:, 5] == 0).all()
    s1, _ = compute_qparams(gaussian, QuantSpec(8, True, "channel"))
    s2, _ = compute_qparams(gaussian, QuantSpec(8, True, "channel", clip=0.5))
    assert torch.allclose(s2, s1 * 0.5)


@pytest.mark.parametrize("sym_x,sym_w", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("M", [1, 7, 33])
def test_int_matmul_equals_float_matmul_of_dequantized(sym_x, sym_w, M):
    g = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 96, generator=g) + 0.3, torch.randn(40, 96, generator=g)
    xs, ws = QuantSpec(8, sym_x, "token"), QuantSpec(8, sym_w, "channel")
    (sx, zx), (sw, zw) = compute_qparams(x, xs), compute_qparams(w, ws)
    xq, wq = quantize(x, sx, zx, xs), quantize(w, sw, zw, ws)
    bias = torch.randn(40, generator=g)
    ref = dequantize(xq, sx, zx, xs).double() @ dequantize(wq, sw, zw, ws).double().T + bias.double()
    y = int_matmul_reference(xq, sx, None if sym_x else zx, wq, sw, None if sym_w else zw, bias=bias)
    assert y.shape == (M, 40) and torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    # requantized output: round(Y / s_y) + z_y on the uint8 grid
    s_y, z_y = 0.05, 128
    yq = int_matmul_reference(xq, sx, zx, wq, sw, zw, bias=bias, out_scale=s_y, out_zero=z_y)
    assert yq.dtype == torch.uint8
    expect = (ref / s_y).round().add(z_y).clamp(0, 255)
    assert (yq.double() - expect).abs().max() <= 1  # one step where float rounding lands on .5


def test_int8_matmul_padded_path_is_exact(monkeypatch):
    from leanlm.lowbit import primitives
    a = torch.randint(-128, 128, (3, 13), dtype=torch.int8)
    b = torch.randint(-128, 128, (5, 13), dtype=torch.int8)
    monkeypatch.setattr(primitives, "_int_mm_fits", lambda *args: False)  # force the CUDA-rules fallback
    assert torch.equal(int8_matmul(a, b), a.int() @ b.int().T)


def test_sqnr_db():
    x = torch.ones(100)
    assert sqnr_db(x, x) == float("inf")
    assert abs(sqnr_db(x, x * 0.9) - 20.0) < 1e-4  # 0.9 is inexact in float32


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=1), "bits=1"), (dict(bits=9), "bits=9"), (dict(granularity="row"), "granularity='row'"),
    (dict(granularity="group"), "group_size=None"), (dict(granularity="group", group_size=0), "group_size=0"),
    (dict(granularity="channel", group_size=64), "group_size=64"), (dict(clip=1.5), "clip=1.5")])
def test_bad_specs_raise(kwargs, match):
    with pytest.raises(LeanLMError, match=match):
        QuantSpec(**kwargs)


def test_group_size_must_divide_k():
    with pytest.raises(LeanLMError, match=r"group_size=128 does not divide K=96.*\[32\]"):
        fake_quantize(torch.randn(4, 96), QuantSpec(4, False, "group", 128))


@pytest.mark.parametrize("spec", [QuantSpec(4, False, "group", 32), QuantSpec(4, True, "channel"),
                                  QuantSpec(3, False, "tensor"), QuantSpec(8, True, "channel")])
def test_searched_grid_is_never_worse_per_block_and_better_overall(spec):
    from leanlm.lowbit.primitives import _blocks, search_qparams

    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))

    def block_err(scale, zero):  # squared error of each quantization block
        return (_blocks(dequantize(quantize(w, scale, zero, spec), scale, zero, spec) - w, spec)).square().sum(-1)

    plain, searched = block_err(*compute_qparams(w, spec)), block_err(*search_qparams(w, spec, norm=2.0))
    assert (searched <= plain).all() and searched.sum() < plain.sum()
