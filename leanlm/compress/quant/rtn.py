"""Round-to-nearest weight quantization onto the runtime kernels (W8A16, W4A16, W8A8, FP8)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from leanlm.compress.registry import check_patterns, decoder_linears, last_match, layer_patterns, register
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import SCHEMES, W4A8Linear, W4A16Linear
from leanlm.lowbit.record import replace
from leanlm.models.layers import Linear

__all__ = ["SCHEMES", "RTN", "KEEP_FLOAT", "FP8", "group_for", "quantize_layer", "quantize_decoder"]


def check_int4_group(group_size: int) -> None:
    """The options' check of an int4 group size: one the W4A16 kernel takes."""
    if group_size not in W4A16Linear.GROUP_SIZES:
        raise LeanLMError(f"--group-size must be one of {W4A16Linear.GROUP_SIZES} for 4 bits, got {group_size}")


KEEP_FLOAT = 16  # a per-layer `bits` that leaves the projection in float (for a later recipe step, or as it is)


@dataclass(frozen=True)
class RTN:
    """bits 8: per-channel int8 weights (W8A16, or W8A8 with act_bits=8); bits 4: int4 groups along K, asymmetric
    (zero points) unless `symmetric` (absmax; 8-bit weights are always symmetric), W4A16 or with act_bits=8 W4A8.

    layers (mixed precision, recipes only): {projection name or glob such as "layers.*.mlp.down_proj": bits}
    overrides bits (and group size) per projection; a value is 4, 8, 16 (left in float) or {bits: 4, group_size:
    32}; where several patterns match a name, the last one wins. Unset, every projection gets `bits`."""

    name: ClassVar[str] = "rtn"
    kind: ClassVar[str] = "quantize"
    bits: int = 8
    group_size: int = 128
    act_bits: int = 16
    layers: dict | None = field(default=None, hash=False)  # a dict cannot be hashed; the other fields identify it
    symmetric: bool = False

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise LeanLMError(f"rtn supports --bits 4 or 8 on the runtime kernels, got {self.bits}")
        if self.act_bits not in (8, 16):
            raise LeanLMError(f"--act-bits must be 8 or 16, got {self.act_bits}")
        self._check_pair(self.bits, self.group_size)
        for pattern, value in layer_patterns("rtn", self.layers, "bits").items():
            self._check_pair(*self._parse(pattern, value), where=f"rtn layers[{pattern!r}]: ")

    def _check_pair(self, bits: int, group_size: int, where: str = "") -> None:
        if bits == 4:
            try:
                check_int4_group(group_size)
            except LeanLMError as e:
                raise LeanLMError(f"{where}{e}") from None

    def _parse(self, pattern: str, value) -> tuple[int, int]:
        """(bits, group size) of one `layers` entry; a LeanLMError naming it when it is not one."""
        bad = LeanLMError(f"rtn layers[{pattern!r}] = {value!r}: give 4, 8, {KEEP_FLOAT} (keep float) or "
                          "{bits: 4, group_size: 32|64|128}")
        if isinstance(value, dict):
            if not set(value) <= {"bits", "group_size"} or "bits" not in value:
                raise bad
            bits, group_size = value["bits"], value.get("group_size", self.group_size)
            if bits != 4 and "group_size" in value:
                raise LeanLMError(f"rtn layers[{pattern!r}]: group_size applies to 4 bits only, not {bits}")
        else:
            bits, group_size = value, self.group_size
        if isinstance(bits, bool) or bits not in (4, 8, KEEP_FLOAT):
            raise bad
        return bits, group_size

    def layer_bits(self, name: str) -> tuple[int, int]:
        """(bits, group size) of the projection `name`: the last `layers` pattern that matches it, else the default."""
        pattern = last_match(self.layers, name)
        return (self.bits, self.group_size) if pattern is None else self._parse(pattern, self.layers[pattern])

    def scheme_for(self, bits: int) -> str:
        return {(4, 16): "w4a16", (4, 8): "w4a8", (8, 16): "w8a16", (8, 8): "w8a8"}[bits, self.act_bits]

    @property
    def scheme(self) -> str:
        return self.scheme_for(self.bits)


@dataclass(frozen=True)
class Int4Options:
    """Options shared by the int4 methods (GPTQ, AWQ, HQQ, AutoRound): each packs onto the W4A16 kernel, groups
    along K (g, or the largest of 64/32 dividing a layer's K), asymmetric (zero points) unless `symmetric` (the
    absmax grid -8..7 that llm-compressor's default int4 scheme uses); act_bits 8: the same weights as W4A8
    (per-token int8 activations)."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "quantize"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    act_bits: int = 16

    def __post_init__(self):
        if self.bits != 4:
            raise LeanLMError(f"{self.name} runs on the int4 kernel here: --bits 4, got {self.bits}")
        if self.act_bits not in (8, 16):
            raise LeanLMError(f"--act-bits must be 8 (W4A8) or 16 (W4A16), got {self.act_bits}")
        check_int4_group(self.group_size)

    def activations(self, layer: W4A16Linear) -> W4A16Linear:
        """The method's int4 layer as its scheme runs it: as it is (W4A16), or W4A8 with act_bits 8."""
        return W4A8Linear.from_w4a16(layer) if self.act_bits == 8 else layer


