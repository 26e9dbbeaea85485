"""Quantization-aware training: the student's projections compute with fake-quantized weights (and, for W8A8,
activations) on the grid the runtime kernels use, gradients pass the rounding unchanged (the straight-through
estimator, Bengio et al., arXiv 1308.3432), and the trained weights are exported to leanlm's quantized format
by the same round-to-nearest as `leanlm quantize --method rtn`. With the original model as teacher and its own
generations as data this is LLM-QAT's data-free recipe (Liu et al., arXiv 2305.17888)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from leanlm.compress.quant.rtn import RTN, group_for, quantize_decoder
from leanlm.compress.registry import decoder_linears
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear, unpack_int4
from leanlm.lowbit.primitives import QuantSpec, compute_qparams, dequantize, quantize
from leanlm.lowbit.record import replace
from leanlm.models.layers import Linear

TOKEN_INT8 = QuantSpec(8, symmetric=True, granularity="token")  # W8A8's dynamic per-token activations


@dataclass(frozen=True)
class QAT(RTN):
    """The runtime scheme trained for: bits 8 (W8A16; W8A8 with act_bits 8) or 4 (W4A16 groups)."""

    name: ClassVar[str] = "qat"
    kind: ClassVar[str] = "distill"

    @staticmethod
    def parse(text: str) -> QAT:
        """"w8", "w8a8", "w4g128" (w4g32, w4g64) -> QAT."""
        t = text.lower()
        if t in ("w8", "w8a16"):
            return QAT(bits=8)
        if t == "w8a8":
            return QAT(bits=8, act_bits=8)
        if t.startswith("w4g") and t[3:].isdigit():
            return QAT(bits=4, group_size=int(t[3:]))
        raise LeanLMError(f"--qat {text!r}: choose w8, w8a8 or w4g128 (w4g64, w4g32)")

    def weight_spec(self, in_features: int) -> QuantSpec:
        if self.bits == 4:
            return QuantSpec(4, symmetric=False, granularity="group", group_size=group_for(in_features, self.group_size))
        return QuantSpec(8, symmetric=True, granularity="channel")


def straight_through(x: torch.Tensor, spec: QuantSpec, scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x rounded to the grid of `spec` in the forward pass, the identity in the backward pass; the scale is
    rounded to `scale_dtype` first, as the runtime module stores it."""
    with torch.no_grad():
        scale, zero = compute_qparams(x, spec)
        scale = scale.to(scale_dtype).float()
        rounded = dequantize(quantize(x, scale, zero, spec), scale, zero, spec, dtype=x.dtype)
    return x + (rounded - x).detach()


class FakeQuantLinear(Linear):
    """A projection that trains in float but computes as its quantized export will."""

    def __init__(self, linear: Linear, config: QAT):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias  # the same parameters: the optimizer trains them
        self.spec = config.weight_spec(linear.in_features)
        self.scale_dtype = torch.bfloat16 if config.scheme == "w8a16" else torch.float32  # W8A16 keeps bf16 scales
        self.act_quant = config.act_bits == 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = straight_through(self.weight, self.spec, self.scale_dtype)
        if self.act_quant:
            x = straight_through(x.reshape(-1, self.in_features), TOKEN_INT8).reshape(x.shape)
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def prepare(model: torch.nn.Module, config: QAT) -> None:
    """Every decoder projection becomes a FakeQuantLinear over the same weights."""
    if any(hasattr(m, "BITS") for m in model.modules()):
        raise LeanLMError("QAT trains a float model; give the float (or pruned) student, not a quantized one")
    for name, linear in list(decoder_linears(model)):
        replace(model, name, FakeQuantLinear(linear, config))


def export(model: torch.nn.Module, config: QAT, progress=None) -> dict[str, dict]:
    """The trained projections rounded onto the runtime modules (the rest of the model in bf16); their records."""
    records = quantize_decoder(model, config.scheme, config.group_size, progress)
    with torch.no_grad():
        for p in model.parameters():  # embeddings, norms, lm_head: the quantized modules hold buffers
            p.data = p.data.to(torch.bfloat16)
    return records


class TunedGroups(torch.nn.Module):
    """An int4 projection (W4A16, W4A8) in training, its codes fixed and each group's scale and mid learned
    (EfficientQAT's end-to-end step, arXiv 2407.11062): w = (q - 8) * scale * (1 + gain) + mid + scale * shift, with
    gain and shift [N, K/g] starting at 0, so that one learning rate suits every layer's magnitudes. A layer whose
    mids are all 0 (a symmetric grid of RTN, GPTQ, AWQ) keeps them at 0; W4A8's activations are rounded as its
    kernel rounds them."""

    def __init__(self, layer: W4A16Linear):
        super().__init__()
        N, K, g = layer.out_features, layer.in_features, layer.group_size
        self.layer, self.act_quant = layer, layer.SCHEME == "w4a8"  # the layer keeps its codes; pack() its new grid
        self.codes = unpack_int4(layer.weight_packed).view(N, K // g, g).float() - 8
        self.scale = layer.scales.float().t()[..., None]  # [N, K/g, 1]
        self.mid = layer.zeros.float().t()[..., None]
        self.gain = torch.nn.Parameter(torch.zeros_like(self.scale))
        self.shift = torch.nn.Parameter(torch.zeros_like(self.scale), requires_grad=bool(self.mid.any()))

    def scales_mids(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale * (1 + self.gain), self.mid + self.scale * self.shift  # [N, K/g, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, mid = self.scales_mids()
        w = (self.codes * scale + mid).flatten(1)
        if self.act_quant:
            x = straight_through(x.reshape(-1, w.shape[1]), TOKEN_INT8).reshape(x.shape)
        bias = self.layer.bias
        return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))

    def pack(self) -> W4A16Linear:
        """The layer again (its codes as they were, in its own layout), with the learned scales and mids in bf16."""
        with torch.no_grad():
            scale, mid = (t[..., 0].t().to(torch.bfloat16).contiguous() for t in self.scales_mids())
        self.layer.scales, self.layer.zeros = scale, mid
        self.layer._tinygemm_weights = None  # CUDA's copy of the old grid
        return self.layer
