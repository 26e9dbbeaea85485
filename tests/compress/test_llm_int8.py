"""LLM.int8(): outlier columns in 16 bits beat plain W8A8, the module equals its dequantize-split-matmul
reference, threshold=inf is plain W8A8, and the method saves and loads to the same logits."""

import json
import math

import pytest
import torch
from torch import nn

from leanlm.compress.quant import format as qformat
from leanlm.compress.quant.llm_int8 import LLMInt8
from leanlm.compress.registry import apply
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import Int8OutlierLinear, W8A8Linear
from leanlm.lowbit.primitives import QuantSpec, compute_qparams, int_matmul_reference, quantize, sqnr_db
from leanlm.lowbit.record import RECORD
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model

OUTLIERS = [3, 40, 101]


def _linear(K=128, N=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(N, generator=g) * 0.1)
    return lin


def _inputs(M=33, K=128, seed=1):
    """Standard-normal activations with a few large outlier feature columns  # [M, K]"""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    x[:, OUTLIERS] *= 40
    return x


def reference(m: Int8OutlierLinear, x: torch.Tensor) -> torch.Tensor:
    """Dequantize, split the columns at the threshold, two matmuls  # [M, K] -> [M, N] float32"""
    outlier = (x.abs() >= m.threshold).any(0)  # [K]
    w = m.dequantized_weight()  # [N, K]
    spec = QuantSpec(8, symmetric=True, granularity="token")
    inliers = x.float() * ~outlier
    scale, zero = compute_qparams(inliers, spec)
    y = int_matmul_reference(quantize(inliers, scale, zero, spec), scale, None, m.weight, m.scales, None)
    return y + x[:, outlier].float() @ w[:, outlier].T + m.bias


def test_outlier_columns_are_found_per_batch():
    m = Int8OutlierLinear.from_float(_linear())
    assert m.outlier_columns(_inputs()).tolist() == OUTLIERS
    assert m.outlier_columns(torch.randn(4, 128) * 0.1).numel() == 0


def test_error_below_plain_w8a8_with_outlier_channels():
    lin, x = _linear(), _inputs()
    expected = lin(x).detach()
    int8 = sqnr_db(expected, Int8OutlierLinear.from_float(lin)(x))
    w8a8 = sqnr_db(expected, W8A8Linear.from_float(lin)(x))
    assert int8 > w8a8 + 10


@pytest.mark.parametrize("M", [1, 33])
def test_equals_its_reference(M):
    m = Int8OutlierLinear.from_float(_linear())
    x = _inputs(M)
    torch.testing.assert_close(m(x), reference(m, x), rtol=1e-5, atol=1e-5)
    x16 = x.bfloat16()  # 16-bit activations: the outlier product runs in bf16
    y = m(x16)
    assert y.dtype == torch.bfloat16
    ref = reference(m, x16)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_threshold_inf_is_plain_w8a8():
    lin = _linear()
    for x in (_inputs(), _inputs().bfloat16().reshape(3, 11, 128)):
        assert torch.equal(Int8OutlierLinear.from_float(lin, math.inf)(x), W8A8Linear.from_float(lin)(x))


@pytest.mark.parametrize("threshold", [0.0, -1.0, float("nan")])
def test_bad_threshold(threshold):
    with pytest.raises(LeanLMError, match="threshold"):
        LLMInt8(threshold)
    with pytest.raises(LeanLMError, match="threshold"):
        Int8OutlierLinear(8, 8, threshold=threshold)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_save_load_gives_identical_logits(tmp_path, arch):
    make_hf_model(arch, tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    config = LLMInt8(threshold=2.5)  # the tiny model's normalized inputs then have some (~10 of 64) outlier columns
    records = apply(model, config)
    assert all(r == {"scheme": "llm_int8", "threshold": 2.5} for r in records.values())
    out = tmp_path / "q"
    out.mkdir()
    qformat.save(model, records, config, tmp_path / "src", out)
    assert json.loads((out / RECORD).read_text())["recipe"][0]["method"] == "llm_int8"
    again = load_model(out, torch.bfloat16)
    assert all(m.threshold == 2.5 for m in again.modules() if isinstance(m, Int8OutlierLinear))
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(11)[None].expand(2, -1)
    assert torch.equal(model(tokens, positions), again(tokens, positions))