def group_for(in_features: int, group_size: int) -> int:
    """The requested group size, or the largest supported one below it that divides the layer's K."""
    for g in sorted((g for g in W4A16Linear.GROUP_SIZES if g <= group_size), reverse=True):
        if in_features % g == 0:
            return g
    raise LeanLMError(f"no int4 group size <= {group_size} divides in_features={in_features}")


def quantize_layer(linear, scheme: str, group_size: int = 128, symmetric: bool = False, **options):
    """(quantized module, record) for one nn.Linear; `options` go to the scheme's from_float (threshold=...);
    symmetric: absmax int4 groups (8-bit schemes are symmetric anyway)."""
    if scheme in ("w4a16", "w4a8"):
        new = SCHEMES[scheme].from_float(linear, group_for(linear.in_features, group_size), symmetric=symmetric)
    else:
        new = SCHEMES[scheme].from_float(linear, **options)
    return new, new.record()


def quantize_decoder(model, scheme: str, group_size: int = 128, progress=None, symmetric: bool = False,
                     **options) -> dict[str, dict]:
    """Replace every decoder projection with its quantized module; {layer name: record}."""
    records = {}
    for name, linear in list(decoder_linears(model)):
        new, records[name] = quantize_layer(linear, scheme, group_size, symmetric, **options)
        replace(model, name, new)
        if progress:
            progress(name)
    return records


@register(RTN)
def rtn(model, config: RTN, progress=None, samples=None) -> dict[str, dict]:
    if not config.layers:
        return quantize_decoder(model, config.scheme, config.group_size, progress, config.symmetric)
    linears = list(decoder_linears(model))
    check_patterns("rtn", config.layers, [name for name, _ in linears])
    records = {}
    for name, linear in linears:
        bits, group_size = config.layer_bits(name)
        if bits != KEEP_FLOAT:
            new, records[name] = quantize_layer(linear, config.scheme_for(bits), group_size, config.symmetric)
            replace(model, name, new)
        if progress:
            progress(name)
    return records


@dataclass(frozen=True)
class FP8:
    """float8 e4m3 weights with per-channel scales."""

    name: ClassVar[str] = "fp8"
    kind: ClassVar[str] = "quantize"


@register(FP8)
def fp8(model, config: FP8, progress=None, samples=None) -> dict[str, dict]:
    return quantize_decoder(model, "fp8", progress=progress)


@dataclass(frozen=True)
class Head:
    """Round-to-nearest for the output projection (lm_head), which the other methods leave in 16 bits. It is
    the largest single matrix of a small model (SmolLM2-135M: 28M of 135M weights) and is read by every decode
    step; with tied embeddings the input embedding keeps its 16-bit copy (a lookup reads one row per token).
    act_bits 8 (bits 8 only): W8A8, per-token int8 activations as SmoothQuant's layers, for the batches where the
    head's product is compute-bound; its input (the final norm's output) is smoothed first on the calibration
    windows (smoothquant.smooth_head). SmolLM2-135M after smoothquant (`leanlm compare`, 16383 evaluation tokens):
    perplexity (KL to bf16) 27.669 (0.0106) with the bf16 head, 27.826 (0.0148) with the smoothed W8A8 head (bf16
    27.281); in a one-off check unsmoothed it had KL 0.0182. The head then holds its own int8 copy beside the
    embedding's bf16 rows (+28 MB on that model)."""

    name: ClassVar[str] = "lm_head"
    kind: ClassVar[str] = "quantize"
    bits: int = 8
    group_size: int = 128
    act_bits: int = 16

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise LeanLMError(f"the lm_head is quantized to 8 (per-channel) or 4 (groups) bits, got {self.bits}")
        if self.bits == 4:
            check_int4_group(self.group_size)
        if self.act_bits not in (8, 16) or (self.act_bits == 8 and self.bits != 8):
            raise LeanLMError(f"the lm_head takes act_bits 8 (with bits 8: W8A8) or 16, got act_bits {self.act_bits} "
                              f"with bits {self.bits}")

    @property
    def needs_data(self) -> bool:
        return self.act_bits == 8  # the smoothing's calibration rows

    @property
    def scheme(self) -> str:
        return "w4a16" if self.bits == 4 else "w8a8" if self.act_bits == 8 else "w8a16"


@register(Head)
def head(model, config: Head, progress=None, samples=None) -> dict[str, dict]:
    if not isinstance(model.lm_head, Linear):
        raise LeanLMError("the lm_head is already quantized")
    if config.act_bits == 8:
        from leanlm.compress.quant.smoothquant import smooth_head  # smoothquant builds on this module

        smooth_head(model, samples)
    model.lm_head, record = quantize_layer(model.lm_head, config.scheme, config.group_size)
    if progress:
        progress("lm_head")
    return {"lm_head": record}
