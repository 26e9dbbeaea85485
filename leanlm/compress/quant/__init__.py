"""Quantization: shared grid math (primitives) and runtime quantized Linear modules (linear)."""

from leanlm.compress.quant.linear import FP8Linear, Int8OutlierLinear, W4A16Linear, W8A8Linear, W8A16Linear
from leanlm.compress.quant.primitives import (QuantSpec, compute_qparams, dequantize, fake_quantize, int8_matmul,
                                              int_matmul_reference, quantize, sqnr_db)

__all__ = ["QuantSpec", "compute_qparams", "quantize", "dequantize", "fake_quantize", "int8_matmul",
           "int_matmul_reference", "sqnr_db", "W8A16Linear", "W4A16Linear", "W8A8Linear", "FP8Linear",
           "Int8OutlierLinear"]
