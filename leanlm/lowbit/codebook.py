"""Additive-codebook weights (AQLM): 8 consecutive inputs of an output row are the sum of C codewords, one 8-bit
index into each of C codebooks of 256 entries, times the row's scale, so a weight costs C bits plus the codebooks:

    w[n, 8g:8g+8] = scale[n] * sum_c codebooks[c, :, codes[g, c, n]]   (codebooks [C, 8, 256]: stored transposed)

Written by compress/quant/aqlm.py. Decode runs kernels/codebook.cpp (lookup tables of each row of x's dot products
with every codeword, summed by code), more rows one bf16 GEMM on the weight the kernel dequantizes.
https://arxiv.org/abs/2401.06118 (Egiazarian et al., "Extreme Compression of Large Language Models via Additive
Quantization"; its "2x8" CPU format: two 8-bit codebooks over groups of 8)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leanlm import kernels
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import _QuantLinearBase

ENTRIES = 256  # codewords per codebook (8-bit codes)
DIM = 8  # inputs per codeword
# codebook_gemv up to this many rows, the dequantized weight's bf16 GEMM beyond: benchmarks/codebook.py (a layer's
# gate_up + down from memory, 2 codebooks, Zen 4, 2 threads): 124 / 194 / 319 / 537 / 994 us at 1 / 2 / 4 / 8 / 16
# rows against dequantizing's 766-942 (bf16 weights, leanlm's bf16_gemm: 226-512)
GEMV_ROWS = 8


def codebook_weight(codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight of the definition above  # codes [K/8, C, N], codebooks [C, 8, 256], scales [N] -> [N, K]"""
    G, C, N = codes.shape
    books = codebooks.float().transpose(1, 2)  # [C, 256, 8]
    groups = sum(books[c][codes[:, c].long()] for c in range(C))  # [K/8, N, 8]
    return groups.transpose(0, 1).reshape(N, G * DIM) * scales.float()[:, None]


class AdditiveLinear(_QuantLinearBase):
    """A Linear stored as additive codebooks: codes [K/8, C, N] uint8 (a lookup table's codes for consecutive
    outputs side by side, as the kernel reads them), codebooks [C, 8, 256] bf16 (transposed: the kernel's tables read
    16 entries' value d in one load), scales [N] bf16."""

    SCHEME = "aqlm"
    BITS = 2  # per weight for the default 2 codebooks (bits_per_weight counts the codebooks and scales)

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None, codebooks: int = 2):
        super().__init__(in_features, out_features, bias)
        if in_features % DIM:
            raise LeanLMError(f"additive codebooks need in_features divisible by {DIM}, got {in_features}")
        if codebooks not in (1, 2, 3, 4):
            raise LeanLMError(f"codebooks={codebooks!r}: use 1 to 4 (bits per weight, one 8-bit code per 8 weights "
                              "for each)")
        self.num_codebooks = codebooks
        self.register_buffer("codes", torch.zeros(in_features // DIM, codebooks, out_features, dtype=torch.uint8))
        self.register_buffer("codebooks", torch.zeros(codebooks, DIM, ENTRIES, dtype=torch.bfloat16))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.bfloat16))
        kernels.ops()  # built (or found) now, not first inside a compiled graph

    @classmethod
    def from_codes(cls, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None) -> "AdditiveLinear":
        """codes [K/8, C, N] (0..255), codebooks [C, 256, 8] (each entry's 8 values), scales [N]: stored as uint8
        and bf16, the codebooks transposed."""
        G, C, N = codes.shape
        m = cls(G * DIM, N, None if bias is None else bias.detach().clone(), C)
        m.codes = codes.to(torch.uint8).contiguous()
        m.codebooks = codebooks.detach().transpose(1, 2).to(torch.bfloat16).contiguous()
        m.scales = scales.detach().to(torch.bfloat16).contiguous()
        return m.to(codes.device)

    @property
    def bits_per_weight(self) -> float:
        """C bits a weight, plus the codebooks' and the row scales' share of this layer."""
        stored = 16 * (self.codebooks.numel() + self.scales.numel())
        return self.num_codebooks * 8 / DIM + stored / (self.in_features * self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """Float32 weight the kernel uses  # [N, K]"""
        return codebook_weight(self.codes, self.codebooks, self.scales)

    def row_splits(self) -> tuple[int, ...]:
        return (GEMV_ROWS,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if not x.is_cpu or (ops := kernels.ops()) is None:
            return self._reference(x)
        if x2d.shape[0] <= GEMV_ROWS:
            y = ops.codebook_gemv(x2d, self.codes, self.codebooks, self.scales)
        else:
            y = F.linear(x2d.to(torch.bfloat16), ops.codebook_dequant(self.codes, self.codebooks, self.scales))
        return self._finish(y, x)

    def options(self) -> dict:
        return {"codebooks": self.num_codebooks}

    def extra_repr(self) -> str:
        return super().extra_repr() + f", codebooks={self.num_codebooks}"
