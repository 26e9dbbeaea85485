"""Compact 2:4 storage (compress/sparse/format.py) and the runtime module that reads it: pack/unpack exact, bad
input refused clearly, the module equal to W8A16Linear on the same codes, and a saved model loading back equal."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from leanlm.compress.quant import format as qformat
from leanlm.compress.quant.rtn import RTN
from leanlm.compress.registry import decoder_linears
from leanlm.compress.sparse.compact import compact_24
from leanlm.compress.sparse.masks import layer_record, module_sparsity, nm_mask
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W8A16Linear, W8A16Sparse24Linear
from leanlm.lowbit.record import RECORD, replace
from leanlm.lowbit.sparse24 import is_24, pack_24, unpack_24
from leanlm.models.loading import load_model


def _codes(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    return q.masked_fill(nm_mask(torch.rand(N, K, generator=g), 2, 4), 0)


def test_pack_by_hand():
    q = torch.tensor([[1, 0, 2, 0, 0, 0, 0, 5, 0, 0, 0, 0]], dtype=torch.int8)  # K = 12: half a last mask byte
    values, masks = pack_24(q)
    # group 0 keeps positions 0, 2; group 1 its 5 at 3 and the first zero; group 2 its first two zeros
    assert values.tolist() == [[1, 2, 0, 5, 0, 0]]
    assert masks.dtype == torch.uint8 and masks.tolist() == [[0b0101 | 0b1001 << 4, 0b0011]]
    assert torch.equal(unpack_24(values, masks), q)


@pytest.mark.parametrize("N, K", [(1, 4), (3, 12), (7, 40), (16, 576)])
def test_round_trip_is_exact(N, K):
    q = _codes(N, K, seed=N)
    q[0, :4] = 0
    values, masks = pack_24(q)
    assert values.shape == (N, K // 2) and masks.shape == (N, (K + 7) // 8)
    nibbles = torch.stack([masks & 15, masks >> 4], -1).reshape(N, -1)[:, : K // 4]
    assert (nibbles.bitwise_count() if hasattr(torch.Tensor, "bitwise_count") else
            sum((nibbles >> i) & 1 for i in range(4))).eq(2).all()
    assert torch.equal(unpack_24(values, masks), q)


def test_bad_input_is_refused():
    q = _codes(4, 16)
    q[2, 9:12] = 3  # three nonzero codes in inputs 8..11 of row 2
    assert not is_24(q)
    with pytest.raises(LeanLMError, match="row 2, inputs 8..11 hold 3 nonzero codes"):
        pack_24(q, "down_proj")
    with pytest.raises(LeanLMError, match="divisible by 4"):
        pack_24(torch.zeros(2, 6, dtype=torch.int8))
    with pytest.raises(LeanLMError, match="int8 codes"):
        pack_24(torch.zeros(2, 8))
    values, masks = pack_24(_codes(2, 8))
    masks[1, 0] = 0b0111_0011
    with pytest.raises(LeanLMError, match="damaged"):
        unpack_24(values, masks)


@pytest.fixture
def pair():
    """A 2:4-pruned Linear as W8A16Linear and as W8A16Sparse24Linear (same codes)."""
    torch.manual_seed(0)
    linear = nn.Linear(200, 37, bias=True)  # K % 64 != 0, N % 16 != 0
    linear.weight.data.masked_fill_(nm_mask(linear.weight.abs(), 2, 4), 0)
    dense = W8A16Linear.from_float(linear)
    return dense, W8A16Sparse24Linear.from_w8(dense)


@pytest.mark.parametrize("rows", [1, 3, 20, 40])  # 2 x 40: past kernels.w8a16_rows (<= 64), the prefill GEMM
@pytest.mark.parametrize("measured", [None, 0, 8, 64])  # whatever row count this process measured: the same paths
def test_module_equals_w8a16_on_the_same_codes(pair, rows, measured, monkeypatch):
    from leanlm import kernels

    if measured is not None:
        monkeypatch.setitem(kernels._loaded, "w8a16_rows", measured)
    dense, sparse = pair
    assert torch.equal(sparse.codes(), dense.weight) and torch.equal(sparse.dequantized_weight(), dense.dequantized_weight())
    x = torch.randn(2, rows, 200).bfloat16()
    assert torch.equal(sparse(x), dense(x))
    assert sparse.bits_per_weight == 5 + 16 / 200 and module_sparsity(sparse) == (dense.weight == 0).float().mean().item()
    assert sparse.record() == {"scheme": "w8a16_2:4"}


def test_from_float_refuses_a_dense_weight():
    with pytest.raises(LeanLMError, match="not 2:4 sparse"):
        W8A16Sparse24Linear.from_float(nn.Linear(16, 4))


def test_saved_model_loads_back_equal(tiny_dir, tmp_path):
    model = load_model(tiny_dir, torch.float32)
    records = {}
    for name, linear in decoder_linears(model):
        linear.weight.data.masked_fill_(nm_mask(linear.weight.abs(), 2, 4), 0)
        replace(model, name, W8A16Linear.from_float(linear))
        records[name] = {"scheme": "w8a16", **layer_record(linear.weight, (2, 4))}
    tokens = torch.tensor([[1, 5, 9, 2, 7]])
    expected = model(tokens, torch.arange(5)[None], None)
    swapped = compact_24(model, records)
    assert swapped == list(records) and all(r["scheme"] == "w8a16_2:4" and r["pattern"] == "2:4"
                                            for r in records.values())
    codes = {name: model.get_submodule(name).codes() for name in swapped}
    assert torch.equal(model(tokens, torch.arange(5)[None], None), expected)
    out = tmp_path / "compact"
    out.mkdir()
    qformat.save(model, records, RTN(bits=8), tiny_dir, out)
    assert json.loads((out / RECORD).read_text())["layers"] == records
    loaded = load_model(out, torch.float32)
    for name in swapped:
        module = loaded.get_submodule(name)
        assert isinstance(module, W8A16Sparse24Linear) and torch.equal(module.codes(), codes[name])
    assert torch.equal(loaded(tokens, torch.arange(5)[None], None), expected)
