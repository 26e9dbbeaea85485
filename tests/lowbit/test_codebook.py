import pytest
import torch

from leanlm import kernels
from leanlm.errors import LeanLMError
from leanlm.lowbit.codebook import AdditiveLinear

needs_kernels = pytest.mark.skipif(kernels.ops() is None, reason="no C++ compiler: the CPU kernels cannot be built")


def _layer(N: int, K: int, C: int, seed: int = 0, bias: bool = False) -> AdditiveLinear:
    g = torch.Generator().manual_seed(seed)
    return AdditiveLinear.from_codes(torch.randint(0, 256, (K // 8, C, N), generator=g),
                                     torch.randn(C, 256, 8, generator=g), torch.rand(N, generator=g) + 0.5,
                                     torch.randn(N, generator=g) if bias else None)


def test_weight_is_the_sum_of_its_codewords():
    m = _layer(16, 32, 3)
    w = m.dequantized_weight()
    books, scales = m.codebooks.float(), m.scales.float()
    for n, g in [(0, 0), (5, 2), (15, 3)]:
        expected = scales[n] * sum(books[c, :, int(m.codes[g, c, n])] for c in range(3))  # stored [C, 8, 256]
        assert torch.equal(w[n, 8 * g:8 * g + 8], expected)


@needs_kernels
@pytest.mark.parametrize("N,K,C", [(64, 96, 2), (100, 64, 1), (48, 200, 3), (37, 24, 4)])
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_kernel_is_the_dequantized_product(N, K, C, rows):
    m = _layer(N, K, C)
    x = torch.randn(rows, K).to(torch.bfloat16)
    y = kernels.ops().codebook_gemv(x, m.codes, m.codebooks, m.scales)
    ref = x.float() @ m.dequantized_weight().T
    assert torch.allclose(y, ref, rtol=1e-5, atol=3e-4 * ref.abs().max())  # int16 tables on AVX-512


@needs_kernels
def test_kernel_gives_the_same_bits_on_any_number_of_threads():
    """Each thread sums the lookups of its own share of the groups; the shares' int32 sums add up exactly."""
    m = _layer(200, 576, 2)
    x = torch.randn(3, 576).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.ops().codebook_gemv(x, m.codes, m.codebooks, m.scales)
        torch.set_num_threads(2)
        two = kernels.ops().codebook_gemv(x, m.codes, m.codebooks, m.scales)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernels
def test_dequant_kernel_rounds_the_weight_to_bf16():
    m = _layer(40, 64, 2)
    assert torch.equal(kernels.ops().codebook_dequant(m.codes, m.codebooks, m.scales),
                       m.dequantized_weight().to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 2, 9])  # the kernel's rows and the dequantized GEMM's
def test_forward_matches_the_weight(rows):
    m = _layer(32, 64, 2, bias=True)
    x = torch.randn(2, rows, 64)
    ref = x @ m.dequantized_weight().T + m.bias
    y = m(x)
    assert y.shape == (2, rows, 32) and y.dtype == x.dtype
    assert torch.allclose(y, ref, rtol=0.02, atol=0.02 * ref.abs().max())


def test_bits_per_weight_count_codebooks_and_scales():
    m = _layer(256, 512, 2)
    assert m.bits_per_weight == pytest.approx(2 + 16 * (2 * 256 * 8 + 256) / (256 * 512))
    assert m.record() == {"scheme": "aqlm", "codebooks": 2}


@pytest.mark.parametrize("kwargs", [dict(in_features=12), dict(codebooks=5), dict(codebooks=0)])
def test_bad_shapes(kwargs):
    with pytest.raises(LeanLMError):
        AdditiveLinear(**{"in_features": 16, "out_features": 8, **kwargs})
