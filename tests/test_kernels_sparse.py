"""The 2:4 int8 kernel (kernels/sparse.cpp) in every build (native, AVX2 loops, plain loops): against float matmul
with the same weights, and exactly equal to the dense int8 kernel on the unpacked codes."""

from __future__ import annotations

import pytest
import torch

from leanlm.compress.sparse.masks import nm_mask
from leanlm.lowbit.sparse24 import pack_24
from tests.test_kernels import _build, _rel, ops  # noqa: F401  (ops: the fixture over the three builds)


def _sparse_codes(N: int, K: int, g: torch.Generator) -> torch.Tensor:
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    q = q.masked_fill(nm_mask(torch.rand(N, K, generator=g), 2, 4), 0)
    q[0, :4] = 0  # a group with no nonzero code, and one with a single one
    q[-1, 4:8] = torch.tensor([0, 0, 7, 0], dtype=torch.int8)
    return q


# K % 64 != 0 (masked tails), K % 8 == 4 (a last half mask byte), K > 4096 (two int32 chunks); N % 16 != 0
@pytest.mark.parametrize("N, K", [(37, 200), (130, 576), (3, 12), (5, 4164)])
@pytest.mark.parametrize("M", [1, 3, 9])  # 9: two blocks of rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_24_gemv_matches_float_and_the_dense_kernel(ops, N, K, M, dtype):  # noqa: F811
    g = torch.Generator().manual_seed(N * M + K)
    q = _sparse_codes(N, K, g)
    values, masks = pack_24(q)
    scale = (torch.rand(N, generator=g) + 0.5).bfloat16()
    x = torch.randn(M, K, generator=g).to(dtype)
    y = ops.int8_24_gemv(x, values, masks, scale)
    assert y.shape == (M, N) and y.dtype == torch.float32
    ref = x.double() @ (q.double() * scale.double()[:, None]).T
    assert _rel(y, ref.float()) < 2e-4  # x rounded to int16, as the dense kernel
    dense = ops.int8_gemv(x, q, scale)
    if ops.isa() == "portable":  # float sums, which the compiler may fuse into FMAs in one loop and not the other
        torch.testing.assert_close(y, dense, rtol=1e-6, atol=1e-6 * dense.abs().max().item())
    else:
        assert torch.equal(y, dense)  # the same integer sums: the same floats


@pytest.mark.parametrize("N, K", [(37, 200), (3, 12), (5, 132)])
def test_int8_24_unpack_gives_the_codes(ops, N, K):  # noqa: F811
    q = _sparse_codes(N, K, torch.Generator().manual_seed(K))
    assert torch.equal(ops.int8_24_unpack(*pack_24(q)), q)


def test_bad_arguments_raise(ops):  # noqa: F811
    values, masks, scale = torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4)
    with pytest.raises(RuntimeError, match="K = 2 x values' columns"):
        ops.int8_24_gemv(torch.zeros(1, 32), values, masks, scale.bfloat16())
    with pytest.raises(RuntimeError, match=r"masks \[N, ceil\(K/8\)\]"):
        ops.int8_24_gemv(torch.zeros(1, 64), values, masks[:, :4], scale.bfloat16())
    with pytest.raises(RuntimeError, match="bf16 scales"):
        ops.int8_24_gemv(torch.zeros(1, 64), values, masks, scale)
    with pytest.raises(RuntimeError, match="int8_24_unpack wants"):
        ops.int8_24_unpack(values, masks[:, :4])


def test_runs_inside_a_compiled_graph():
    ns = _build()  # the native build only (not the fixture's three)
    values, masks = pack_24(_sparse_codes(48, 64, torch.Generator().manual_seed(0)))
    scale = torch.rand(48).bfloat16()
    fn = torch.compile(lambda x: ns.int8_24_gemv(x, values, masks, scale).relu(), fullgraph=True, dynamic=False)
    x = torch.randn(1, 64)
    assert torch.equal(fn(x), ns.int8_24_gemv(x, values, masks, scale).relu())
