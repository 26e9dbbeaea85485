"""A quantized model in the compressed-tensors layout (PyPI `compressed-tensors`), which vLLM and `transformers`
load: HF tensor names (q/k/v and gate/up split again), the integer codes as they are, and a `quantization_config`
in config.json that names every layer's scheme.

What each of our schemes becomes (N output, K input features; codes unchanged, so the weights are the same):
- w4a16 -> pack-quantized, 4-bit asymmetric groups: weight_packed int32 [N, K/8] (eight codes a word, code i at
  bits 4i), weight_scale [N, K/g], weight_zero_point int32 [N/8, K/g] (packed along N), weight_shape. Our kernel
  keeps the zero point as the bf16 weight (8 - z) s, so the dequantized weights agree up to that rounding
  (at most s/64).
- w4a8 -> as w4a16, and int8 activations per token (dynamic).
- w8a16 -> pack-quantized, 8-bit symmetric channels: weight_packed int32 [N, K/4], weight_scale [N, 1].
- w8a8 -> int-quantized: weight int8 [N, K], weight_scale [N, 1], int8 activations per token (dynamic) or one
  static input_scale.
- fp8 -> float-quantized: weight float8_e4m3fn [N, K], weight_scale [N, 1], weight-only.
LLM.int8()'s 16-bit outlier columns have no compressed-tensors scheme: such a model is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from leanlm.compress.quant.format import copy_model_files
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import (FP8Linear, W4A8Linear, W4A16Linear, W8A8Linear, W8A16Linear, quantized_layers,
                                  unpack_int4)
from leanlm.models.loading import to_hf_names

FORMATS = {W4A16Linear: "pack-quantized", W4A8Linear: "pack-quantized", W8A16Linear: "pack-quantized",
           W8A8Linear: "int-quantized", FP8Linear: "float-quantized"}


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [R, C] (C a multiple of 32 / bits) packed along C into int32 words, code i of a word at bits
    i * bits (compressed-tensors' pack_to_int32 after its +2^(bits-1) offset).  -> [R, C * bits / 32] int32"""
    per = 32 // bits
    R, C = codes.shape
    if C % per:
        raise LeanLMError(f"cannot pack {C} codes of {bits} bits into whole int32 words")
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (codes.to(torch.int64).reshape(R, C // per, per) << shifts).sum(-1)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # two's complement for bit 31


def _int4_zero_points(m: W4A16Linear) -> torch.Tensor:
    """Our zero point z of every group, from the stored bf16 (8 - z) s.  -> [N, K/g] int64 in [0, 15]"""
    s, Z = m.scales.float().t(), m.zeros.float().t()
    z = 8 - Z / torch.where(s == 0, 1.0, s)
    zi = z.round()
    if ((z - zi).abs() > 0.1).any() or (zi < 0).any() or (zi > 15).any():
        raise LeanLMError("this W4A16 layer's zero points are not whole codes in [0, 15]; compressed-tensors "
                          "stores integer zero points")
    return zi.to(torch.int64)


def _tensors(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Row-major tensors of one layer ([N, ...], so fused projections split by rows), codes still unpacked."""
    if isinstance(m, W4A16Linear):
        return {"weight_codes": unpack_int4(m.weight_packed), "weight_scale": m.scales.t().contiguous(),
                "weight_zp_codes": _int4_zero_points(m)}
    if isinstance(m, W8A16Linear):
        return {"weight_codes": m.weight.to(torch.int64) + 128, "weight_scale": m.scales[:, None]}
    return {"weight": m.weight, "weight_scale": m.scales.float()[:, None]}  # w8a8, fp8


def _scheme(m: torch.nn.Module) -> dict:
    """The config group body (weights, input_activations, format) of a layer."""
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
               "dynamic": False, "actorder": None, "observer": "minmax"}
    acts = None
    dynamic = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "group_size": None,
               "dynamic": True, "actorder": None, "observer": "minmax"}  # per-token int8 activations
    if isinstance(m, W4A16Linear):
        weights |= {"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": m.group_size}
        acts = dynamic if isinstance(m, W4A8Linear) else None
    elif isinstance(m, FP8Linear):
        weights |= {"type": "float"}
    elif isinstance(m, W8A8Linear):
        static = m.act_scale is not None
        acts = dynamic | {"strategy": "tensor", "dynamic": False} if static else dynamic
    return {"weights": weights, "input_activations": acts, "output_activations": None, "format": FORMATS[type(m)]}


def _pack(name: str, tensors: dict[str, torch.Tensor], bits: int) -> dict[str, torch.Tensor]:
    """One HF layer's split tensors in their stored form."""
    out = {f"{name}.{k}": v for k, v in tensors.items() if not k.endswith("codes")}
    if "weight_codes" in tensors:
        codes = tensors["weight_codes"]
        out[f"{name}.weight_packed"] = pack_int32(codes, bits)
        out[f"{name}.weight_shape"] = torch.tensor(codes.shape, dtype=torch.int64)
    if "weight_zp_codes" in tensors:
        out[f"{name}.weight_zero_point"] = pack_int32(tensors["weight_zp_codes"].t(), bits).t().contiguous()
    return out


def export(model, source: Path, out: Path) -> dict:
    """Write `model` (a quantized Transformer) to `out` in the compressed-tensors layout, with the config and
    tokenizer files of `source`; return the quantization_config written."""
    model.config.check_portable("compressed-tensors (vLLM, transformers)")
    layers = quantized_layers(model)
    if not layers:
        raise LeanLMError("the model has no quantized layers to export")
    odd = sorted({type(m).__name__ for m in layers.values() if type(m) not in FORMATS})
    if odd:
        raise LeanLMError(f"compressed-tensors has no scheme for {', '.join(odd)} (LLM.int8()'s 16-bit outlier "
                          f"columns, AQLM's codebooks); export supports {', '.join(c.SCHEME for c in FORMATS)}")
    cfg = model.config
    dense = {k: v for k, v in model.state_dict().items() if not any(k.startswith(n + ".") for n in layers)}
    if cfg.tie_embeddings:
        dense.pop("lm_head.weight", None)
    tensors = to_hf_names(dense, cfg)
    groups: dict[str, dict] = {}  # scheme (as JSON) -> its config group, targets filled in below
    for name, m in layers.items():
        own = {f"{name}.{k}": v for k, v in _tensors(m).items()}
        if m.bias is not None:
            own[f"{name}.bias"] = m.bias
        split: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in to_hf_names(own, cfg).items():
            module, _, kind = key.rpartition(".")
            split.setdefault(module, {})[kind] = t
        scheme = _scheme(m)
        group = groups.setdefault(json.dumps(scheme, sort_keys=True), {"targets": [], **scheme})
        for module, parts in split.items():
            if getattr(m, "act_scale", None) is not None:  # static W8A8: one activation scale for every part
                parts["input_scale"] = m.act_scale.float().reshape(1).clone()
            tensors |= _pack(module, parts, scheme["weights"]["num_bits"])
            group["targets"].append(module)
    formats = {g["format"] for g in groups.values()}
    qconfig = {"quant_method": "compressed-tensors", "quantization_status": "compressed",
               "format": formats.pop() if len(formats) == 1 else "mixed-precision",
               "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())},
               "ignore": [] if "lm_head" in layers else ["lm_head"], "kv_cache_scheme": None}
    config = json.loads((Path(source) / "config.json").read_text())
    config["quantization_config"] = qconfig
    if "lm_head" in layers:  # its own quantized weights: transformers must not tie it to the embedding
        config["tie_word_embeddings"] = False
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), {"format": "pt"})
    copy_model_files(source, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))  # over the copy: with quantization_config
    return qconfig
