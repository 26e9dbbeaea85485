"""LLM.int8(): int8 weights, with the few activation columns holding outliers computed in 16 bits.

Paper: https://arxiv.org/abs/2208.07339 (Dettmers et al., section 3.2: vector-wise quantization plus a
mixed-precision decomposition of the outlier feature dimensions). The outliers are found at run time in
each batch (Int8OutlierLinear.forward), so no calibration data is needed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from leanlm.compress.quant.rtn import quantize_decoder
from leanlm.compress.registry import register
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import Int8OutlierLinear


@dataclass(frozen=True)
class LLMInt8:
    """threshold: an input column with any |x| >= threshold in a batch is an outlier column (paper: 6.0);
    inf gives plain dynamic W8A8."""

    name: ClassVar[str] = "llm_int8"
    kind: ClassVar[str] = "quantize"
    threshold: float = 6.0

    def __post_init__(self):
        if not self.threshold > 0:  # NaN too
            raise LeanLMError(f"llm_int8 threshold={self.threshold!r} must be positive, such as 6.0 (inf: plain W8A8)")


@register(LLMInt8)
def llm_int8(model, config: LLMInt8, progress=None, samples=None) -> dict[str, dict]:
    return quantize_decoder(model, Int8OutlierLinear.SCHEME, progress=progress, threshold=config.threshold)
